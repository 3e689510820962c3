"""Codec tests: ue8m0 scales, FP8 e4m3 128x128 blocks, FP4 e2m1 packing and 1x32 blocks."""

import torch
import pytest

from core.checkpoint import formats as F


def test_e8m0_roundtrip_all_exponents():
    e = torch.arange(-127, 128)
    s = F.e8m0_from_exponent(e)
    assert s.dtype == torch.float8_e8m0fnu
    assert torch.equal(s.view(torch.uint8).long(), e + 127)
    assert torch.equal(F.e8m0_to_float(s), torch.ldexp(torch.ones(255), e))
    nan = torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.isnan(F.e8m0_to_float(nan)).all()


def test_pow2_ceil_exponent_exact():
    x = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0000001, 0.75, 2.0 ** -126, 2.0 ** 100 * 1.5, 1 / 448])
    assert F.pow2_ceil_exponent(x).tolist() == [0, 1, -1, 2, 1, 0, -126, 101, -8]
    assert F.float_to_e8m0(torch.tensor([3.0])).view(torch.uint8).item() == 129


def test_fp8_hand_example():
    w = torch.ones(128, 128)
    q, s = F.fp8_block_quantize(w)
    # amax/448 = 1/448 -> next power of two is 2^-8 (byte 119); 1 / 2^-8 = 256 exactly in e4m3
    assert s.shape == (1, 1) and s.view(torch.uint8).item() == 119
    assert q.dtype == torch.float8_e4m3fn and (q.float() == 256.0).all()
    assert torch.equal(F.fp8_block_dequantize(q, s), w)
    # fp32 scales: amax maps to 448
    q, s = F.fp8_block_quantize(w * 3, scale_fmt="fp32")
    assert s.dtype == torch.float32 and torch.allclose(s, torch.tensor([[3 / 448]]))
    assert (q.float() == 448.0).all()


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (130, 257), (1, 5), (300, 129)])
@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_roundtrip_error_bound(shape, fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])[None, :]
    q, s = F.fp8_block_quantize(x, scale_fmt=fmt)
    assert q.shape == x.shape and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    y = F.fp8_block_dequantize(q, s)
    sf = F.scale_to_float(s).repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 * scale
    bound = torch.maximum(x.abs() * 2 ** -4, sf * 2 ** -10) * (1 + 1e-6)
    assert ((x - y).abs() <= bound).all()
    if fmt == "ue8m0":
        amax = F._pad2d(x, 128).view(s.shape[0], 128, s.shape[1], 128).abs().amax(dim=(1, 3))
        ratio = amax / F.scale_to_float(s)
        assert ((ratio <= 448) & (ratio > 224)).all()
    # dequantising again gives the same values: the codes are a fixed point
    q2, s2 = F.fp8_block_quantize(y, scale_fmt=fmt)
    assert torch.equal(F.fp8_block_dequantize(q2, s2), y)


def test_fp8_bad_scale_shape():
    q, s = F.fp8_block_quantize(torch.randn(130, 130))
    with pytest.raises(ValueError):
        F.fp8_block_dequantize(q, s[:1])


def test_fp4_pack_hand_examples():
    codes = torch.tensor([[1, 2, 15, 0, 0, 15]], dtype=torch.uint8)
    packed = F.fp4_pack(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F, 0xF0]]
    assert packed.tolist() == [[33, 15, -16]]
    assert torch.equal(F.fp4_unpack(packed), codes)


def test_fp4_pack_unpack_bit_exact():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (64, 96), generator=g, dtype=torch.uint8)
    assert torch.equal(F.fp4_unpack(F.fp4_pack(codes)), codes)
    raw = torch.randint(-128, 128, (7, 33), generator=g, dtype=torch.int8)
    assert torch.equal(F.fp4_pack(F.fp4_unpack(raw)), raw)


def test_fp4_table_and_encode():
    table = F.fp4_table()
    assert table.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6]
    # every representable value maps to its own code (-0 -> +0)
    codes = F.fp4_encode(table)
    assert codes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]
    # nearest, ties to the even code, saturation at 6
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.26, 4.9, -0.3, -100.0, 0.1, -0.1])
    assert F.fp4_decode(F.fp4_encode(x)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0.5, 4, -0.5, -6, 0, 0]


def test_fp4_quantize_hand_example():
    row = torch.tensor([6.0, -3.0, 0.5, 1.0] + [0.0] * 28)
    w = torch.stack([row, row * 4, row / 8])  # scales 1, 4, 1/8
    packed, s = F.fp4_quantize(w)
    assert packed.shape == (3, 16) and s.shape == (3, 1)
    assert s.view(torch.uint8).flatten().tolist() == [127, 129, 124]
    assert F.fp4_unpack(packed)[0, :4].tolist() == [7, 13, 1, 2]
    assert packed.view(torch.uint8)[0, :2].tolist() == [0xD7, 0x21]
    assert torch.equal(F.fp4_dequantize(packed, s), w)


@pytest.mark.parametrize("shape", [(64, 128), (32, 4096), (5, 48)])
def test_fp4_roundtrip_error_bound(shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[0])[:, None]
    packed, s = F.fp4_quantize(x)
    nb = -(-shape[1] // 32)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.int8
    assert s.shape == (shape[0], nb) and s.dtype == torch.float8_e8m0fnu
    y = F.fp4_dequantize(packed, s)
    sf = F.scale_to_float(s).repeat_interleave(32, 1)[:, : shape[1]]
    bound = torch.maximum(x.abs() * 0.25, sf * 0.25) * (1 + 1e-6)
    assert ((x - y).abs() <= bound).all()
    # idempotent on already-representable values
    p2, s2 = F.fp4_quantize(y)
    assert torch.equal(F.fp4_dequantize(p2, s2), y)
    # the dequantised values are table values times the block scale
    assert torch.equal(y, F.fp4_decode(F.fp4_unpack(packed)) * sf)


def test_fp4_encode_matches_brute_force_nearest():
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randn(50000, generator=g) * 3,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -7.0, 0.0, 1e-9])])
    table = F.fp4_table()[:8]
    dist = (x.abs().clamp(max=6)[:, None] - table[None]).abs()
    is_best = dist == dist.min(dim=1, keepdim=True).values
    code = torch.arange(8).expand_as(is_best)
    ref = torch.where(is_best, code % 2, 2).argmin(dim=1)  # among ties prefer the even code
    ref = torch.where((x < 0) & (ref != 0), ref + 8, ref).to(torch.uint8)
    assert torch.equal(F.fp4_encode(x), ref)
