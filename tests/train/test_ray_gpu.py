"""`dsv4 train --orchestrator ray` on the GPUs of one host (tagged ``gpu`` in Bazel; each case skipped with fewer
GPUs than it needs).

    python -m pytest -q tests/train/test_ray_gpu.py

Each run starts a local Ray cluster (the CLI's default) that sees the host's GPUs. On one GPU:

* ``--weight-transport cuda-ipc``, colocated (one trainer rank and its engine actor on GPU 0, half of it
  each; ``colocate=true``, so the engine frees its weights after each rollout and the next update allocates
  them again): each bucket reaches the engine as an IPC handle to the trainer's GPU memory. Every step's
  weight check (what the engine holds against what was published, bit for bit) passes, and the first step
  agrees with the local orchestrator's one-GPU run.

On two GPUs:

* ``--weight-transport nccl``, disaggregated (one trainer GPU, one engine GPU): the same checks, the buckets
  broadcast over an NCCL group of the trainer rank and the engine actor;

* disaggregated, one trainer GPU and one engine GPU (``--rollout-num-gpus 1``): the first GRPO step (bf16)
  agrees with the local orchestrator's one-GPU run (reward and the samples' token count equal: the same
  seeded samples; loss, gradient norm and log-prob difference within 2e-2), every step is there;
* colocated on two GPUs (``--ep 2``: two trainer ranks, each engine sharing its leader's GPU, ``colocate=true``:
  it frees its memory while the trainer works): the same against the local launcher's ``--ep 2`` run, and the
  engines hold nothing while the trainer works;
* the disaggregated engine actor SIGKILLed as it is asked to generate in step 2: restarted, re-synced, the
  run has every step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu]
one_gpu = pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2+ CUDA GPUs of one host; {N_GPUS} visible")

ROOT = Path(__file__).resolve().parents[2]
GRPO = ("--hardware", "nvidia", "--mode", "grpo", "--steps", "3", "--lr", "1e-4", "export_at_end=false")


def _train(run_dir, *args, env=None):
    cmd = [sys.executable, "-m", "launchers.dsv4", "train", "--run-dir", str(run_dir), *GRPO, *args]
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        full_env.pop(key, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _report(run_dir, args)
    return proc


TIMES = ("time_step", "time_rollout", "time_update_weights", "time_train")


def _report(run_dir, args) -> None:
    """``DSV4_RAY_GPU_REPORT=f.json``: each run's per-step times (the docs' 2-GPU table), merged into the file
    under ``TEST/RUN`` (step 1 holds the start-up compiles and Ray's first placement, so it is kept apart)."""
    path = os.environ.get("DSV4_RAY_GPU_REPORT")
    if not path:
        return
    rows = _rows(run_dir)
    later = rows[1:] or rows
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    entry = {"args": list(args), "steps": len(rows), **{f"step1_{k}": rows[0].get(k) for k in TIMES},
             **{f"mean_after_step1_{k}": sum(r.get(k) or 0.0 for r in later) / len(later) for k in TIMES}}
    merged = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    merged[f"{test}/{Path(run_dir).name}"] = entry
    Path(path).write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _first_step_agrees(got, want):
    assert [r["step"] for r in got] == [1, 2, 3]
    g, w = got[0], want[0]
    assert g["reward_mean"] == w["reward_mean"] and g["response_tokens"] == w["response_tokens"]
    for key in ("loss", "grad_norm", "train_rollout_logprob_abs_diff"):
        assert g[key] == pytest.approx(w[key], rel=2e-2, abs=2e-2), key


@one_gpu
def test_cuda_ipc_transport_on_one_gpu_loads_the_published_weights(tmp_path):
    _train(tmp_path / "local")
    proc = _train(tmp_path / "ray", "--orchestrator", "ray", "--weight-transport", "cuda-ipc", "colocate=true")
    assert "1 rollout engine actor(s), colocated" in proc.stderr
    assert "weight transport cuda-ipc: each step's weights reach the engine actors through CUDA IPC" in proc.stderr
    got = _rows(tmp_path / "ray")
    assert all(r["weight_check_ok"] is True for r in got), [r["weight_check_ok"] for r in got]
    assert all(r["engine_memory_gib"] == 0 for r in got)
    _first_step_agrees(got, _rows(tmp_path / "local"))


@two_gpus
def test_nccl_transport_on_two_gpus_loads_the_published_weights(tmp_path):
    _train(tmp_path / "local")
    proc = _train(tmp_path / "ray", "--orchestrator", "ray", "--rollout-num-gpus", "1", "--weight-transport", "nccl")
    assert "weight transport nccl: a process group of this trainer rank and 1 engine actor(s)" in proc.stderr
    got = _rows(tmp_path / "ray")
    assert all(r["weight_check_ok"] is True for r in got), [r["weight_check_ok"] for r in got]
    _first_step_agrees(got, _rows(tmp_path / "local"))


@two_gpus
@pytest.mark.parametrize("mode,layout", [("disaggregated", ()), ("colocated", ("--ep", "2"))])
def test_both_modes_on_two_gpus_take_the_local_step(tmp_path, mode, layout):
    _train(tmp_path / "local", *layout)
    extra = ("--rollout-num-gpus", "1") if mode == "disaggregated" else ("colocate=true",)
    proc = _train(tmp_path / "ray", "--orchestrator", "ray", *layout, *extra)
    assert f"rollout engine actor(s), {mode}" in proc.stderr
    got = _rows(tmp_path / "ray")
    _first_step_agrees(got, _rows(tmp_path / "local"))
    if mode == "colocated":
        assert all(r["engine_memory_gib"] == 0 for r in got)


@two_gpus
def test_a_killed_engine_actor_on_a_gpu_is_restarted_and_resynced(tmp_path):
    proc = _train(tmp_path / "ray", "--orchestrator", "ray", "--rollout-num-gpus", "1",
                  env={"DSV4_RAY_ENGINE_KILL_AT": "generate:2"})
    assert "rollout engine actor 0 was restarted; loading weights version" in proc.stderr
    assert [r["step"] for r in _rows(tmp_path / "ray")] == [1, 2, 3]
