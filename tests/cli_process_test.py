"""tests/cli_process.py against the real thing: a run forked from the zygote gives what ``subprocess.run`` of a
fresh interpreter gives (exit code, stdout, stderr, arguments, environment, working directory, atexit
handlers, a signal's negative code), and a run past its timeout is killed with its children."""

import os
import subprocess
import sys
import time

import pytest

from tests.cli_process import FRESH_ENV, run_code, run_module

PROBE = """
import atexit, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(sys.argv, os.getcwd(), os.environ.get("PROBE_VALUE"))
print(sys.path[0])       # '' (the working directory) or, under PYTHONSAFEPATH (Bazel's tests), PYTHONPATH's first
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _both(run, *args, **kw):
    forked = run(*args, **kw)
    env = {**(kw.pop("env", None) or os.environ), FRESH_ENV: "1"}
    fresh = run(*args, env=env, **kw)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    return forked


def test_code_sees_its_arguments_environment_and_folder_and_its_atexit_handlers_run(tmp_path):
    proc = _both(run_code, PROBE, ["3", "x y"], env={**os.environ, "PROBE_VALUE": "seen"}, cwd=tmp_path)
    assert proc.returncode == 3
    lines = proc.stdout.splitlines()
    assert lines[0] == f"['-c', '3', 'x y'] {tmp_path} seen" and lines[2:] == ["atexit ran"]
    assert proc.stderr == "to stderr\n"


def test_a_run_sees_its_own_launcher_variables_not_those_that_started_the_zygote():
    """A zygote started by a run with ``RANK`` and ``MASTER_PORT`` (a rank-1 probe) hands a later run the variables
    of its own request, not those (two tests of tests/bad_inputs_test.py, run alone, met the first's rank)."""
    code = "import os; print(os.environ.get('RANK'), os.environ.get('MASTER_PORT'))"
    start = {**os.environ, "PYTHONZYGOTEPROBE": str(time.monotonic_ns())}    # a zygote of its own
    first = run_code(code, env={**start, "RANK": "1", "MASTER_PORT": "39983"})
    later = run_code(code, env={k: v for k, v in start.items() if k not in ("RANK", "MASTER_PORT")})
    again = run_code(code, env={**start, "RANK": "0", "MASTER_PORT": "45945"})
    assert [p.stdout for p in (first, later, again)] == ["1 39983\n", "None None\n", "0 45945\n"]


def test_a_cli_refusal_is_the_fresh_interpreters_exactly():
    proc = _both(run_module, "launchers.cli", ["validate", "--impl", "megatron", "--kernel-backend", "tilelang"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stdout == ""


RANKS = """
import os, types
from orchestration.local_workers import start_processes
from tests.cli_process import probe_rank
print("run", os.getpid(), flush=True)
start_processes(probe_rank, (), 2, types.SimpleNamespace(local_worker_start="forkserver", worker_preload=()))
"""


def _group_gone(pgid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_ranks_fork_from_a_copy_of_the_zygote_and_nothing_outlives_the_run(fresh):
    """A run's forkserver (the cpu target's ranks) is a copy of the forked run, made before it ran, with the
    zygote's imports; a fresh interpreter's imports only what it preloads. Either way the ranks run, and nothing
    of the run's group is left once it has ended (a copy that no run used exits too: the first test here)."""
    env = {**os.environ, FRESH_ENV: "1"} if fresh else None
    proc = run_code(RANKS, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("run ") and sorted(lines[1:]) == [f"0 {not fresh}", f"1 {not fresh}"]
    if not fresh:                              # the forked run leads a process group of its own
        assert _group_gone(int(lines[0].split()[1]))


def test_a_run_that_starts_no_ranks_leaves_nothing_behind():
    proc = run_code("import os; print(os.getpid())")
    assert proc.returncode == 0 and _group_gone(int(proc.stdout))


def test_a_signal_is_a_negative_code():
    assert run_code("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == -9


def _running(pid: int) -> bool:
    """Alive and not a zombie (killed processes wait for a reaper that may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):      # gone, or reaped between open and read (ESRCH)
        return False


def test_a_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_code(code, timeout=3)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child), f"process {child} outlived its run's timeout"
    assert run_code("print('next')").stdout == "next\n"     # the zygote serves the next run


def test_the_zygote_uses_this_interpreter():
    assert run_code("import sys; print(sys.executable)").stdout == f"{sys.executable}\n"


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
