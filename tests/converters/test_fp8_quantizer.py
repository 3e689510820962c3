"""FP8 publish quantizer: allow-list routing and <= 1 e4m3 ULP round trips."""

import math

import pytest
import torch

from converters.fp8_quantizer import dequantize_fp8_blocks, quantize_for_publish
from core.checkpoint.formats import e8m0_to_float


def e4m3_ulp(y: torch.Tensor) -> torch.Tensor:
    """ULP of e4m3 at magnitude |y| (3 mantissa bits; subnormal step 2^-9 below 2^-6)."""
    a = y.abs().double()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    e = torch.clamp(e, min=-6.0)
    return torch.pow(2.0, e - 3)


def _scale_f(s):
    return e8m0_to_float(s) if s.dtype == torch.float8_e8m0fnu else s.float()


@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (128, 1)])
def test_round_trip_within_one_ulp(scale_format, shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    w[:5, :] = 0
    w = w.to(torch.bfloat16)
    name = "layers.0.attn.wq_a.weight"
    [(n1, q), (n2, s)] = quantize_for_publish(name, w, scale_format)
    assert (n1, n2) == (name, "layers.0.attn.wq_a.scale")
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    rb, cb = math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)
    assert tuple(s.shape) == (rb, cb)
    assert s.dtype == (torch.float8_e8m0fnu if scale_format == "ue8m0" else torch.float32)
    back = dequantize_fp8_blocks(q, s).double()
    sf = _scale_f(s).double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    x = w.double()
    ulp = e4m3_ulp(x / sf) * sf          # ULP of the element's own magnitude, in weight units
    err = (back - x).abs()
    assert bool((err <= ulp).all()), float((err / ulp).max())
    assert bool((err <= 0.5 * ulp * (1 + 1e-6)).all())  # it is round-to-nearest
    if scale_format == "ue8m0":
        ex = torch.log2(_scale_f(s))
        assert torch.equal(ex, ex.round())


def test_block_scales_follow_each_block():
    w = torch.zeros(256, 256)
    w[:128, :128] = 1000.0
    w[128:, 128:] = 1e-3
    [(_, q), (_, s)] = quantize_for_publish("layers.1.ffn.shared_experts.w2.weight", w, "fp32")
    assert torch.allclose(s, torch.tensor([[1000 / 448, 1e-4 / 448], [1e-4 / 448, 1e-3 / 448]]))
    assert torch.equal(dequantize_fp8_blocks(q, s)[:128, :128], torch.full((128, 128), 1000.0))


@pytest.mark.parametrize("name", [
    "layers.0.attn.wo_a.weight", "layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight",
    "layers.0.ffn.gate.weight", "embed.weight", "head.weight", "layers.0.attn_norm.weight",
])
def test_not_allow_listed_pass_through(name):
    t = torch.randn(128, 128, dtype=torch.bfloat16)
    [(n, out)] = quantize_for_publish(name, t)
    assert n == name and out is t


def test_hf_scale_suffix_and_errors():
    t = torch.randn(128, 128)
    out = quantize_for_publish("mtp.0.e_proj.weight", t, scale_suffix=".weight_scale_inv")
    assert out[1][0] == "mtp.0.e_proj.weight_scale_inv"
    with pytest.raises(ValueError, match="scale_format"):
        quantize_for_publish("mtp.0.e_proj.weight", t, "e5m2")
    with pytest.raises(ValueError, match="2-D"):
        quantize_for_publish("mtp.0.e_proj.weight", torch.randn(4, 4, 4))
