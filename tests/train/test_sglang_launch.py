"""SGLang launch mode end to end on the CPU: the engine starts ``python -m sglang.launch_server`` itself, and
that command runs the fake server of tests/train/_fake_sglang.py (a ``sglang`` package first on the server's
``PYTHONPATH``, :func:`install_fake_launcher`), which records its command line and pid in a state file.

Why these tests: the real server needs a GPU and the sglang package, which these machines lack, and `dsv4
train` refuses launch mode on a CPU ``--hardware`` (the ``sglang`` record is a GPU one); the trainer's own
launch-mode run is in tests/train/test_sglang_training.py (a test plugin host). Here:

* the engine (``make_sglang_engine`` without a URL) runs the exact :func:`rollout.sglang_engine.server_command` on
  the run's ``sglang_init`` folder and port, under its guard (:mod:`rollout.sglang_guard`, the group's leader),
  waits for it, generates, pushes tensors the server then holds, and ``shutdown`` ends the server, its worker
  and the guard;
* an owner process SIGKILLed - the engine started from its main thread (Linux's parent-death signal) or from a
  thread that has exited since (the guard's polling; the server must survive that thread) - takes its server
  down within seconds;
* a guard SIGKILLed itself (no stop of the group) takes its server down: the server dies with it (Linux's
  parent-death signal);
* a Ray engine actor (:class:`orchestration.ray_engines.EngineActor`) in launch mode starts its server at the first
  weight update with the exact command line, generates; SIGKILLed, its server goes with it, and its proxy's
  re-sync starts a new one in the restarted actor, which ``shutdown`` stops.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from core.config import preset
from tests.train._fake_sglang import install_fake_launcher, process_gone, spare_port
from rollout.reference_engine import SamplingParams
from train.trainer import TrainConfig

CFG = preset("tiny")


def _export(folder):
    from train.export import export_model
    from train.model import build_train_model

    return export_model(build_train_model(CFG), folder)


def _server_argv(model_path, port) -> list:
    """What ``server_command`` must give the server for the default settings (after ``python -m
    sglang.launch_server``)."""
    return ["--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--tp-size", "1",
            "--trust-remote-code", "--skip-tokenizer-init", "--enable-return-routed-experts"]


def _parent_and_group(pid: int):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2])        # ppid, pgrp


def _wait_for(path, key, within_s=60.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = json.loads(path.read_text())
            if state.get(key):
                return state
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{path}: no {key} within {within_s} s")


def _alive(pid: int) -> bool:
    return not process_gone(pid, within_s=0.0)


# How long a test waits for a SIGKILLed owner's server to be stopped. The guard notices at once (parent-death
# signal) or within its 0.2 s poll; the rest is the machine: on a loaded 2-core CI runner a SIGKILLed Ray worker
# took over 5 s to be torn down. 30 s still fails a guard that does not act (it would never stop the server).
STOP_WITHIN_S = 30.0


def _state(*pids: int) -> str:
    """Where each process stands (state, parent, group) - the message of a failed stop check."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out.append(f"{pid}: state {fields[0]} ppid {fields[1]} pgrp {fields[2]}")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            out.append(f"{pid}: gone")
    return "; ".join(out)


def test_the_engine_runs_the_exact_command_generates_takes_weights_and_stops_everything(tmp_path, monkeypatch):
    from core.checkpoint import open_checkpoint
    from rollout.sglang_engine import make_sglang_engine, torch_b64_serialize

    state_file = install_fake_launcher(tmp_path, monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    init = _export(run / "sglang_init")
    # sglang_port 0 (the default): a port the engine picks (taken before the server binds it: another one,
    # tests/train/test_sglang_adapter.py)
    e = make_sglang_engine(CFG, model_path=init, settings=TrainConfig(), run_dir=run, serializer=torch_b64_serialize)
    try:
        state = json.loads(state_file.read_text())
        info = state["info"]
        port = e.server.port
        assert info["argv"] == _server_argv(run / "sglang_init", port)               # exactly server_command's
        assert e.server.base_url == f"http://127.0.0.1:{port}" and state["health_calls"] >= 1   # it was ready
        served = f"fake sglang: serving {run / 'sglang_init'} on http://127.0.0.1:{port}"
        assert served in (run / "sglang_server.log").read_text()
        assert _parent_and_group(info["pid"]) == (e.proc.pid, e.proc.pid)          # the guard leads the group
        assert _parent_and_group(e.proc.pid)[1] == e.proc.pid != os.getpgrp()      # ... a session of its own

        groups = e.generate([[0, 5], [7]], SamplingParams(max_new_tokens=3), n=2, seed=4)
        assert [len(g) for g in groups] == [2, 2] and all(s.routed_experts is not None for g in groups for s in g)

        sent = [(n, t.float() * 2) for n, t in open_checkpoint(init).iter_tensors(dequantize=True)][:3]
        e.begin_update(1)
        e.load_bucket(sent)
        e.finish_update()
        state = json.loads(state_file.read_text())
        assert [v["shapes"] for v in state["versions"]] == [{n: list(t.shape) for n, t in sent}]
        name, tensor = sent[0]
        assert e.weights_by_name(name, truncate_size=5) == pytest.approx(tensor.flatten()[:5].tolist())
        assert e.version == 1
    finally:
        guard = e.proc.pid if e.proc is not None else None
        e.shutdown()
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"]) and process_gone(guard)


OWNER = """
import sys, threading, time
from core.config import preset
from rollout.sglang_engine import make_sglang_engine
from train.trainer import TrainConfig

init, run, where = sys.argv[1:4]
engines = []
start = lambda: engines.append(make_sglang_engine(preset("tiny"), model_path=init, run_dir=run,
                                                  settings=TrainConfig(sglang_weight_sync="disk")))
if where == "main":
    start()
else:                     # a thread that ends once the server is up: the server must outlive it
    t = threading.Thread(target=start)
    t.start()
    t.join()
print("ready", engines[0].proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_sigkilled_owner_takes_its_server_down(tmp_path, monkeypatch, where):
    """The owner: a process that starts a launch-mode engine and never calls shutdown."""
    from tests.train._fake_sglang import REPO

    state_file = install_fake_launcher(tmp_path, monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    init = _export(run / "sglang_init")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(init), str(run), where], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline().split()
        assert line[:1] == ["ready"], f"the owner did not start its engine (exit {owner.poll()})"
        guard = int(line[1])
        info = json.loads(state_file.read_text())["info"]
        with open(f"/proc/{guard}/cmdline") as f:      # the parent-death signal only from the main thread
            assert f.read().split("\0")[4] == ("1" if where == "main" else "0")
        time.sleep(1.0)
        assert _alive(info["pid"]) and _alive(guard), "the server died with the thread that started it"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        t0 = time.monotonic()
        assert process_gone(info["pid"], within_s=STOP_WITHIN_S), \
            f"the server outlived its SIGKILLed owner ({_state(info['pid'], guard)})"
        assert process_gone(info["worker_pid"], within_s=STOP_WITHIN_S) and process_gone(guard, within_s=STOP_WITHIN_S)
        print(f"server gone {time.monotonic() - t0:.2f} s after its owner ({where} thread)")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_sigkilled_guard_takes_its_server_down(tmp_path, monkeypatch):
    """Whatever ends the guard before it stops the group ends the server too. Why: a guard that died so (a stop
    signal that raised after its poll saw the owner gone) once left the server of a SIGKILLed Ray actor alive, in
    CI. The fake's worker does not die with the server as SGLang's scheduler does; the test stops it."""
    from rollout.sglang_engine import make_sglang_engine

    state_file = install_fake_launcher(tmp_path, monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    init = _export(run / "sglang_init")
    e = make_sglang_engine(CFG, model_path=init, settings=TrainConfig(sglang_weight_sync="disk"), run_dir=run)
    guard = e.proc.pid
    try:
        info = json.loads(state_file.read_text())["info"]
        assert _parent_and_group(info["pid"]) == (guard, guard)
        os.kill(guard, signal.SIGKILL)
        e.proc.wait()
        assert process_gone(info["pid"], within_s=STOP_WITHIN_S), \
            f"the server outlived its SIGKILLed guard ({_state(info['pid'], guard)})"
    finally:
        try:
            os.killpg(guard, signal.SIGKILL)       # what is left of the group (the fake's worker)
        except ProcessLookupError:
            pass
        e.shutdown()


# -- the Ray engine actor ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for the module (2 logical CPUs, no dashboard, its session folder short: Ray's unix
    sockets live there)."""
    import shutil
    import tempfile

    import ray

    folder = tempfile.mkdtemp(prefix="dsv4ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False, _temp_dir=folder)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def _fake_plugin_run_config():
    """The run's configuration with the ``sglang`` record of the fake's plugin (runnable on the CPU), as
    tests/train/test_sglang_training.py builds it: the actor's assembly loads the real factory from it."""
    from core.plugins import PluginHost
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import BUILTIN_PLUGINS

    modules = [m for m in BUILTIN_PLUGINS if m != "rollout.plugin"] + ["tests.train._fake_sglang"]
    host = PluginHost(modules, third_party=False)
    return normalize(Choices(hardware="cpu", rollout_engine="sglang", model=CFG, job="train", orchestrator="ray"),
                     host, model_name="tiny")


def test_a_ray_engine_actor_launches_its_server_and_a_killed_actor_takes_it_down(tmp_path, monkeypatch, ray_local):
    import ray

    from core.checkpoint import open_checkpoint
    from orchestration.ray_engines import EngineActor, RayEngineProxy, server_options

    state_file = install_fake_launcher(tmp_path, monkeypatch)
    rc = _fake_plugin_run_config()
    run = tmp_path / "run"
    run.mkdir()
    port = spare_port()         # given (sglang_port): the restarted actor's server binds it again
    cfg = TrainConfig(sglang_port=port)
    options = dict(settings=cfg, run_dir=str(run), publish_format=rc.selection.quant.publish_format,
                   **server_options(rc, cfg, run, 0))
    env = {k: os.environ[k] for k in ("PYTHONPATH", "FAKE_SGLANG_STATE")}
    env["DSV4_SGLANG_SERIALIZER"] = "torch-b64"          # the fake's tensor format (the actor is another process)
    actor = ray.remote(max_restarts=1, max_task_retries=0)(EngineActor).options(
        num_cpus=1, runtime_env={"env_vars": env}).remote(rc, CFG, options, 0)
    proxy = RayEngineProxy(actor, index=0, max_restarts=1)
    try:
        first = ray.get(actor.ready.remote(), timeout=120)
        assert not state_file.exists()                     # the server starts at the first update ...
        init = _export(run / "sglang_init")                # ... once the trainer has written its weights
        bucket = [(n, t.float()) for n, t in open_checkpoint(init).iter_tensors(dequantize=True)][:4]
        proxy.begin_update(1)
        proxy.load_bucket(bucket)
        proxy.finish_update()
        state = json.loads(state_file.read_text())
        info = state["info"]
        assert info["argv"] == _server_argv(run / "sglang_init", port)
        assert [v["shapes"] for v in state["versions"]] == [{n: list(t.shape) for n, t in bucket}]
        assert "fake sglang: serving" in (run / "sglang_server_0.log").read_text()
        groups = proxy.generate([[0, 5]], SamplingParams(max_new_tokens=2), n=2, seed=1)
        assert [len(g) for g in groups] == [2]
        guard = _parent_and_group(info["pid"])[0]
        assert _parent_and_group(guard)[0] == first["pid"]   # the actor's process started the guard

        os.kill(first["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        assert process_gone(info["pid"], within_s=STOP_WITHIN_S), \
            f"the server outlived its SIGKILLed engine actor ({_state(first['pid'], info['pid'], guard)})"
        assert process_gone(info["worker_pid"], within_s=STOP_WITHIN_S) and process_gone(guard, within_s=STOP_WITHIN_S)
        print(f"server gone {time.monotonic() - t0:.2f} s after its engine actor")

        state_file.unlink()
        groups = proxy.generate([[0, 5]], SamplingParams(max_new_tokens=2), n=2, seed=1)   # re-synced, then asked
        assert proxy.restarts == 1 and [len(g) for g in groups] == [2]
        again = _wait_for(state_file, "versions")["info"]
        assert again["pid"] != info["pid"] and again["argv"] == info["argv"]    # a new server, the same command
        ray.get(actor.shutdown.remote(), timeout=120)
        assert process_gone(again["pid"]) and process_gone(again["worker_pid"])
    finally:
        ray.kill(actor, no_restart=True)
