"""``python -m MODULE ARGS`` (or ``-c CODE``) as a process of its own, as a user runs it, without paying its
start-up each time.

A test that runs the CLI as a separate process checks what a user sees: the exit code, stdout and stderr,
exactly. A fresh interpreter spends about 3.5 s of CPU importing torch, megatron-core and the trainer before it
reads its arguments; on the two cores CI has, a file that runs the CLI twenty times spends a minute on that
alone. Here each run is a fork of a zygote: one process per test process (and per set of start-up variables,
``START_PREFIXES``) that imported those modules once (``PRELOAD``: what the cpu target's rank forkserver
preloads, then the launcher and the trainer) and never ran a torch op, so no OpenMP pool is forked. The child

* takes the run's environment and working directory (``orchestration.local_workers.adopt``, as a forked rank does)
  and, without ``PYTHONSAFEPATH``, puts that directory first on ``sys.path`` as ``-m`` does,
* writes stdout and stderr to files of its own, reads stdin from /dev/null, leads a process group of its own
  (a timeout kills the group: the run's own ranks and servers with it),
* runs MODULE as ``__main__`` (runpy), then what an interpreter does at exit (non-daemon threads joined,
  atexit handlers, streams flushed), and exits with the module's code.

A run that starts ranks on the cpu target (a multiprocessing forkserver, :mod:`orchestration.local_workers`) gets
as its forkserver a copy of itself made before it ran (:func:`_fork_server_template`), not a fresh interpreter.

What a fork cannot show: a warning printed while PRELOAD is imported goes to the zygote's stderr (the test's
log), not the run's; the unsupported-combination refusals (their stderr exactly, one run of each kind per
process) keep a fresh interpreter. A run that passes ``input`` gets one too (``subprocess.run``), and so
does every run under ``DSV4_TEST_FRESH_CLI=1``, for comparing the two.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
# torch._dynamo last: every training run imports it (torch.optim's add_param_group is wrapped by
# torch._disable_dynamo, and core.kernel_ops' op counter is built with torch.compiler.assume_constant_result),
# about 0.5 s of CPU in each forked run and rank when the zygote had not (2026-12-04); imported here, after the
# CPU shims, it sees what a run sees (no triton)
PRELOAD = ("backends.cpu.worker_preload", "launchers.cli", "orchestration.training", "core.assembly", "torch._dynamo")
FRESH_ENV = "DSV4_TEST_FRESH_CLI"
#: Variables read when an interpreter starts or as a preloaded library is imported (the interpreter's own,
#: OpenMP's, torch's logging and allocator settings, the trackers', the dynamic loader's): runs that differ in
#: any of them get zygotes of their own. Everything else (``DSV4_*``, ``HF_*``: this repository and
#: huggingface_hub, which PRELOAD does not import) is read at run time and taken from the request.
START_PREFIXES = ("PYTHON", "OMP_", "KMP_", "MKL_", "TORCH", "PYTORCH_", "CUDA", "WANDB_", "TENSORBOARD", "LD_")

__all__ = ["run_cli", "run_module", "run_code", "PRELOAD"]


# -- the test's side -----------------------------------------------------------------------------------------
class _Zygote:
    """One zygote process and its request channel (a request at a time: a run's pid, then its exit code)."""

    def __init__(self, env: Mapping[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-c", _START, str(ROOT), *PRELOAD], cwd=ROOT, env=dict(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def _reply(self, deadline: Optional[float]) -> Optional[dict]:
        """The zygote's next reply, or None at ``deadline``."""
        out = self.proc.stdout
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([out], [], [], wait)[0]:
            return None
        line = out.readline()
        if not line:
            raise RuntimeError(f"the CLI zygote exited (code {self.proc.wait()}); its stderr is in the test log")
        return json.loads(line)

    def run(self, cmd: list, main: dict, args: Sequence[str], env: Mapping[str, str], cwd: str,
            timeout: Optional[float]) -> subprocess.CompletedProcess:
        """``main``: ``{"module": name}`` (``-m``) or ``{"code": source}`` (``-c``)."""
        with self.lock, tempfile.TemporaryDirectory(prefix="dsv4cli") as folder:
            streams = {"stdout": os.path.join(folder, "stdout"), "stderr": os.path.join(folder, "stderr")}
            request = {**main, "args": list(args), "env": dict(env), "cwd": cwd, **streams}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(None)["pid"]
            deadline = None if timeout is None else time.monotonic() + timeout
            reply = self._reply(deadline)
            if reply is None:                    # as subprocess.run: kill it, then raise
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._reply(None)
                raise subprocess.TimeoutExpired(cmd, timeout, Path(streams["stdout"]).read_text(),
                                                Path(streams["stderr"]).read_text())
            read = {k: Path(p).read_text(errors="replace") for k, p in streams.items()}
            return subprocess.CompletedProcess(cmd, reply["rc"], read["stdout"], read["stderr"])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


# the zygote's ``-c``: this module from the repository (on sys.path already where PYTHONPATH holds it)
_START = ("import sys\nif sys.argv[1] not in sys.path: sys.path.append(sys.argv[1])\n"
          "from tests.cli_process import _serve\n_serve(sys.argv[2:])")
_zygotes: Dict[tuple, _Zygote] = {}


def _zygote_for(env: Mapping[str, str]) -> _Zygote:
    """The zygote whose start matches ``env``'s (the variables of :data:`START_PREFIXES`), started on first use."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_PREFIXES)))
    zygote = _zygotes.get(key)
    if zygote is None or zygote.proc.poll() is not None:
        zygote = _zygotes[key] = _Zygote(env)
    return zygote


@atexit.register
def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()


def _run(main: dict, args: Sequence, env, cwd, timeout, input) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    flag, value = ("-m", main["module"]) if "module" in main else ("-c", main["code"])
    args = [str(a) for a in args]
    cmd = [sys.executable, flag, value, *args]
    if input is not None or env.get(FRESH_ENV) == "1":
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, input=input)
    return _zygote_for(env).run(cmd, main, args, env, cwd, timeout)


def run_module(module: str, args: Sequence = (), *, env: Optional[Mapping[str, str]] = None, cwd=None,
               timeout: Optional[float] = None, input: Optional[str] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
    cwd=cwd, timeout=timeout, input=input)``, the same result, from a fork of a preloaded zygote (module
    docstring). ``env``: the whole environment (None: this process's)."""
    return _run({"module": module}, args, env, cwd, timeout, input)


def run_cli(*args, env: Optional[Mapping[str, str]] = None, cwd=None, timeout: float = 300):
    """``dsv4 ARGS`` (``python -m launchers.cli``) as a user runs it: :func:`run_module` with ``env`` on top of
    this process's environment."""
    return run_module("launchers.cli", args, env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)


def run_code(code: str, args: Sequence = (), *, env: Optional[Mapping[str, str]] = None, cwd=None,
             timeout: Optional[float] = None, input: Optional[str] = None) -> subprocess.CompletedProcess:
    """:func:`run_module` for ``python -c CODE ARGS``."""
    return _run({"code": code}, args, env, cwd, timeout, input)


# -- the zygote's side ---------------------------------------------------------------------------------------
def _exit_code(code) -> int:
    """What the interpreter exits with for ``SystemExit(code)`` (a message is printed to stderr)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_main(request: dict) -> None:
    """Run the request's ``-m`` module or ``-c`` code as ``__main__``, with its arguments."""
    if "code" in request:                    # -c: sys.argv[0] is "-c"; sys.path[0] stays '' (the zygote's own)
        import types

        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        sys.argv = ["-c", *request["args"]]
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        return
    import runpy

    if not sys.flags.safe_path:              # -m's first entry is the working directory
        sys.path[0] = request["cwd"]
    sys.argv = [request["module"], *request["args"]]
    sys.modules.pop(request["module"], None)          # as in a fresh -m run, __main__ is its only copy so far
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _child(request: dict, channel: Sequence[int]) -> None:
    """In the forked child: become the run (module docstring); never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        for fd in channel:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, key in ((1, "stdout"), (2, "stderr")):
            out = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        # the request's whole environment: the zygote's own may hold the launcher's variables of the request that
        # started it (RANK, MASTER_PORT, ...), which a worker's adopt() would keep, so every later run was that rank
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _fork_server_template()
        try:
            _run_main(request)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


_FORK_SERVER_CODE = "from multiprocessing.forkserver import main; "


def _fork_server_template() -> None:
    """In the forked run, before it runs: fork a copy of it (one thread, no torch op run, the zygote's imports)
    that waits to become the run's multiprocessing forkserver, and have the run's first forkserver start
    (``util.spawnv_passfds`` of ``python -c 'from multiprocessing.forkserver import main; main(...)'``, which
    :mod:`orchestration.local_workers` asks for to start the cpu target's ranks) hand its command and file
    descriptors to that copy instead of starting a fresh interpreter, which would import torch and megatron-core
    again (about 3.5 s of CPU per multi-rank run). The copy then runs the very command: the forkserver's
    ``main`` imports the preload list (here already imported, but for the worker function's modules) and forks
    the ranks. The copy is the run's child, as the started server is, and in its process group; it exits
    unused when the run ends. A second start (the server died) is a fresh interpreter, as without the zygote."""
    import socket

    from multiprocessing import util

    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        _be_fork_server(theirs)
    theirs.close()
    real = util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        code = args[args.index("-c") + 1] if "-c" in args[:-1] else ""
        if ours.fileno() < 0 or not code.startswith(_FORK_SERVER_CODE):
            return real(path, args, passfds)
        from multiprocessing import reduction

        fds = sorted(map(int, passfds))
        payload = json.dumps({"code": code, "fds": fds}).encode()
        ours.sendall(len(payload).to_bytes(8, "big") + payload)
        reduction.sendfds(ours, fds)
        ours.close()
        return pid

    util.spawnv_passfds = spawnv_passfds


def probe_rank(rank: int) -> None:
    """A rank of tests/cli_process_test.py: its rank, and whether it was forked from the zygote's imports."""
    print(rank, "launchers.cli" in sys.modules, flush=True)


def _be_fork_server(sock) -> None:
    """The template's side of :func:`_fork_server_template`: wait for the forkserver's command and descriptors
    (its file descriptors at the numbers the command names), run it; never returns."""
    import fcntl

    from multiprocessing import reduction

    code = 0
    try:
        head = sock.recv(8)
        if len(head) < 8:             # the run ended without starting a forkserver
            os._exit(0)
        size = int.from_bytes(head, "big")
        payload = b""
        while len(payload) < size:
            chunk = sock.recv(size - len(payload))
            if not chunk:
                os._exit(1)
            payload += chunk
        request = json.loads(payload)
        got = reduction.recvfds(sock, len(request["fds"]))
        sock.close()
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in got]   # out of the way of the wanted numbers
        for fd in got:
            os.close(fd)
        for fd, want in zip(high, request["fds"]):
            os.dup2(fd, want)
            os.close(fd)
        exec(compile(request["code"], "<forkserver>", "exec"), {"__name__": "__forkserver__"})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _serve(preload: Sequence[str]) -> None:
    """Import ``preload``, then fork one child per request line on stdin; reply its pid, then its exit code."""
    for name in preload:
        importlib.import_module(name)
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)           # what the children do not read and what a stray print of this process writes
    os.dup2(null, 1)
    os.close(null)
    with os.fdopen(requests) as inbox, os.fdopen(replies, "w") as outbox:
        for line in inbox:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, (requests, replies))
            outbox.write(json.dumps({"pid": pid}) + "\n")
            outbox.flush()
            _, status = os.waitpid(pid, 0)
            outbox.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
            outbox.flush()


