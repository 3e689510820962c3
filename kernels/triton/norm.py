"""Triton RMS normalisation over the last dim: weightless (``kernels.reference.layers.rms_normalize``, the
attention's per-head query norm) and weighted (``kernels.reference.layers.rms_norm``, every ``RMSNorm`` module):
forward and backward, one pass each.

Why: the attention normalises every query head (``q / rms(q)``, DeepSeek-V4's per-head query norm) in fp32 torch
ops: a cast up, a square, a mean, an rsqrt, a product and a cast down, each a pass over a ``[tokens, heads, 512]``
tensor in fp32, and about as many again in the backward; on the Flash-shaped model that was most of what the
attention glue still cost after the fused RoPE ("attention other" in
bench/results/train-cli-h200-flash-shaped-seq4096-triton-rope.json against
bench/results/train-cli-h200-flash-shaped-seq4096-glue-kernels.json). Here each row is read once and written
once, in fp32 registers, and the backward keeps only the input (in its own dtype, not an fp32 copy).

    y = x * rsqrt(mean(x^2) + eps)
    dx = r * dy - x * r^3 * mean(dy * x),   r = rsqrt(mean(x^2) + eps)

Rows: ``x [R, D]`` contiguous (the entry point flattens the leading dims); the output dtype is the caller's
(``out_dtype``: the reference returns fp32 and the attention casts back to the activation dtype, a pass this
kernel leaves out). The row sums are in a different order than torch's mean: the output is within one rounding
step of the output dtype of the reference's, not bit-identical.

Weighted (``rms_norm``): the ``RMSNorm`` modules ran the same fp32 torch passes plus a product with the weight
and a cast, and as many again backward (8.4 ms of the Flash-shaped training step,
bench/results/train-cli-h200-flash-shaped-seq4096-swiglu.json).

    y = (x * r) * w,   r = rsqrt(mean(x^2) + eps)       (x * r rounded to fp32, then * w, then one cast to x's dtype)
    dx = r * g - x * r^3 * mean(g * x),   g = dy * w
    dw = sum over rows of dy * (x * r)

The forward rounds in the reference's order (``(rms_normalize(x) * w.to(fp32)).to(x.dtype)``), so only the
row sum's order differs: within one rounding step of the output dtype. ``dw``: each program of the backward walks
a strided set of row blocks and keeps its own fp32 partial sum per column; one torch sum over the (at most a few
hundred) partials gives ``dw`` (cast to the weight's dtype), as the SwiGLU kernel's gate-weight gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.triton import pdl

__all__ = ["rms_normalize", "rms_normalize_launch", "rms_normalize_bwd_launch", "rms_norm", "rms_norm_launch",
           "rms_norm_bwd_launch"]

ELEMENTS_PER_PROGRAM = 8192


@triton.jit(do_not_specialize=["R"])
def _rms_fwd_kernel(X, Y, R, eps, D: tl.constexpr, PD: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, PD)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(Y + offs, (x * r[:, None]).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _rms_bwd_kernel(X, DY, DX, R, eps, D: tl.constexpr, PD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, PD)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    c = tl.sum(dy * x, axis=1) / D
    dx = r[:, None] * dy - x * (r * r * r * c)[:, None]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _rms_norm_fwd_kernel(X, W, Y, R, eps, D: tl.constexpr, PD: tl.constexpr, BR: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, PD)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * r[:, None]                                  # rounded to fp32 first, as the reference
    tl.store(Y + offs, (y * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "nblocks"])
def _rms_norm_bwd_kernel(X, W, DY, DX, DWP, R, nblocks, programs, eps, D: tl.constexpr, PD: tl.constexpr,
                         BR: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, PD)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([PD], dtype=tl.float32)
    b = pid
    while b < nblocks:                    # row blocks pid, pid + programs, ...: few partial sums of dw
        rows = b * BR + tl.arange(0, BR)
        mask = (rows < R)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        dw += tl.sum(dy * (x * r[:, None]), axis=0)
        g = dy * w[None, :]
        c = tl.sum(g * x, axis=1) / D
        dx = r[:, None] * g - x * (r * r * r * c)[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        b += programs
    tl.store(DWP + pid.to(tl.int64) * D + cols, dw, mask=cmask)


def _grid(R: int, D: int):
    pd = triton.next_power_of_2(D)
    br = max(1, min(triton.next_power_of_2(R), ELEMENTS_PER_PROGRAM // pd))
    return (triton.cdiv(R, br),), pd, br


def rms_normalize_launch(x: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``dsv4_triton::rms_normalize`` op's launcher: ``x [R, D]`` contiguous -> ``[R, D]`` in ``out_dtype``."""
    R, D = x.shape
    y = torch.empty((R, D), dtype=out_dtype, device=x.device)
    if R:
        grid, pd, br = _grid(R, D)
        _rms_fwd_kernel[grid](x, y, R, float(eps), D=D, PD=pd, BR=br, num_warps=4, **pdl.launch(x.device))
    return y


def rms_normalize_bwd_launch(x: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """``dx [R, D]`` (``x``'s dtype) of :func:`rms_normalize_launch` for the upstream gradient ``dy [R, D]``."""
    R, D = x.shape
    dx = torch.empty_like(x)
    if R:
        grid, pd, br = _grid(R, D)
        _rms_bwd_kernel[grid](x, dy, dx, R, float(eps), D=D, PD=pd, BR=br, num_warps=4)
    return dx


@gpu_ops.traceable
def rms_normalize(x: torch.Tensor, eps: float, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`kernels.reference.layers.rms_normalize` in one kernel each way: ``x [..., D]`` (CUDA, bf16/fp16/fp32)
    -> the normalised rows in ``out_dtype`` (default fp32, the reference's compute dtype). Differentiable in ``x``.
    Anything else is refused with the reason."""
    gpu_common.check_op_input("rms_normalize", x, "x")
    out = torch.float32 if out_dtype is None else out_dtype
    if out not in (torch.bfloat16, torch.float16, torch.float32) or x.dim() < 1 or x.shape[-1] == 0:
        raise gpu_common.op_refusal("rms_normalize", f"x {tuple(x.shape)} to {out} (needs [..., D] with D > 0, a "
                                                     f"bf16/fp16/fp32 output)")
    flat = x.contiguous().view(-1, x.shape[-1])
    return gpu_ops.TRITON.rms_normalize(flat, float(eps), out).view(x.shape)


def _programs(x: torch.Tensor, nblocks: int) -> int:
    """Programs of the weighted backward: enough to fill the GPU (4 per SM), never more than there are blocks."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    return max(1, min(nblocks, 4 * sms))


def rms_norm_launch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``dsv4_triton::rms_norm`` op's launcher: ``x [R, D]``, ``w [D]`` contiguous -> ``[R, D]`` in x's dtype."""
    R, D = x.shape
    y = torch.empty_like(x)
    if R:
        grid, pd, br = _grid(R, D)
        _rms_norm_fwd_kernel[grid](x, w, y, R, float(eps), D=D, PD=pd, BR=br, num_warps=4, **pdl.launch(x.device))
    return y


def rms_norm_bwd_launch(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float):
    """``(dx [R, D] in x's dtype, dw [D] in w's dtype)`` of :func:`rms_norm_launch` for the upstream ``dy``."""
    R, D = x.shape
    dx = torch.empty_like(x)
    if not R:
        return dx, torch.zeros_like(w)
    (nblocks,), pd, br = _grid(R, D)
    programs = _programs(x, nblocks)
    partial = torch.empty((programs, D), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](x, w, dy, dx, partial, R, nblocks, programs, float(eps), D=D, PD=pd,
                                      BR=br, num_warps=8 if pd >= 4096 else 4)
    return dx, partial.sum(0).to(w.dtype)


@gpu_ops.traceable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`kernels.reference.layers.rms_norm` in one kernel each way: ``x [..., D]`` (CUDA, bf16/fp16/fp32),
    ``weight [D]`` (bf16/fp16/fp32: the model's dtype, or fp32 for an fp32-kept weight) -> ``[..., D]`` in x's
    dtype, within one rounding of it from the reference (same rounding order; the row sums' order differs).
    Differentiable in ``x`` and ``weight``. A non-contiguous ``x`` is copied to rows first (as the other
    elementwise entry points do: the same result, one more pass). Anything else (fp64, a weight that is not
    ``[D]``, ``D == 0``) is refused with the reason."""
    gpu_common.check_op_input("rms_norm", x, "x")
    gpu_common.check_op_input("rms_norm", weight, "weight")
    if x.dim() < 1 or x.shape[-1] == 0 or weight.shape != x.shape[-1:]:
        raise gpu_common.op_refusal("rms_norm", f"x {tuple(x.shape)} with weight {tuple(weight.shape)} (needs "
                                                f"x [..., D] with D > 0 and weight [D])")
    flat = x.contiguous().view(-1, x.shape[-1])
    return gpu_ops.TRITON.rms_norm(flat, weight.contiguous(), float(eps)).view(x.shape)
