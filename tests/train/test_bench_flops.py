"""The FLOPs and MFU formula of the training benchmarks (bench/flops.py: ``selected_keys``, ``step_flops``,
``active_params``; used by bench.train_cli and bench.parallel), against hand-computed values and the reference
model's own parameter list; and every committed benchmark record's MFU against its own FLOPs and step time."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.configs import bench_config
from bench.flops import H200_BF16_DENSE_TFLOPS, active_params, selected_keys, step_flops

ROOT = Path(__file__).resolve().parent.parent.parent


def _small():
    # window 2, CSA top-1 on layer 1 (ratio 4), a ratio-3 layer (the HCA rule), 2 heads of dim 4
    return SimpleNamespace(n_layers=3, compress_ratios=(0, 4, 3, 0), window_size=2, index_topk=1, n_heads=2,
                           head_dim=4)


def test_selected_keys_by_hand():
    # positions p = 0..5 (seq 6); window part min(p+1, 2) = 1,2,2,2,2,2 -> 11 on every layer
    # ratio 4 (CSA): + min(top-k 1, (p+1)//4) = 0,0,0,1,1,1 -> 3;  ratio 3: + (p+1)//3 = 0,0,1,1,1,2 -> 5
    # the 4th ratio belongs to no trunk layer (n_layers 3): 11 + 14 + 16 = 41
    assert selected_keys(_small(), 6) == 41


def test_step_flops_by_hand():
    # 2 sequences of 6 tokens, 1000 active params: dense 6 x 1000 x 12 = 72,000;
    # attention 12 x 2 heads x 4 head dim x 41 keys x 2 sequences = 7,872
    assert step_flops(_small(), 6, 2, 1000) == {"total": 79_872, "dense": 72_000, "attention": 7_872}


def _reference_active_params(c) -> int:
    """Every floating-point parameter of the reference model's trunk (meta device) but the input embedding,
    routed experts at n_activated / n_routed of their size (MTP layers are not part of the step's count)."""
    from kernels.reference.model import DeepseekV4Model

    m = DeepseekV4Model(c, device="meta")
    total = 0
    for name, p in m.named_parameters():
        if name == "embed.weight" or name.startswith("mtp") or not p.is_floating_point():
            continue
        n = p.numel()
        total += n * c.n_activated_experts // c.n_routed_experts if ".ffn.experts." in name else n
    return total


@pytest.mark.parametrize("name", ["bench", "tiny"])
def test_active_params_is_the_reference_models_count(name):
    from core.config import preset

    c = bench_config() if name == "bench" else preset("tiny")
    assert active_params(c) == _reference_active_params(c)


def _mfu_rows():
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = data if isinstance(data, list) else data.get("rows", [])
        for i, r in enumerate(rows):
            if isinstance(r, dict) and r.get("mfu") is not None and r.get("flops_per_step"):
                yield f"{path.name}[{i}]", r


def test_every_recorded_mfu_is_its_flops_over_time_and_peak():
    rows = list(_mfu_rows())
    assert len(rows) >= 10                      # the train-step and train-cli records
    for where, r in rows:
        gpus = r.get("gpus") or 1
        want = r["flops_per_step"] / (r["step_ms"] / 1e3) / (gpus * H200_BF16_DENSE_TFLOPS * 1e12)
        assert r["mfu"] == pytest.approx(want, rel=1e-9), where
