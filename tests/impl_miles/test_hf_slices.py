"""A tensor-parallel rank reads only its slice of an HF checkpoint (engine.loading.load_hf_checkpoint through
core.checkpoint.slices): two gloo ranks of a tp=2 miles model load bf16, FP8 (128x128 blocks) and MXFP4-expert
checkpoints; every tensor equals what reading whole tensors and slicing them gives, and the bytes a rank pulls
out of safetensors (counted around ``safe_open``) are half of the sliced tensors' plus the replicated ones'."""

from __future__ import annotations

import dataclasses

import torch

from core.checkpoint import prepare_checkpoint
from tests.cpu_ranks import PORT, spawn_cpu_ranks

from . import _slice_worker
from ._helpers import TINY

# tiny with 256-wide experts: every tensor-parallel slice of an FP8 weight is 128x128-block aligned at tp=2
ALIGNED = dataclasses.replace(TINY, moe_inter_dim=256)
WORLD = 2


def test_tp_ranks_read_only_their_slices(tmp_path):
    cases = [(fmt, str(prepare_checkpoint(tmp_path / fmt, ALIGNED, dtype=fmt, seed=5)), ALIGNED)
             for fmt in ("bf16", "fp8", "mxfp4-experts")]
    # tiny's 128-wide experts: a rank's 64 rows of w1 / w3 lie inside one FP8 block, read whole and trimmed
    cases.append(("fp8-unaligned", str(prepare_checkpoint(tmp_path / "fp8u", TINY, dtype="fp8", seed=5)), TINY))
    out = tmp_path / "slices"
    spawn_cpu_ranks(_slice_worker.run, (WORLD, PORT, cases, str(out)), WORLD)

    for rank in range(WORLD):
        res = torch.load(f"{out}.{rank}")
        for label, r in res.items():
            assert r["differ"] == [], (rank, label, r["differ"][:5])
            total = r["sliced_bytes"] + r["whole_bytes"]
            assert r["old_bytes"] == total, (rank, label, r)                 # the old path reads everything
            share = r["sliced_bytes"] // WORLD + r["whole_bytes"]
            if label == "fp8-unaligned":
                assert share < r["new_bytes"] < total, (rank, label, r)
            else:
                assert r["new_bytes"] == share, (rank, label, r)
            assert r["sliced_bytes"] > r["whole_bytes"], (label, r)        # the slices are most of the bytes
