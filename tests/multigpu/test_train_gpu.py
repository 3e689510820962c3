"""`dsv4 train --hardware nvidia` on two GPUs under torchrun: issue #17's done-when, on the product path.

Each layout runs ``torchrun --nproc-per-node 2 -m launchers.dsv4 train --hardware nvidia ...`` (bf16, megatron-core's
DDP and distributed optimizer, NCCL): 5 GRPO steps must complete with finite metrics, and the first SFT step's
loss and gradient norm must equal the one-GPU run's within a bf16 tolerance: 2e-2 relative (bf16 keeps 8
mantissa bits, ~4e-3 per rounding; the layouts reduce in another order and split GEMMs, and the one-step
differences we measured on H200s stay below 1e-2). A run whose ranks are SIGKILLed mid-step resumes on
another layout. The same code paths on the CPU (gloo, fp32, exact): tests/train/test_layouts.py.

Run on a 2-GPU machine: ``python -m pytest -q tests/multigpu/test_train_gpu.py`` (``DSV4_TRAIN_GPU_REPORT=f.json``
writes the measured numbers).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2+ CUDA GPUs of one host (NCCL); {N_GPUS} visible")]
BF16_REL = 2e-2
REPORT = {}


def _dsv4(run_dir, *args, nproc=1, env=None, check=True):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "launchers.dsv4", "train", "--hardware", "nvidia", "--run-dir", str(run_dir), *args]
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


SFT = ("--mode", "sft", "--steps", "1", "--lr", "1e-3")
GRPO = ("--mode", "grpo", "--steps", "5", "--lr", "1e-3")
LAYOUTS = [("miles", ("--ep", "2")), ("miles", ("--tp", "2")), ("miles", ("--cp", "2", "--qkv-format", "thd")),
           ("megatron", ("--cp", "2")), ("megatron", ("--ep", "2")), ("miles", ())]   # () = data parallel 2


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    out = {}
    for impl in ("miles", "megatron"):
        d = tmp_path_factory.mktemp(f"one-{impl}")
        _dsv4(d / "run", "--impl", impl, *SFT)
        out[impl] = _rows(d / "run")[0]
    return out


def _layout_id(impl_layout) -> str:
    impl, layout = impl_layout
    return f"{impl}-{''.join(a.lstrip('-') for a in layout[:2]) or 'dp2'}"


@pytest.mark.parametrize("impl,layout", LAYOUTS, ids=[_layout_id(x) for x in LAYOUTS])
def test_torchrun_layout_matches_one_gpu_and_trains_five_grpo_steps(tmp_path, one_gpu, impl, layout):
    name = _layout_id((impl, layout))
    _dsv4(tmp_path / "sft", "--impl", impl, *layout, *SFT, nproc=2)
    got, want = _rows(tmp_path / "sft")[0], one_gpu[impl]
    assert got["world_size"] == 2
    rel_loss = abs(got["loss"] - want["loss"]) / abs(want["loss"])
    rel_norm = abs(got["grad_norm"] - want["grad_norm"]) / abs(want["grad_norm"])
    _dsv4(tmp_path / "grpo", "--impl", impl, *layout, *GRPO, nproc=2)
    rows = _rows(tmp_path / "grpo")
    REPORT[name] = {"sft_loss": got["loss"], "sft_loss_1gpu": want["loss"], "sft_loss_rel": rel_loss,
                    "grad_norm_rel": rel_norm, "grpo_steps": len(rows),
                    "grpo_tokens_per_s": [r["tokens_per_s"] for r in rows]}
    _write_report()
    assert rel_loss < BF16_REL and rel_norm < BF16_REL
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    state = json.loads((tmp_path / "grpo" / "checkpoints" / "step_000005" / "state.json").read_text())
    assert state["layout"]["optimizer"] == "megatron-distributed" and state["layout"]["world"] == 2


def test_killed_torchrun_run_resumes_on_another_layout(tmp_path):
    grpo = ("--impl", "miles", "--mode", "grpo", "--steps", "4", "--save-every", "1", "--lr", "1e-3")
    killed = _dsv4(tmp_path / "run", *grpo, "--ep", "2", nproc=2, env={"DSV4_TRAIN_KILL_AT": "3:train"}, check=False)
    assert killed.returncode != 0
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2]
    from core.native_checkpoint import _read_dcp_metadata

    for part in ("optim", "model"):       # each rank wrote its own share (distributed optimizer ranges, experts)
        per_rank = {}
        for info in _read_dcp_metadata(tmp_path / "run" / "checkpoints" / "step_000002" / part).storage_data.values():
            rank = int(info.relative_path.split("_")[2])
            per_rank[rank] = per_rank.get(rank, 0) + info.length
        assert sorted(per_rank) == [0, 1] and max(per_rank.values()) < 0.9 * sum(per_rank.values()), (part, per_rank)
    _dsv4(tmp_path / "run", *grpo, "--tp", "2", "--resume", nproc=2)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000004" / "state.json").read_text())
    assert state["layout"]["tp"] == 2
    REPORT["resume_ep2_to_tp2"] = {"steps": [r["step"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}
    _write_report()


def _write_report():
    """Merge this process's results into the report file: under pytest-xdist each worker holds only its own."""
    path = os.environ.get("DSV4_TRAIN_GPU_REPORT")
    if path:
        merged = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        merged.update(REPORT)
        tmp = Path(f"{path}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
