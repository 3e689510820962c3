"""Fused Triton converter kernels vs the torch path, bit for bit, on the GPU.

Each converter runs twice on the same CUDA tensors: through its Triton kernel
(the default on CUDA) and through the torch reference (``DSV4_CONVERTERS_TRITON=0``).
Outputs must be identical bytes (NaNs: NaN on both sides), on odd shapes (not
multiples of 128), wide scale spreads, all-zero tiles, and large tensors (the
tuned launch configurations).
"""

import importlib.util

import pytest
import torch

from converters._accel import ENV_SWITCH, triton_kernels_for
from core.checkpoint.formats import E8M0_DTYPE, fp4_pack

_HAVE = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _HAVE, reason="needs a CUDA GPU and triton")]

DEV = "cuda"
BIG_SHAPE = (2048, 2304)          # >= 2^22 elements: the large-tensor launch path
ODD_SHAPES = [(256, 384), (200, 130), (1, 1), (129, 4097), (300, 1000)]


@pytest.fixture
def torch_path(monkeypatch):
    """Calls ``fn(*a, **k)`` with the Triton path switched off (the torch reference)."""
    def run(fn, *a, **k):
        with monkeypatch.context() as m:
            m.setenv(ENV_SWITCH, "0")
            return fn(*a, **k)
    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _nan(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn,):
        return (t.contiguous().view(torch.uint8) & 0x7F) == 0x7F
    if t.dtype == E8M0_DTYPE:
        return t.contiguous().view(torch.uint8) == 255
    if t.is_floating_point():
        return torch.isnan(t)
    return torch.zeros(t.shape, dtype=torch.bool, device=t.device)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    n1, n2 = _nan(got), _nan(want)
    assert torch.equal(n1, n2), "NaN positions differ"
    diff = (_bits(got) != _bits(want)) & ~n1
    if bool(diff.any()):
        idx = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{int(diff.sum())} elements differ, first at {idx}: "
                             f"got {[got[tuple(i)].item() for i in idx]} want {[want[tuple(i)].item() for i in idx]}")


def _wide(shape, seed, dtype=torch.float32, spread=4.0):
    """Values whose magnitudes span many powers of two, with all-zero rows/tiles."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * spread)
    w[: min(3, shape[0])] = 0
    if shape[0] >= 256 and shape[1] >= 256:
        w[128:256, 128:256] = 0              # one all-zero 128x128 tile
    if shape[0] >= 128 and shape[1] >= 256:
        w[:128, :128] *= 1e-30               # a tile far below the others
    return w.to(dtype).to(DEV)


def test_triton_path_is_taken():
    assert triton_kernels_for(torch.zeros(1, device=DEV)) is not None


# --------------------------------------------------------------------------- fp8 -> bf16

def _scales(kind, rb, cb, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "e8m0":
        b = torch.randint(0, 255, (rb, cb), generator=g, dtype=torch.uint8)
        b.view(-1)[:3] = torch.tensor([0, 254, 127], dtype=torch.uint8)[: b.numel()]
        return b.view(E8M0_DTYPE).to(DEV)
    s = torch.exp(torch.randn(rb, cb, generator=g) * 20).clamp(1e-38, 1e30)
    return s.to({"fp32": torch.float32, "bf16": torch.bfloat16}[kind]).to(DEV)


@pytest.mark.parametrize("shape,out_dtype", [(s, torch.bfloat16) for s in ODD_SHAPES + [BIG_SHAPE]]
                         + [((200, 130), torch.float32), ((129, 4097), torch.float32), (BIG_SHAPE, torch.float32)])
@pytest.mark.parametrize("kind", ["fp32", "e8m0", "bf16"])
def test_fp8_dequant_bit_identical(shape, kind, out_dtype, torch_path):
    from converters.fp8_to_bf16 import dequantize_fp8_weight
    from converters.triton_kernels import fp8_block_dequantize
    q = _wide(shape, 1).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = _scales(kind, -(-shape[0] // 128), -(-shape[1] // 128), 2)
    want = torch_path(dequantize_fp8_weight, q, s, dtype=out_dtype)
    assert_same_bits(fp8_block_dequantize(q, s, out_dtype), want)
    assert_same_bits(dequantize_fp8_weight(q, s, dtype=out_dtype), want)


def test_fp8_dequant_nan_scale_e5m2_and_strided(torch_path):
    from converters.fp8_to_bf16 import dequantize_fp8_weight
    big = _wide((300, 700), 3).clamp(-448, 448)
    q = big.to(torch.float8_e4m3fn)[:, 100:613]               # row stride 700, unit column stride
    s = _scales("e8m0", 3, 5, 4)
    s.view(torch.uint8)[1, 2] = 255                         # NaN block scale
    assert_same_bits(dequantize_fp8_weight(q, s), torch_path(dequantize_fp8_weight, q, s))
    q5 = big.clamp(-5e4, 5e4).to(torch.float8_e5m2)
    s5 = _scales("fp32", 3, 6, 5)
    assert_same_bits(dequantize_fp8_weight(q5, s5), torch_path(dequantize_fp8_weight, q5, s5))


# --------------------------------------------------------------------------- fp8 quantize

@pytest.mark.parametrize("shape,dtype", [(s, d) for s in ODD_SHAPES + [(128, 1), BIG_SHAPE]
                                         for d in (torch.bfloat16, torch.float32)] + [((300, 1000), torch.float16)])
@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_quantize_bit_identical(shape, dtype, fmt, torch_path):
    from converters.fp8_quantizer import quantize_fp8_blocks
    from converters.triton_kernels import fp8_block_quantize
    w = _wide(shape, 6, dtype, spread=2.0 if dtype == torch.float16 else 4.0)
    q_ref, s_ref = torch_path(quantize_fp8_blocks, w, fmt)
    for q, s in (fp8_block_quantize(w, fmt), quantize_fp8_blocks(w, fmt)):
        assert_same_bits(s, s_ref)
        assert_same_bits(q, q_ref)


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_publish_strided_and_exact_powers(fmt, torch_path):
    from converters.fp8_quantizer import quantize_for_publish
    w = _wide((384, 900), 7, torch.bfloat16)[:, 50:850]          # not contiguous
    w[200:300, 300:400] = 448.0                                   # amax exactly 448 * 2^0
    w[:128, 700:] = -2.0 ** -20
    name = "layers.0.attn.wq_a.weight"
    want = torch_path(quantize_for_publish, name, w, fmt)
    got = quantize_for_publish(name, w, fmt)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert_same_bits(a, b)


# --------------------------------------------------------------------------- mxfp4 -> fp8

def _mx_inputs(out_f, in_f, seed, spread, lo=-127, hi=125):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    codes[:, :128] = 0                                   # all-zero tiles (column 0)
    rb, cb = out_f // 128, in_f // 128
    top = torch.randint(lo + min(spread, hi - lo), hi + 1, (rb, 1, cb, 1), generator=g)
    e = (top - torch.randint(0, spread + 1, (rb, 128, cb, 4), generator=g)).clamp(-127, 127)
    e = e.reshape(out_f, in_f // 32)
    if rb * cb > 1:
        e.view(rb, 128, cb, 4)[0, :, cb - 1, :] = -127      # a tile at the e8m0 minimum
    return fp4_pack(codes).to(DEV), (e + 127).to(torch.uint8).view(E8M0_DTYPE).to(DEV)


@pytest.mark.parametrize("shape", [(128, 128), (384, 1280), (2048, 2048)])
@pytest.mark.parametrize("spread", [14, 15, 17, 250])
@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_mxfp4_cast_bit_identical(shape, spread, fmt, torch_path):
    from converters.mxfp4_to_fp8 import cast_mxfp4_to_fp8
    packed, scale = _mx_inputs(*shape, seed=spread, spread=spread)
    w_ref, s_ref, t_ref = torch_path(cast_mxfp4_to_fp8, packed, scale, scale_format=fmt, on_inexact="report")
    w8, s, tiles = cast_mxfp4_to_fp8(packed, scale, scale_format=fmt, on_inexact="report")
    assert_same_bits(w8, w_ref)
    assert_same_bits(s, s_ref)
    assert tiles == t_ref
    if spread <= 14:
        assert tiles == []


def test_mxfp4_nan_blocks_and_errors(torch_path):
    from converters.mxfp4_to_fp8 import InexactConversionError, cast_mxfp4_to_fp8
    packed, scale = _mx_inputs(384, 512, seed=3, spread=16)
    sb = scale.view(torch.uint8)
    sb[5, 3] = 255                               # NaN block in tile (0, 0)
    sb[300, 15] = 255                            # and in tile (2, 3)
    sb[130:140, 8:12] = 0                        # a tile with a far-off low block
    w_ref, s_ref, t_ref = torch_path(cast_mxfp4_to_fp8, packed, scale, name="x", on_inexact="report")
    w8, s, tiles = cast_mxfp4_to_fp8(packed, scale, name="x", on_inexact="report")
    assert_same_bits(w8, w_ref)
    assert_same_bits(s, s_ref)
    assert tiles == t_ref and any("NaN" in t["reason"] for t in tiles)
    with pytest.raises(InexactConversionError) as e_ref:
        torch_path(cast_mxfp4_to_fp8, packed, scale, name="x")
    with pytest.raises(InexactConversionError) as e_got:
        cast_mxfp4_to_fp8(packed, scale, name="x")
    assert e_got.value.tiles == e_ref.value.tiles and str(e_got.value) == str(e_ref.value)


# --------------------------------------------------------------------------- nvfp4

@pytest.mark.parametrize("shape", [(256, 512), (33, 48), (1, 16), (130, 4112), BIG_SHAPE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_quantize_bit_identical(shape, dtype, torch_path):
    from converters.nvfp4 import global_amax, nvfp4_quantize
    w = _wide(shape, 11, dtype, spread=2.0)
    assert_same_bits(global_amax(w), torch_path(global_amax, w))
    want = torch_path(nvfp4_quantize, w)
    got = nvfp4_quantize(w)
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    amax = torch.tensor(3.0 * float(w.float().abs().max()) + 1.0, device=DEV)   # a shared (larger) amax
    for a, b in zip(nvfp4_quantize(w, amax), torch_path(nvfp4_quantize, w, amax)):
        assert_same_bits(a, b)


def test_nvfp4_publish_bucket(torch_path):
    from converters.nvfp4 import quantize_experts_nvfp4
    bucket = [(f"layers.0.ffn.experts.{e}.w{k}.weight", _wide((128, 256), 20 + 3 * e + k, torch.bfloat16, 1.5))
              for e in range(3) for k in (1, 2, 3)]
    bucket.append(("layers.0.attn.wq_a.weight", _wide((64, 64), 99, torch.bfloat16)))
    want = torch_path(quantize_experts_nvfp4, bucket)
    got = quantize_experts_nvfp4(bucket)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert_same_bits(a, b)
