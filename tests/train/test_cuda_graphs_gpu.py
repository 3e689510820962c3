"""`dsv4 train --hardware nvidia --compile --cuda-graphs` on a GPU (skipped without CUDA; tagged ``gpu`` in Bazel).

    python -m pytest -q tests/train/test_cuda_graphs_gpu.py

For each implementation (miles BSHD, megatron THD), four SFT steps of the tiny model in bf16, rows padded to
``pad_to_length=32`` (the built-in task's sequences are at most 15 tokens), run twice through the CLI: eager,
and compiled with the blocks replayed as CUDA graphs. The graphed run's losses and gradient norms follow
the eager run's (bf16 tolerance: fused kernels round differently), and Inductor skipped no CUDA graph
(``counters["inductor"]["cudagraph_skips"]``: a skip would mean the blocks ran as plain compiled code).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 4
COMMON = ("--hardware", "nvidia", "--mode", "sft", "--steps", str(STEPS), "--tracker", "none",
          "pad_to_length=32", "batch_size=4", "lr=1e-3", "export_at_end=false")


def train(run_dir, impl, *extra):
    from launchers.cli import main

    res = CliRunner().invoke(main, ["train", "--impl", impl, "--run-dir", str(run_dir), *COMMON, *extra])
    assert res.exit_code == 0, res.output
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_cuda_graphs_train_like_the_eager_run(tmp_path, impl):
    from torch._dynamo.utils import counters

    eager = train(tmp_path / "eager", impl)
    counters.clear()
    graphed = train(tmp_path / "graphed", impl, "--compile", "--cuda-graphs")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert [r["step"] for r in graphed] == list(range(1, STEPS + 1))
    for e, g in zip(eager, graphed):
        assert g["loss"] == pytest.approx(e["loss"], rel=2e-2, abs=2e-2), (e["step"], e["loss"], g["loss"])
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=5e-2), (e["step"], e["grad_norm"], g["grad_norm"])
    assert graphed[-1]["loss"] < graphed[0]["loss"]        # it trains (lr 1e-3 on a repeated tiny task)
