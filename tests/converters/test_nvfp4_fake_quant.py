"""NVFP4 / MXFP4 / FP8-KV fake quant against straightforward loop references, bit for bit."""

import math

import pytest
import torch

from converters.fake_quant import (
    fake_quant_fp8_act, fake_quant_kv_nope, fake_quant_mxfp4, fake_quant_nvfp4, fake_quant_nvfp4_pair,
)
from converters.nvfp4 import (
    nvfp4_dequantize, nvfp4_quantize, nvfp4_quantize_pair, quantize_experts_nvfp4,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------------------
# independent references: Python scalars, loops over blocks and elements
# ---------------------------------------------------------------------------

def ref_e2m1(v: float) -> float:
    """Nearest e2m1 value, ties to the even code, saturating at 6."""
    a = min(abs(v), 6.0)
    best = None
    for code, g in enumerate(GRID):
        d = abs(a - g)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, code, g)
    r = best[2]
    return -r if (v < 0 and r != 0) else r


def f32(v) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def ceil_log2(v: float) -> int:
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


def ref_fp8_act(x: torch.Tensor, block=64) -> torch.Tensor:
    rows = x.float().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        for j in range(0, rows.shape[1], block):
            blk = rows[r, j:j + block]
            amax = max(float(blk.abs().max()), f32(1e-4))
            s = 2.0 ** ceil_log2(f32(amax / 448.0))
            y = torch.clamp(blk / s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * s
            out[r, j:j + block] = y
    return out.reshape(x.shape).to(x.dtype)


def ref_mxfp4(x: torch.Tensor, block=32) -> torch.Tensor:
    rows = x.float().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        for j in range(0, rows.shape[1], block):
            blk = rows[r, j:j + block].tolist()
            amax = max(max(abs(v) for v in blk), 6.0 * 2.0 ** -126)
            s = 2.0 ** ceil_log2(f32(amax / 6.0))
            out[r, j:j + block] = torch.tensor([ref_e2m1(f32(v / s)) * s for v in blk])
    return out.reshape(x.shape).to(x.dtype)


def ref_nvfp4(x: torch.Tensor, amax=None):
    """Returns (dequantized fp32, block scales as floats, global scale)."""
    xf = x.float()
    ga = float(xf.abs().max()) if amax is None else amax
    g = f32(f32(max(ga, 1e-12)) / f32(6.0 * 448.0))
    out = torch.empty_like(xf)
    scales = torch.empty(xf.shape[0], xf.shape[1] // 16)
    for r in range(xf.shape[0]):
        for j in range(0, xf.shape[1], 16):
            blk = xf[r, j:j + 16]
            bamax = float(blk.abs().max())
            b = float(torch.tensor(min(f32(f32(bamax / 6.0) / g), 448.0)).to(torch.float8_e4m3fn).float())
            scales[r, j // 16] = b
            e = f32(b * g)
            for k in range(16):
                v = float(blk[k])
                code_val = 0.0 if e == 0 else ref_e2m1(f32(v / e))
                out[r, j + k] = f32(code_val * e)
    return out, scales, g


def _wide(shape, seed, spread=4.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * spread)
    x.view(-1)[:7] = 0.0
    return x.to(dtype)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    ai = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    bi = b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    return torch.equal(ai, bi)


# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_act_matches_reference(dtype):
    x = _wide((3, 5, 192), 0, spread=3.0, dtype=dtype)
    x[0, 0, :64] = 1e-7                               # amax floor 1e-4 kicks in
    x[1, 1, 64:128] = 448.0 * 2 ** 5                  # exact power-of-two amax
    y = fake_quant_fp8_act(x)
    assert y.dtype == dtype
    assert _same_bits(y, ref_fp8_act(x))


def test_kv_nope_only():
    kv = _wide((2, 7, 512), 1, spread=2.0, dtype=torch.bfloat16)
    y = fake_quant_kv_nope(kv, rope_dim=64)
    assert torch.equal(y[..., -64:], kv[..., -64:])
    assert _same_bits(y[..., :-64].contiguous(), ref_fp8_act(kv[..., :-64].contiguous()))
    assert not torch.equal(y[..., :-64], kv[..., :-64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_reference(dtype):
    x = _wide((6, 128), 2, spread=3.0, dtype=dtype)
    x[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 4) * 0.25  # exact ties at s=1/4
    x[0, 7] = 1.5
    y = fake_quant_mxfp4(x)
    assert _same_bits(y, ref_mxfp4(x))


def test_nvfp4_matches_reference():
    w = _wide((16, 64), 3, spread=2.5)
    w[2, :16] = 0.0                                     # an all-zero block (scale 0)
    q = nvfp4_quantize(w)
    ref, ref_scales, g = ref_nvfp4(w)
    assert q.packed.dtype == torch.uint8 and tuple(q.packed.shape) == (16, 32)
    assert q.block_scale.dtype == torch.float8_e4m3fn and tuple(q.block_scale.shape) == (16, 4)
    assert q.global_scale.dtype == torch.float32 and tuple(q.global_scale.shape) == (1,)
    assert float(q.global_scale) == g
    assert torch.equal(q.block_scale.float(), ref_scales)
    deq = nvfp4_dequantize(q.packed, q.block_scale, q.global_scale)
    assert _same_bits(deq, ref)
    assert _same_bits(fake_quant_nvfp4(w), ref)


def test_nvfp4_pair_shares_global_amax():
    gate = _wide((8, 32), 4)
    up = _wide((8, 32), 5) * 10
    qg, qu = nvfp4_quantize_pair(gate, up)
    amax = max(float(gate.abs().max()), float(up.abs().max()))
    assert torch.equal(qg.global_scale, qu.global_scale)
    ref_g, _, _ = ref_nvfp4(gate, amax)
    ref_u, _, _ = ref_nvfp4(up, amax)
    assert _same_bits(nvfp4_dequantize(*qg), ref_g)
    assert _same_bits(nvfp4_dequantize(*qu), ref_u)
    fg, fu = fake_quant_nvfp4_pair(gate, up)
    assert _same_bits(fg, ref_g) and _same_bits(fu, ref_u)
    # differs from quantizing the gate alone (its own amax)
    assert not torch.equal(nvfp4_quantize(gate).global_scale, qg.global_scale)


def test_nvfp4_bucket_routed_only_and_lone_gate_raises():
    t = lambda s: _wide((16, 32), s)
    bucket = [("layers.0.ffn.experts.1.w1.weight", t(1)), ("layers.0.ffn.experts.1.w2.weight", t(2)),
              ("layers.0.ffn.shared_experts.w1.weight", t(3)), ("layers.0.ffn.shared_experts.w3.weight", t(4)),
              ("layers.0.attn.wq_a.weight", t(5)), ("layers.0.ffn.experts.1.w3.weight", t(6))]
    out = dict(quantize_experts_nvfp4(bucket))
    for n in ("layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.shared_experts.w3.weight",
              "layers.0.attn.wq_a.weight"):
        assert out[n] is dict(bucket)[n]                # high precision, untouched
        assert n + "_scale" not in out
    for n in ("layers.0.ffn.experts.1.w1.weight", "layers.0.ffn.experts.1.w2.weight",
              "layers.0.ffn.experts.1.w3.weight"):
        assert out[n].dtype == torch.uint8 and out[n + "_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(out["layers.0.ffn.experts.1.w1.weight_scale_2"], out["layers.0.ffn.experts.1.w3.weight_scale_2"])
    with pytest.raises(ValueError, match=r"experts\.1\.w3\.weight.*same bucket"):
        quantize_experts_nvfp4([("layers.0.ffn.experts.1.w1.weight", t(1))])
    with pytest.raises(ValueError, match=r"up projection.*experts\.1\.w1\.weight"):
        quantize_experts_nvfp4([("layers.0.ffn.experts.1.w3.weight", t(1))])
    with pytest.raises(ValueError, match="both"):
        nvfp4_quantize_pair(t(1), None)


@pytest.mark.parametrize("fn", [fake_quant_nvfp4, fake_quant_mxfp4, fake_quant_fp8_act,
                                lambda x: fake_quant_kv_nope(x, 64)])
def test_straight_through_gradient(fn):
    x = _wide((4, 256), 7, spread=1.0).requires_grad_(True)
    y = fn(x)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)
    assert not torch.equal(y.detach(), x.detach())


def test_pair_gradients_flow_to_both():
    gate = _wide((8, 32), 8).requires_grad_(True)
    up = _wide((8, 32), 9).requires_grad_(True)
    fg, fu = fake_quant_nvfp4_pair(gate, up)
    (fg.sum() + 2 * fu.sum()).backward()
    assert torch.equal(gate.grad, torch.ones_like(gate)) and torch.equal(up.grad, torch.full_like(up, 2.0))
