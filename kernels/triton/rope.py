"""Triton rotary position embedding: one pass over the tensor (``kernels.reference.rope.apply_rope``).

Why a kernel: the reference op is about nine elementwise kernels (casts, four products, a stack, a cast back)
over the rope slice plus a ``torch.cat`` of the whole tensor, forward and again backward, for every query,
key and attention output of every layer; on the Flash-shaped model that glue was a sixth of the training
step (bench/results/train-cli-h200-flash-shaped-seq4096-triton-adam.json). Here each row is read once and
written once.

Rows: ``x`` is ``[R, D]`` (the entry point flattens ``[B, S, D]`` or ``[B, S, H, D]``); row ``r`` belongs to
token ``(r // heads) % N`` of ``cos`` / ``sin`` ``[N, D_rope / 2]`` (fp32). The trailing ``D_rope`` channels
are rotated in interleaved pairs ``(x[2i], x[2i+1])`` in fp32 with every product rounded on its own, as the
reference's separate torch kernels round them, so the output has the reference op's bits; the others are copied.

The backward of a rotation is the inverse rotation (``inverse=True``: the angle's sine negated), so one
kernel serves both directions and nothing is saved for the backward but ``cos`` and ``sin``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.triton import pdl

__all__ = ["apply_rope", "rope_launch", "ROPE_ELEMENTS_PER_PROGRAM"]

# elements (rows x padded row width) one program handles: enough in flight per SM for a copy-bound kernel
ROPE_ELEMENTS_PER_PROGRAM = 8192


@triton.jit
def _product(a, b, ROUNDED: tl.constexpr):
    """``a * b`` rounded to fp32 on its own: ``mul.rn`` is never contracted into a fused multiply-add, so the sum
    of two products rounds as torch's separate kernels round it (the reference's bits)."""
    if ROUNDED:
        out = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                        is_pure=True, pack=1)
    else:                     # Triton's CPU interpreter (no PTX): numpy rounds every product anyway
        out = a * b
    return out


@triton.jit
def _rotate_pairs(ev, od, c, s, rope, ROUNDED: tl.constexpr):
    """Interleaved pairs ``(ev, od)`` rotated by the angles ``c, s`` where ``rope`` (elsewhere as they are):
    ``ev c - od s`` and ``ev s + od c``, each product rounded on its own (:func:`_product`), the rounding of the
    fused decode kernels that rotate a row in registers (``compress``, ``norm_rope``, ``index_query``)."""
    ev2 = _product(ev, c, ROUNDED) - _product(od, s, ROUNDED)
    od2 = _product(ev, s, ROUNDED) + _product(od, c, ROUNDED)
    return tl.where(rope, ev2, ev), tl.where(rope, od2, od)


@triton.jit
def _rotate_channels(x, partner, c, s, odd, INVERSE: tl.constexpr, ROUNDED: tl.constexpr):
    """Channels ``x`` of interleaved pairs rotated by the angles ``c, s`` (the sine negated with ``INVERSE``), where
    ``partner`` is each channel's pair partner and ``odd`` marks a pair's second channel: ``x c - partner s`` at an
    even channel, ``x c + partner s`` at an odd one, each product rounded on its own (:func:`_product`). The
    rotation of :func:`_rope_kernel`, shared with the sparse attention's inverse-rope epilogue
    (``kernels.triton.attention``) so that the two give the same bits."""
    if INVERSE:
        s = -s
    sign = tl.where(odd, 1.0, -1.0)
    return _product(x, c, ROUNDED) + sign * _product(partner, s, ROUNDED)


@triton.jit(do_not_specialize=["R", "N"])
def _rope_kernel(X, COS, SIN, OUT, R, N, HEADS,
                 D: tl.constexpr, HALF: tl.constexpr, PD: tl.constexpr, BR: tl.constexpr,
                 INVERSE: tl.constexpr, ROUNDED: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, PD)
    rmask = rows < R
    mask = rmask[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    src = X + rows64[:, None] * D
    x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    NOPE: tl.constexpr = D - 2 * HALF
    is_rope = (cols >= NOPE) & (cols < D)
    rope_mask = rmask[:, None] & is_rope[None, :]
    partner = tl.load(src + (cols ^ 1)[None, :], mask=rope_mask, other=0.0).to(tl.float32)  # NOPE is even
    pair = tl.where(is_rope, (cols - NOPE) // 2, 0)
    tok = ((rows // HEADS) % N).to(tl.int64)
    cs = tok[:, None] * HALF + pair[None, :]
    c = tl.load(COS + cs, mask=rope_mask, other=1.0)
    s = tl.load(SIN + cs, mask=rope_mask, other=0.0)
    # even channel: a*c - b*s (a = x, b = the odd partner); odd channel: a*s + b*c (a = the even partner, b = x)
    rotated = _rotate_channels(x, partner, c, s, ((cols & 1) == 1)[None, :], INVERSE, ROUNDED)
    out = tl.where(is_rope[None, :], rotated, x)
    tl.store(OUT + rows64[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, inverse: bool) -> torch.Tensor:
    """The ``dsv4_triton::rope`` op's launcher: ``x [R, D]`` contiguous, ``cos``/``sin`` ``[N, D_rope/2]`` fp32."""
    R, D = x.shape
    half = cos.shape[-1]
    out = torch.empty_like(x)
    if R == 0:
        return out
    pd = triton.next_power_of_2(D)
    br = max(1, min(triton.next_power_of_2(R), ROPE_ELEMENTS_PER_PROGRAM // pd))
    _rope_kernel[(triton.cdiv(R, br),)](x, cos, sin, out, R, cos.shape[0], heads, D=D, HALF=half, PD=pd, BR=br,
                                       INVERSE=inverse, ROUNDED=not gpu_common.interpreting(),
                                       num_warps=4, **pdl.launch(x.device))
    return out


@gpu_ops.traceable
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """:func:`kernels.reference.rope.apply_rope` in one kernel: ``x`` ``[B, S, D]`` or ``[B, S, H, D]`` (CUDA,
    bf16/fp16/fp32), ``cos``/``sin`` ``[S, r/2]`` or ``[B, S, r/2]`` (cast to fp32, the reference's math
    precision for these dtypes). Out of place; differentiable in ``x`` (the backward is the inverse rotation).
    Anything else is refused with the reason."""
    gpu_common.check_op_input("apply_rope", x, "x")
    half = cos.shape[-1]
    if x.dim() < 3 or x.shape[-1] % 2 or 2 * half > x.shape[-1]:
        raise gpu_common.op_refusal("apply_rope", f"x {tuple(x.shape)} with {2 * half} rope channels (needs "
                                                  f"[B, S, (H,) D], D even, D >= rope)")
    if cos.shape != sin.shape or cos.shape[:-1] not in (x.shape[1:2], x.shape[:2]):
        raise gpu_common.op_refusal("apply_rope", f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not give "
                                                  f"one angle per token of x {tuple(x.shape)} "
                                                  f"([S, r/2] or [B, S, r/2])")
    heads = 1
    for n in x.shape[2:-1]:
        heads *= n
    c = cos.to(torch.float32).reshape(-1, half).contiguous()
    s = sin.to(torch.float32).reshape(-1, half).contiguous()
    flat = x.contiguous().view(-1, x.shape[-1])
    return gpu_ops.TRITON.rope(flat, c, s, heads, bool(inverse)).view(x.shape)
