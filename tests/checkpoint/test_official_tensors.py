"""The official tensor table against architecture.md §3.1 (Flash / Pro) and the tiny preset."""

import math
import re

import pytest
import torch

from core.config import preset
from core.checkpoint.official_tensors import SCALE, TID2EID, logical_specs, official_tensor_specs


E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
BF16, F32, I64, I8 = torch.bfloat16, torch.float32, torch.int64, torch.int8


@pytest.fixture(scope="module")
def flash():
    return official_tensor_specs(preset("flash"), "mxfp4-experts")


FLASH_EXPECTED = {
    "embed.weight": ([129280, 4096], BF16),
    "head.weight": ([129280, 4096], BF16),
    "norm.weight": ([4096], BF16),
    "hc_head_fn": ([4, 16384], F32),
    "hc_head_base": ([4], F32),
    "hc_head_scale": ([1], F32),
    "layers.0.hc_attn_fn": ([24, 16384], F32),
    "layers.0.hc_ffn_base": ([24], F32),
    "layers.0.hc_ffn_scale": ([3], F32),
    "layers.0.attn.attn_sink": ([64], F32),
    "layers.0.attn.wq_a.weight": ([1024, 4096], E4M3),
    "layers.0.attn.wq_a.scale": ([8, 32], E8M0),
    "layers.0.attn.q_norm.weight": ([1024], BF16),
    "layers.0.attn.wq_b.weight": ([32768, 1024], E4M3),
    "layers.0.attn.wq_b.scale": ([256, 8], E8M0),
    "layers.0.attn.wkv.scale": ([4, 32], E8M0),
    "layers.0.attn.kv_norm.weight": ([512], BF16),
    "layers.0.attn.wo_a.weight": ([8192, 4096], E4M3),
    "layers.0.attn.wo_a.scale": ([64, 32], E8M0),
    "layers.0.attn.wo_b.weight": ([4096, 8192], E4M3),
    "layers.0.attn.wo_b.scale": ([32, 64], E8M0),
    "layers.2.attn.compressor.wkv.weight": ([1024, 4096], BF16),
    "layers.2.attn.compressor.wgate.weight": ([1024, 4096], BF16),
    "layers.2.attn.compressor.ape": ([4, 1024], F32),
    "layers.2.attn.compressor.norm.weight": ([512], BF16),
    "layers.3.attn.compressor.wkv.weight": ([512, 4096], BF16),
    "layers.3.attn.compressor.ape": ([128, 512], F32),
    "layers.2.attn.indexer.wq_b.weight": ([8192, 1024], E4M3),
    "layers.2.attn.indexer.wq_b.scale": ([64, 8], E8M0),
    "layers.2.attn.indexer.weights_proj.weight": ([64, 4096], BF16),
    "layers.2.attn.indexer.compressor.wkv.weight": ([256, 4096], BF16),
    "layers.2.attn.indexer.compressor.ape": ([4, 256], F32),
    "layers.2.attn.indexer.compressor.norm.weight": ([128], BF16),
    "layers.0.ffn.gate.weight": ([256, 4096], BF16),
    "layers.0.ffn.gate.tid2eid": ([129280, 6], I64),
    "layers.2.ffn.gate.tid2eid": ([129280, 6], I64),
    "layers.3.ffn.gate.bias": ([256], F32),
    "layers.0.ffn.experts.0.w1.weight": ([2048, 2048], I8),
    "layers.0.ffn.experts.0.w1.scale": ([2048, 128], E8M0),
    "layers.42.ffn.experts.255.w3.weight": ([2048, 2048], I8),
    "layers.7.ffn.experts.9.w2.weight": ([4096, 1024], I8),
    "layers.7.ffn.experts.9.w2.scale": ([4096, 64], E8M0),
    "layers.1.ffn.shared_experts.w1.weight": ([2048, 4096], E4M3),
    "layers.1.ffn.shared_experts.w1.scale": ([16, 32], E8M0),
    "layers.1.ffn.shared_experts.w2.scale": ([32, 16], E8M0),
    "mtp.0.e_proj.weight": ([4096, 4096], E4M3),
    "mtp.0.h_proj.scale": ([32, 32], E8M0),
    "mtp.0.enorm.weight": ([4096], BF16),
    "mtp.0.hnorm.weight": ([4096], BF16),
    "mtp.0.norm.weight": ([4096], BF16),
    "mtp.0.hc_head_fn": ([4, 16384], F32),
    "mtp.0.ffn.gate.bias": ([256], F32),
    "mtp.0.attn.wo_a.scale": ([64, 32], E8M0),
}


def test_flash_table_matches_architecture_md(flash):
    for name, (shape, dtype) in FLASH_EXPECTED.items():
        assert name in flash, name
        assert list(flash[name].shape) == shape, name
        assert flash[name].dtype == dtype, name


def test_flash_layer_structure(flash):
    names = set(flash)
    # window layers 0,1 and the MTP block have no compressor / indexer
    for p in ("layers.0.", "layers.1.", "mtp.0."):
        assert not any(n.startswith(p + "attn.compressor") or n.startswith(p + "attn.indexer") for n in names)
    # HCA layers have a compressor but no indexer
    assert "layers.3.attn.compressor.norm.weight" in names
    assert not any(n.startswith("layers.3.attn.indexer") for n in names)
    # hash layers 0-2: tid2eid, no bias; others (and MTP) bias, no tid2eid
    for L in range(43):
        assert (f"layers.{L}.ffn.gate.tid2eid" in names) == (L < 3)
        assert (f"layers.{L}.ffn.gate.bias" in names) == (L >= 3)
    assert "mtp.0.ffn.gate.tid2eid" not in names
    assert not any(n.startswith("mtp.0.emb") or n == "mtp.0.head.weight" for n in names)
    assert "layers.43.attn_norm.weight" not in names and "mtp.1.norm.weight" not in names
    # every quantised weight has its scale, every scale a weight
    for n, s in flash.items():
        if s.quant:
            assert flash[n[: -len("weight")] + "scale"].scale_of == n
        if s.kind == SCALE:
            assert flash[s.scale_of].quant is not None
    # 256 experts per layer, 44 blocks
    assert sum(1 for n in names if re.fullmatch(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w1\.weight", n)) == 44 * 256


def test_flash_parameter_counts(flash):
    # architecture.md §1.3: 284.33B trunk (incl. embed + head), 6.61B MTP; FP4 counts 2 per byte,
    # scales and tid2eid excluded.
    lg = logical_specs(flash)
    trunk = sum(math.prod(s.shape) for n, s in lg.items() if not n.startswith("mtp.") and s.kind != TID2EID)
    mtp = sum(math.prod(s.shape) for n, s in lg.items() if n.startswith("mtp."))
    assert round(trunk / 1e9, 2) == 284.33
    assert round(mtp / 1e9, 2) == 6.61
    assert lg["layers.0.ffn.experts.0.w1.weight"].shape == (2048, 4096)


def test_pro_shapes():
    s = official_tensor_specs(preset("pro"), "mxfp4-experts")
    assert list(s["layers.0.attn.wq_a.scale"].shape) == [12, 56]
    assert list(s["layers.0.attn.wq_b.weight"].shape) == [65536, 1536]
    assert list(s["layers.0.attn.wo_a.weight"].shape) == [16384, 4096]
    assert list(s["layers.0.attn.wo_b.scale"].shape) == [56, 128]
    assert list(s["layers.5.ffn.experts.0.w1.weight"].shape) == [3072, 3584]
    assert list(s["layers.5.ffn.experts.0.w1.scale"].shape) == [3072, 224]
    assert list(s["layers.5.ffn.experts.0.w2.scale"].shape) == [7168, 96]
    assert list(s["layers.0.hc_attn_fn"].shape) == [24, 28672]
    assert "layers.0.attn.compressor.ape" in s  # Pro layers 0/1 are HCA
    assert "layers.60.attn.indexer.wq_b.weight" in s and "mtp.0.attn.compressor.ape" not in s


def test_formats_differ_only_in_linear_storage():
    cfg = preset("tiny")
    bf, f8, f4 = (official_tensor_specs(cfg, f) for f in ("bf16", "fp8", "mxfp4-experts"))
    assert not any(s.kind == SCALE for s in bf.values())
    assert set(logical_specs(bf)) == set(logical_specs(f8)) == set(logical_specs(f4))
    for n in logical_specs(bf):
        assert bf[n].shape == f8[n].logical_shape == f4[n].logical_shape, n
    e = "layers.0.ffn.experts.3.w2.weight"
    assert (bf[e].dtype, f8[e].dtype, f4[e].dtype) == (BF16, E4M3, I8)
    assert f8["layers.0.ffn.experts.3.w2.scale"].shape == (2, 1)
    assert f4["layers.0.ffn.experts.3.w2.scale"].shape == (256, 4)
    w = "layers.1.attn.wq_b.weight"
    assert (bf[w].dtype, f8[w].dtype, f4[w].dtype) == (BF16, E4M3, E4M3)
    for n in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight",
              "layers.0.ffn.gate.weight"):
        assert f4[n].dtype == BF16 and f4[n].quant is None


def test_tiny_layer_kinds():
    s = official_tensor_specs(preset("tiny"), "bf16")
    # tiny: ratios (0, 4, 128, 4) + MTP 0, 2 hash layers
    assert "layers.0.attn.compressor.ape" not in s
    assert s["layers.1.attn.compressor.ape"].shape == (4, 256)
    assert s["layers.1.attn.indexer.compressor.ape"].shape == (4, 256)
    assert s["layers.2.attn.compressor.ape"].shape == (128, 128)
    assert "layers.2.attn.indexer.wq_b.weight" not in s
    assert "layers.3.attn.indexer.wq_b.weight" in s
    assert "layers.1.ffn.gate.tid2eid" in s and "layers.2.ffn.gate.bias" in s
    assert s["layers.0.ffn.gate.tid2eid"].shape == (1024, 2)
    assert list(s)[:3] == ["embed.weight", "head.weight", "norm.weight"]
