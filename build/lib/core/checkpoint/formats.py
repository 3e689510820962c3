"""Low-level weight codecs of the official DeepSeek-V4 checkpoint.

All functions are vectorised torch code (no Python loops over elements) and
run on whatever device the inputs live on.

Formats (architecture.md §3.2):

* **UE8M0 scales** (``torch.float8_e8m0fnu``): one byte ``b``, value
  ``2**(b - 127)``; ``b == 255`` is NaN. Only powers of two are representable.
  We convert to/from this dtype through the raw byte so the result never
  depends on the rounding of torch's cast.
* **FP8 e4m3 weights, 128x128 blocks**: ``W[i, j] = f32(q[i, j]) *
  f32(scale[i // 128, j // 128])``, scale shape ``[ceil(out/128),
  ceil(in/128)]``. Shapes that are not multiples of 128 have a partial last
  block. Scales are either ue8m0 (power of two, ``2**ceil(log2(amax/448))``)
  or plain fp32 (``amax/448``).
* **FP4 e2m1 weights, 1x32 blocks** (routed experts, "mxfp4"): two 4-bit
  codes per int8 byte, the **low nibble holds the even column**, the high
  nibble the odd one; storage shape ``[out, in/2]`` int8. Code ``c`` decodes
  to ``FP4_TABLE[c]`` (bit 3 is the sign). Scale ``[out, ceil(in/32)]`` ue8m0,
  ``W[i, j] = FP4_TABLE[code(i, j)] * scale[i, j // 32]``. Quantisation uses
  ``scale = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))`` per block and rounds
  ``x / scale`` to the nearest representable value (ties to the even code,
  as a hardware e2m1 cast does).
"""

from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32

# Value of each 4-bit e2m1 code; code 8 is -0.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp4_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16-entry e2m1 decode table as a tensor."""
    return torch.tensor(FP4_VALUES, dtype=dtype, device=device)


# --------------------------------------------------------------------------
# UE8M0 (power-of-two) scales
# --------------------------------------------------------------------------

def pow2_ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` for positive finite fp32 ``x``, as int32.

    Uses ``frexp`` (``x = m * 2**e``, ``m`` in [0.5, 1)) so that exact powers
    of two are never pushed up by float rounding of ``log2``.
    """
    m, e = torch.frexp(x.float())
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents (clamped to [-127, 127]) -> ``float8_e8m0fnu``."""
    biased = (exp.to(torch.int32).clamp(-127, 127) + 127).to(torch.uint8)
    return biased.view(E8M0_DTYPE)


def e8m0_to_float(scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``float8_e8m0fnu`` -> float (exact; byte 255 becomes NaN)."""
    if scale.dtype != E8M0_DTYPE:
        raise TypeError(f"expected float8_e8m0fnu, got {scale.dtype}")
    b = scale.view(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - 127)
    out = torch.where(b == 255, torch.full_like(out, float("nan")), out)
    return out.to(dtype)


def float_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Positive floats -> ue8m0, rounding **up** to the next power of two."""
    return e8m0_from_exponent(pow2_ceil_exponent(x))


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor stored as ue8m0 or as a float dtype -> fp32."""
    if scale.dtype == E8M0_DTYPE:
        return e8m0_to_float(scale)
    return scale.float()


# --------------------------------------------------------------------------
# FP8 e4m3, 128x128 blocks
# --------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(shape, block: int = FP8_BLOCK) -> Tuple[int, int]:
    """Scale shape ``[ceil(out/block), ceil(in/block)]`` for a 2-D weight."""
    out_f, in_f = shape
    return (_ceil_div(out_f, block), _ceil_div(in_f, block))


def _pad2d(x: torch.Tensor, block: int) -> torch.Tensor:
    out_f, in_f = x.shape
    pr, pc = (-out_f) % block, (-in_f) % block
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x


def fp8_block_quantize(
    w: torch.Tensor, *, block: int = FP8_BLOCK, scale_fmt: str = "ue8m0"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D float weight to FP8 e4m3 with one scale per block.

    ``scale_fmt="ue8m0"`` gives power-of-two scales stored as
    ``float8_e8m0fnu`` (the official format); ``"fp32"`` gives ``amax/448``
    stored as fp32. Returns ``(q [out, in] float8_e4m3fn, scale)``.
    """
    if w.dim() != 2:
        raise ValueError(f"fp8_block_quantize expects a 2-D tensor, got shape {tuple(w.shape)}")
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32', got {scale_fmt!r}")
    out_f, in_f = w.shape
    rb, cb = fp8_scale_shape(w.shape, block)
    xp = _pad2d(w.float(), block).view(rb, block, cb, block)
    amax = xp.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    if scale_fmt == "ue8m0":
        exp = pow2_ceil_exponent(amax / FP8_MAX)
        scale_f = torch.ldexp(torch.ones_like(amax), exp)
        scale = e8m0_from_exponent(exp)
    else:
        scale_f = amax / FP8_MAX
        scale = scale_f
    q = (xp / scale_f[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(rb * block, cb * block)[:out_f, :in_f].contiguous()
    return q, scale.contiguous()


def fp8_block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, *, block: int = FP8_BLOCK, dtype=torch.float32
) -> torch.Tensor:
    """Inverse of :func:`fp8_block_quantize`; ``scale`` may be ue8m0 or float."""
    if q.dim() != 2:
        raise ValueError(f"fp8_block_dequantize expects a 2-D tensor, got shape {tuple(q.shape)}")
    out_f, in_f = q.shape
    rb, cb = fp8_scale_shape(q.shape, block)
    if tuple(scale.shape) != (rb, cb):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} "
                         f"(expected {(rb, cb)})")
    s = scale_to_float(scale)
    xp = _pad2d(q.float(), block).view(rb, block, cb, block) * s[:, None, :, None]
    return xp.view(rb * block, cb * block)[:out_f, :in_f].to(dtype).contiguous()


# --------------------------------------------------------------------------
# FP4 e2m1, packed two per byte, 1x32 blocks
# --------------------------------------------------------------------------

def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8/int, values 0..15, last dim even) -> int8 ``[..., n/2]``.

    Column ``2k`` goes to the low nibble of byte ``k``, column ``2k+1`` to the
    high nibble.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4_pack needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 0xF
    lo, hi = c[..., 0::2], c[..., 1::2]
    return (lo | (hi << 4)).view(torch.int8)


def fp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 ``[..., n/2]`` -> uint8 codes ``[..., n]`` (bit-exact inverse of pack)."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed.to(torch.uint8)
    lo, hi = b & 0xF, b >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Round floats (already divided by their scale) to the nearest e2m1 code.

    Magnitudes above 6 saturate to 6. Exact ties go to the even code
    (round-half-to-even on the e2m1 grid). Zero maps to code 0 (+0).

    The e2m1 grid is uniform piecewise (step 0.5 on [0, 2), 1 on [2, 4), 2 on
    [4, 6]), so ``round_half_even(m / step) * step`` is the nearest value, and
    in every piece an even multiple of the step is an even code.
    """
    xf = x.float()
    mag = xf.abs().clamp(max=FP4_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    q = torch.round(mag / step) * step                       # torch.round is half-to-even
    code = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q * 0.5 + 4)).to(torch.uint8)
    neg = (xf < 0) & (code != 0)
    return code | (neg.to(torch.uint8) << 3)


def fp4_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """e2m1 codes -> values via :data:`FP4_VALUES`."""
    return fp4_table(codes.device, dtype)[codes.long()]


def fp4_scale_shape(shape, block: int = FP4_BLOCK) -> Tuple[int, int]:
    """Scale shape ``[out, ceil(in/block)]`` for a logical ``[out, in]`` weight."""
    out_f, in_f = shape
    return (out_f, _ceil_div(in_f, block))


def _pad_last(x: torch.Tensor, block: int) -> torch.Tensor:
    pc = (-x.shape[-1]) % block
    return torch.nn.functional.pad(x, (0, pc)) if pc else x


def fp4_quantize(w: torch.Tensor, *, block: int = FP4_BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D float weight ``[out, in]`` to packed FP4 + ue8m0 scales.

    Returns ``(packed int8 [out, in/2], scale float8_e8m0fnu [out, ceil(in/32)])``.
    """
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"fp4_quantize expects a 2-D tensor with even columns, got {tuple(w.shape)}")
    out_f, in_f = w.shape
    nb = _ceil_div(in_f, block)
    xp = _pad_last(w.float(), block).view(out_f, nb, block)
    amax = xp.abs().amax(dim=-1).clamp_min(FP4_MAX * 2.0 ** -126)
    exp = pow2_ceil_exponent(amax / FP4_MAX)
    scale_f = torch.ldexp(torch.ones_like(amax), exp)
    codes = fp4_encode(xp / scale_f[..., None]).view(out_f, nb * block)[:, :in_f]
    return fp4_pack(codes).contiguous(), e8m0_from_exponent(exp).contiguous()


def fp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, *, block: int = FP4_BLOCK, dtype=torch.float32
) -> torch.Tensor:
    """Packed FP4 ``[out, in/2]`` + ue8m0 (or float) scale ``[out, ceil(in/32)]`` -> ``[out, in]``."""
    if packed.dim() != 2:
        raise ValueError(f"fp4_dequantize expects a 2-D tensor, got shape {tuple(packed.shape)}")
    out_f, half = packed.shape
    in_f = 2 * half
    nb = _ceil_div(in_f, block)
    if tuple(scale.shape) != (out_f, nb):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match packed weight "
                         f"{tuple(packed.shape)} (expected {(out_f, nb)})")
    vals = _pad_last(fp4_decode(fp4_unpack(packed)), block).view(out_f, nb, block)
    vals = vals * scale_to_float(scale)[..., None]
    return vals.view(out_f, nb * block)[:, :in_f].to(dtype).contiguous()

