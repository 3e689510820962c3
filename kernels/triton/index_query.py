"""Triton: the Lightning Indexer's decode query after its GEMM in one kernel (``index_query``; its torch contract is
``kernels.reference.index_query.index_query``).

Why: a CSA layer's decode step rotated the indexer's query heads (``apply_rope``), cast them to fp32, ran the
Hadamard transform and cast the result to the dtype the scores kernel takes: four launches a CSA layer (V4-Flash
has 21) for a few hundred KB. Here each head's row is read once: the rotation of its last ``2 * half`` channels
with each product rounded on its own and the result rounded to the row's dtype (``kernels/triton/rope.py``'s
bits), then the transform's butterflies in fp32 (``kernels/triton/hadamard.py``'s stages, unrounded as fp32's
are), the product with ``n^-1/2``, and one cast. No gradient (a decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import pdl
from kernels.triton.compress import _hadamard_row
from kernels.triton.rope import _rotate_pairs

__all__ = ["index_query", "index_query_launch", "MAX_WIDTH"]

MAX_WIDTH = 4096
ELEMENTS_PER_PROGRAM = 4096


@triton.jit(do_not_specialize=["R"])
def _index_query_kernel(Q, COS, SIN, OUT, R, HEADS, scale, D: tl.constexpr, LOG_D: tl.constexpr,
                        HALF: tl.constexpr, ROUNDED: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``r``: head row ``r`` of token ``r // HEADS``."""
    pdl.wait_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    x = tl.load(Q + r * D + cols).to(tl.float32)
    ev, od = tl.split(tl.reshape(x, (D // 2, 2)))
    pair = tl.arange(0, D // 2) - (D // 2 - HALF)
    rope = pair >= 0
    tok = r // HEADS
    cs = tl.load(COS + tok * HALF + pair, mask=rope, other=1.0)
    sn = tl.load(SIN + tok * HALF + pair, mask=rope, other=0.0)
    x = tl.reshape(tl.join(*_rotate_pairs(ev, od, cs, sn, rope, ROUNDED)), (D,))
    x = x.to(Q.dtype.element_ty).to(tl.float32)          # the rotation's output is a tensor of q's dtype
    y = _hadamard_row(x, D, LOG_D, False, tl.float32) * scale
    tl.store(OUT + r * D + cols, y.to(OUT.dtype.element_ty))


def index_query_launch(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel on checked inputs: ``q [R, D]`` contiguous head rows of ``tokens = cos.shape[0]`` tokens,
    ``cos``/``sin`` ``[tokens, half]`` fp32 -> ``[R, D]`` in ``out_dtype``."""
    R, D = q.shape
    out = torch.empty(R, D, dtype=out_dtype, device=q.device)
    if R:
        _index_query_kernel[(R,)](q, cos, sin, out, R, R // cos.shape[0], float(D ** -0.5), D=D,
                                  LOG_D=D.bit_length() - 1, HALF=cos.shape[1], ROUNDED=not gpu_common.interpreting(),
                                  num_warps=1 if D <= 256 else 4, **pdl.launch(q.device))
    return out


def index_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`kernels.reference.index_query.index_query` in one launch (module docstring): ``q [B, 1, H, D]``
    (bf16/fp16, ``D`` a power of two up to :data:`MAX_WIDTH`), ``cos, sin [B, 1, r/2]`` -> ``[B, 1, H, D]`` in
    ``out_dtype`` (bf16/fp16/fp32). Anything else is refused with the reason."""
    op = "index_query"
    gpu_common.check_op_input(op, q, "q", dtypes=(torch.bfloat16, torch.float16))
    D = q.shape[-1] if q.dim() else 0
    if q.dim() != 4 or q.shape[1] != 1 or D < 2 or D & (D - 1) or D > MAX_WIDTH:
        raise gpu_common.op_refusal(op, f"q {tuple(q.shape)} (needs [B, 1, H, D] with D a power of two up to "
                                        f"{MAX_WIDTH})")
    B, half = q.shape[0], cos.shape[-1]
    if cos.shape != sin.shape or cos.shape != (B, 1, half) or not 1 <= half <= D // 2:
        raise gpu_common.op_refusal(op, f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} (needs one angle row "
                                        f"[{B}, 1, r/2] per token, r <= {D})")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise gpu_common.op_refusal(op, f"out_dtype {out_dtype} (the kernel writes bf16, fp16 or fp32)")
    c = cos.to(torch.float32).reshape(B, half).contiguous()
    s = sin.to(torch.float32).reshape(B, half).contiguous()
    return index_query_launch(q.contiguous().view(-1, D), c, s, out_dtype).view(q.shape)
