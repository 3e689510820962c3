"""Safe prepare stages: atomic rename, sentinel skip, cross-process lock, kill -9, disk space."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from converters import staging
from converters.staging import (
    SENTINEL, InsufficientDiskSpace, StageConflict, lock_path_for, read_sentinel, run_stage,
)

REPO = Path(__file__).resolve().parents[2]

WORKER = r'''
import json, os, sys, time
from pathlib import Path
from converters.staging import run_stage, read_sentinel, SENTINEL

dest, counter, go, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
inputs = {"v": sys.argv[5] if len(sys.argv) > 5 else "1"}
while not os.path.exists(go):
    time.sleep(0.005)

def build(tmp):
    with open(counter, "a") as f:          # one line per build
        f.write(f"{os.getpid()}\n")
    for k in range(4):
        (tmp / f"part{k}.bin").write_bytes(bytes([k]) * 100_000)
        if mode == "slow":
            time.sleep(0.05)
        if mode == "die-in-build" and k == 1:
            Path(go + ".inbuild").write_text("x")
            time.sleep(3600)
    (tmp / "payload.json").write_text(json.dumps({"v": inputs["v"]}))

res = run_stage(dest, build, name="demo", input_paths=(), inputs=inputs, required_bytes=1000,
                overwrite=(mode == "overwrite"), verbose=False)
d = Path(res.path)
ok = read_sentinel(d) is not None and all((d / f"part{k}.bin").stat().st_size == 100_000 for k in range(4)) \
    and json.loads((d / "payload.json").read_text())["v"] == inputs["v"]
print(json.dumps({"built": res.built, "ok": ok}))
'''


def _spawn(tmp_path, dest, mode="slow", v="1", env_extra=None, go=None):
    script = tmp_path / "worker.py"
    if not script.exists():          # never rewrite it under a starting process
        tmp = tmp_path / "worker.py.tmp"
        tmp.write_text(WORKER)
        os.replace(tmp, script)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.update(env_extra or {})
    go = go or str(tmp_path / "go")
    return subprocess.Popen([sys.executable, str(script), str(dest), str(tmp_path / "counter"), go, mode, v],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def _builds(tmp_path):
    p = tmp_path / "counter"
    return len(p.read_text().split()) if p.exists() else 0


def _is_complete(dest, v="1"):
    d = Path(dest)
    return (read_sentinel(d) is not None and all((d / f"part{k}.bin").stat().st_size == 100_000 for k in range(4))
            and json.loads((d / "payload.json").read_text())["v"] == v)


def _stale(dest):
    dest = Path(dest)
    return [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]


def test_eight_processes_one_build(tmp_path):
    dest = tmp_path / "cache" / "model-FP8"
    # half of them name the destination through a different spelling / a symlink
    (tmp_path / "cache").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "cache", target_is_directory=True)
    spellings = [dest, tmp_path / "cache" / ".." / "cache" / "model-FP8", tmp_path / "alias" / "model-FP8",
                 os.path.relpath(dest)]
    procs = [_spawn(tmp_path, spellings[i % 4]) for i in range(8)]
    time.sleep(0.3)
    (tmp_path / "go").write_text("")
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out.strip(), (out, err)
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert _builds(tmp_path) == 1
    assert sum(o["built"] for o in outs) == 1
    assert all(o["ok"] for o in outs)
    assert _is_complete(dest)
    assert _stale(dest) == []


def test_lock_key_is_normalized(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    k = lock_path_for(tmp_path / "a" / "x")
    assert lock_path_for(tmp_path / "link" / "x") == k
    assert lock_path_for(str(tmp_path / "a" / ".." / "a" / "x")) == k
    assert lock_path_for(tmp_path / "a" / "y") != k
    assert k.parent == (tmp_path / "a" / ".dsv4-locks").resolve()


@pytest.mark.parametrize("phase", ["in-build", "before-sentinel", "before-rename"])
def test_kill9_mid_build_leaves_no_partial_result(tmp_path, phase):
    dest = tmp_path / "out"
    marker = tmp_path / "reached"
    if phase == "in-build":
        p = _spawn(tmp_path, dest, mode="die-in-build")
        marker = Path(str(tmp_path / "go") + ".inbuild")
    else:
        p = _spawn(tmp_path, dest, mode="fast", env_extra={staging._PAUSE_ENV: f"{phase}:{marker}"})
    (tmp_path / "go").write_text("")
    deadline = time.time() + 30
    while not marker.exists():
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not dest.exists()                     # the old state: nothing
    assert _stale(dest)                          # its temp dir is left behind...
    p2 = _spawn(tmp_path, dest, mode="fast")
    out, err = p2.communicate(timeout=60)
    assert p2.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"built": True, "ok": True}
    assert _is_complete(dest)
    assert _stale(dest) == []                    # ...and cleaned by the next run
    assert _builds(tmp_path) == 2


@pytest.mark.parametrize("phase", ["before-rename", "after-exchange", "after-aside"])
def test_kill9_while_replacing_keeps_old_or_new(tmp_path, phase, monkeypatch):
    dest = tmp_path / "out"
    p = _spawn(tmp_path, dest, mode="fast", v="old")
    (tmp_path / "go").write_text("")
    assert p.wait(timeout=60) == 0
    assert _is_complete(dest, "old")
    marker = tmp_path / "reached"
    env = {staging._PAUSE_ENV: f"{phase}:{marker}"}
    if phase == "after-aside":
        env["DSV4_TEST_NO_EXCHANGE"] = "1"
    script = tmp_path / "nox.py"   # run the worker with renameat2 disabled for the fallback path
    script.write_text("import sys, runpy, os\n"
                      "import converters.staging as s\n"
                      "if os.environ.get('DSV4_TEST_NO_EXCHANGE'): s._rename_exchange = lambda a, b: False\n"
                      "sys.argv = sys.argv[1:]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "worker.py"), str(dest),
                          str(tmp_path / "counter"), str(tmp_path / "go"), "overwrite", "new"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO), **env))
    deadline = time.time() + 30
    while not marker.exists():
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if phase == "after-aside":
        assert not dest.exists()                  # fallback path: documented gap, never a mixed folder
    else:
        assert _is_complete(dest, "old") or _is_complete(dest, "new")
        assert _is_complete(dest, "new") == (phase == "after-exchange")
    p2 = _spawn(tmp_path, dest, mode="overwrite", v="new")
    assert p2.wait(timeout=60) == 0, p2.communicate()
    assert _is_complete(dest, "new") and _stale(dest) == []


def test_rerun_skips_and_conflicts(tmp_path):
    dest = tmp_path / "d"
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "f").write_text("x")

    r1 = run_stage(dest, build, name="s", input_paths=(), inputs={"a": 1}, verbose=False)
    r2 = run_stage(dest, build, name="s", input_paths=(), inputs={"a": 1}, verbose=False)
    assert r1.built and not r2.built and len(calls) == 1
    assert json.loads((dest / SENTINEL).read_text())["inputs"] == {"a": 1}
    with pytest.raises(StageConflict, match="inputs"):
        run_stage(dest, build, name="s", input_paths=(), inputs={"a": 2}, verbose=False)
    r3 = run_stage(dest, build, name="s", input_paths=(), inputs={"a": 2}, overwrite=True, verbose=False)
    assert r3.built and read_sentinel(dest)["inputs"] == {"a": 2}
    other = tmp_path / "manual"
    other.mkdir()
    (other / "x").write_text("user data")
    with pytest.raises(StageConflict, match="not written by dsv4"):
        run_stage(other, build, name="s", input_paths=(), verbose=False)
    assert (other / "x").read_text() == "user data"


def test_failed_build_leaves_nothing(tmp_path):
    def build(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_stage(tmp_path / "d", build, name="s", input_paths=(), verbose=False)
    assert not (tmp_path / "d").exists() and _stale(tmp_path / "d") == []


def test_disk_space_checked_before_writing(tmp_path, monkeypatch):
    built = []
    with pytest.raises(InsufficientDiskSpace) as ei:
        run_stage(tmp_path / "d", lambda t: built.append(t), name="s", input_paths=(), required_bytes=10**18, verbose=False)
    msg = str(ei.value)
    assert str(10**18) in msg and "bytes needed" in msg and "available" in msg
    assert ei.value.needed == 10**18 and 0 <= ei.value.available < 10**18
    assert not built and not (tmp_path / "d").exists()

    import shutil as _sh
    real = _sh.disk_usage
    monkeypatch.setattr(staging.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1234))
    with pytest.raises(InsufficientDiskSpace, match="1234 bytes available"):
        run_stage(tmp_path / "d", lambda t: None, name="s", input_paths=(), required_bytes=5000, verbose=False)
