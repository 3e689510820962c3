"""Triton: an RMS norm and RoPE of a decode step's rows in one kernel, optionally written into the KV ring
(``norm_rope``; its torch contract is ``kernels.reference.norm_rope.norm_rope``).

Why: the eager decode step normalised and rotated each layer's query (``rms_normalize`` then ``apply_rope``, two
launches) and key (``kv_norm``, ``apply_rope`` and the write into its ring slot, three), five launches a layer
for a few hundred KB. Here each row is read once, normalised in fp32 (``x * rsqrt(mean(x^2) + eps)``, times the
weight for the weighted norm, cast to the row's dtype: ``kernels/triton/norm.py``'s rounding order), rotated on
its last ``2 * half`` channels in interleaved pairs with each product rounded on its own (``kernels/triton/
rope.py``'s), cast, and written: to a new tensor, or to row ``pos % window`` of the token's slot in the ring. The
norm's sum runs in another order than torch's mean: within a rounding step of the dtype. No gradient (a decode
step).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import pdl
from kernels.triton.rope import _rotate_pairs

__all__ = ["norm_rope", "norm_rope_launch", "MAX_WIDTH"]

MAX_WIDTH = 4096           # a row lives in one program's registers
ELEMENTS_PER_PROGRAM = 8192


@triton.jit(do_not_specialize=["R", "stride_ob"])
def _norm_rope_kernel(X, W, COS, SIN, OUT, POS, R, HEADS, eps, stride_ob, RING, D: tl.constexpr,
                      HALF: tl.constexpr, BR: tl.constexpr, WEIGHTED: tl.constexpr, INTO: tl.constexpr,
                      ROUNDED: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    cols = tl.arange(0, D)
    x = tl.load(X + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if WEIGHTED:
        y = y * tl.load(W + cols).to(tl.float32)[None, :]
    y = y.to(OUT.dtype.element_ty).to(tl.float32)
    ev, od = tl.split(tl.reshape(y, (BR, D // 2, 2)))
    pair = tl.arange(0, D // 2) - (D // 2 - HALF)
    rope = pair >= 0
    tok = (rows // HEADS).to(tl.int64)
    amask = rmask[:, None] & rope[None, :]
    cs = tl.load(COS + tok[:, None] * HALF + pair[None, :], mask=amask, other=1.0)
    sn = tl.load(SIN + tok[:, None] * HALF + pair[None, :], mask=amask, other=0.0)
    y = tl.reshape(tl.join(*_rotate_pairs(ev, od, cs, sn, rope[None, :], ROUNDED)), (BR, D))
    if INTO:                  # one row a token (HEADS == 1): its ring slot pos % RING
        dst = tok * stride_ob + (tl.load(POS + tok, mask=rmask, other=0) % RING) * D
    else:
        dst = rows.to(tl.int64) * D
    tl.store(OUT + dst[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask=rmask[:, None])


def norm_rope_launch(x, weight, eps: float, cos, sin, out, pos, window: int) -> None:
    """The kernel on checked inputs: ``x [R, D]`` contiguous rows of ``R / heads`` tokens, ``cos``/``sin``
    ``[tokens, half]`` fp32, ``out`` a ``[R, D]`` tensor or (with ``pos``) the ring ``[B', window + N, D]``."""
    R, D = x.shape
    tokens, half = cos.shape
    if R == 0:
        return
    br = max(1, min(triton.next_power_of_2(R), ELEMENTS_PER_PROGRAM // D))
    into = pos is not None
    _norm_rope_kernel[(triton.cdiv(R, br),)](x, x if weight is None else weight, cos, sin, out, pos if into else cos,
                                             R, R // tokens, float(eps), out.stride(0) if into else 0,
                                             max(int(window), 1), D=D, HALF=half, BR=br, WEIGHTED=weight is not None,
                                             INTO=into, ROUNDED=not gpu_common.interpreting(), num_warps=4,
                                             **pdl.launch(x.device))


def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor,
              ring: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None,
              window: int = 0) -> Optional[torch.Tensor]:
    """:func:`kernels.reference.norm_rope.norm_rope` in one launch (module docstring): ``x [B, 1, (H,) D]``
    (bf16/fp16/fp32, ``D`` a power of two up to :data:`MAX_WIDTH`), ``weight [D]`` or None, ``cos, sin [B, 1,
    r/2]``; returned, or written into ``ring [B', window + N, D]`` (rows of ``D`` contiguous channels, ``x``'s
    dtype) at ``pos [B]`` int64 ``% window``. Anything else is refused with the reason."""
    op = "norm_rope"
    gpu_common.check_op_input(op, x, "x")
    D = x.shape[-1] if x.dim() else 0
    if x.dim() not in (3, 4) or x.shape[1] != 1 or D < 2 or D & (D - 1) or D > MAX_WIDTH:
        raise gpu_common.op_refusal(op, f"x {tuple(x.shape)} (needs [B, 1, (H,) D] with D a power of two up to "
                                        f"{MAX_WIDTH})")
    B = x.shape[0]
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape != (B, 1, half) or not 1 <= half <= D // 2:
        raise gpu_common.op_refusal(op, f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} (needs one angle row "
                                        f"[{B}, 1, r/2] per token, r <= {D})")
    if weight is not None and weight.shape != (D,):
        raise gpu_common.op_refusal(op, f"weight {tuple(weight.shape)} (needs [{D}])")
    if ring is not None:
        if (x.dim() != 3 or pos is None or pos.shape != (B,) or pos.dtype != torch.int64 or ring.dim() != 3
                or ring.shape[0] < B or ring.shape[2] != D or ring.stride(2) != 1 or ring.stride(1) != D
                or ring.dtype != x.dtype or not 1 <= window <= ring.shape[1]):
            raise gpu_common.op_refusal(op, f"ring {tuple(ring.shape)} {ring.dtype} at pos "
                                            f"{None if pos is None else tuple(pos.shape)} for x {tuple(x.shape)} "
                                            f"(needs x [B, 1, D], int64 pos [B], a ring [B', window + N, D] of "
                                            f"x's dtype with contiguous rows)")
    c = cos.to(torch.float32).reshape(B, half).contiguous()
    s = sin.to(torch.float32).reshape(B, half).contiguous()
    flat = x.contiguous().view(-1, D)
    w = None if weight is None else weight.contiguous()
    if ring is None:
        out = torch.empty_like(flat)
        norm_rope_launch(flat, w, eps, c, s, out, None, 0)
        return out.view(x.shape)
    norm_rope_launch(flat, w, eps, c, s, ring, pos.contiguous(), window)
    return None
