"""Triton clamped SwiGLU of the routed experts, times each row's gate weight: forward and backward in one pass
each (``kernels.reference.moe.weighted_swiglu``).

Why: between the experts' two grouped GEMMs the MoE ran a cast of ``[gate | up]`` to fp32, two clamps, SiLU,
two products and a cast back, each a pass over every routed row, and about twice as many passes backward; on
the Flash-shaped model that was 16.6 ms of a 222 ms training step
(bench/results/train-cli-h200-flash-shaped-seq4096-glue-kernels.json). Here each element of ``h`` is read once
and ``a`` written once; the backward reads ``h``, the gate weights and ``da`` once and writes ``dh`` and
per-block partial sums of the gate weights' gradient.

    g = min(gate, limit), u = clamp(up, -limit, limit)     (no clamp when limit <= 0)
    a = silu(g) * u * w                                      fp32 math, a in the caller's dtype
    dg = da * u * w * silu'(g) where gate <= limit, du = da * silu(g) * w where |up| <= limit,
    dw = sum over the row of da * silu(g) * u

SiLU is ``g * sigmoid(g)`` here and ``g / (1 + exp(-g))`` in torch: within an fp32 rounding step, so the
output is within one rounding of the output dtype of the reference's, not bit-identical.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.triton import pdl

__all__ = ["weighted_swiglu", "weighted_swiglu_launch", "weighted_swiglu_bwd_launch", "swiglu_tile"]

BR, BF = 16, 256           # rows x columns of one program


@triton.jit
def _clamped(g0, u0, limit, HAS_LIMIT: tl.constexpr):
    """``(g, u)``: the gate clamped from above and the up from both sides at ``limit`` (as given without
    ``HAS_LIMIT``), NaN kept as torch's clamp keeps it."""
    g, u = g0, u0
    if HAS_LIMIT:
        g = tl.minimum(g0, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u0, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    return g, u


@triton.jit
def swiglu_tile(g0, u0, w, limit, HAS_LIMIT: tl.constexpr):
    """fp32 ``silu(min(g0, limit)) * clamp(u0, -limit, limit) * w`` of fp32 gate and up tiles ``g0``, ``u0`` and
    the rows' fp32 weights ``w`` (``[rows, 1]``), in this order of products. The one copy of the forward's math:
    :func:`_swiglu_fwd_kernel` stores it, and the second expert GEMM of the eager decode step computes its A
    tiles with it (``kernels.triton.experts``, ``SWIGLU``), so that the fused step keeps every bit of the
    activation's output followed by the GEMM."""
    g, u = _clamped(g0, u0, limit, HAS_LIMIT)
    return g * tl.sigmoid(g) * u * w


@triton.jit
def _load_clamped(H, rows, cols, F, mask, limit, HAS_LIMIT: tl.constexpr):
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g0 = tl.load(H + base, mask=mask, other=0.0).to(tl.float32)
    u0 = tl.load(H + base + F, mask=mask, other=0.0).to(tl.float32)
    g, u = _clamped(g0, u0, limit, HAS_LIMIT)
    return g0, u0, g, u


@triton.jit(do_not_specialize=["N"])
def _swiglu_fwd_kernel(H, W, A, N, F, limit, HAS_LIMIT: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    rmask = rows < N
    mask = rmask[:, None] & (cols < F)[None, :]
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g0 = tl.load(H + base, mask=mask, other=0.0).to(tl.float32)
    u0 = tl.load(H + base + F, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + rows, mask=rmask, other=0.0).to(tl.float32)
    a = swiglu_tile(g0, u0, w[:, None], limit, HAS_LIMIT)
    tl.store(A + rows.to(tl.int64)[:, None] * F + cols[None, :], a.to(A.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _swiglu_bwd_kernel(H, W, DA, DH, DWP, N, F, limit, HAS_LIMIT: tl.constexpr, BR: tl.constexpr,
                       BF: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    rmask = rows < N
    mask = rmask[:, None] & (cols < F)[None, :]
    g0, u0, g, u = _load_clamped(H, rows, cols, F, mask, limit, HAS_LIMIT)
    w = tl.load(W + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    da = tl.load(DA + rows.to(tl.int64)[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = da * u * w * (sig * (1.0 + g * (1.0 - sig)))
    du = da * silu * w
    if HAS_LIMIT:      # torch.clamp's gradient: passes where the input lies within the bounds, ends included
        dg = tl.where(g0 <= limit, dg, 0.0)
        du = tl.where((u0 >= -limit) & (u0 <= limit), du, 0.0)
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    tl.store(DH + base, dg.to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + base + F, du.to(DH.dtype.element_ty), mask=mask)
    dw = tl.sum(tl.where(mask, da * silu * u, 0.0), axis=1)
    tl.store(DWP + tl.program_id(1).to(tl.int64) * N + rows, dw, mask=rmask)


def _grid(N: int, F: int):
    return (triton.cdiv(N, BR), triton.cdiv(F, BF))


def weighted_swiglu_launch(h: torch.Tensor, w: torch.Tensor, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``dsv4_triton::weighted_swiglu`` op's launcher: ``h [N, 2F]``, ``w [N]`` contiguous -> ``a [N, F]``."""
    N, F = h.shape[0], h.shape[1] // 2
    a = torch.empty((N, F), dtype=out_dtype, device=h.device)
    if N and F:
        _swiglu_fwd_kernel[_grid(N, F)](h, w, a, N, F, float(limit), HAS_LIMIT=limit > 0, BR=BR, BF=BF,
                                        num_warps=4, **pdl.launch(h.device))
    return a


def weighted_swiglu_bwd_launch(h: torch.Tensor, w: torch.Tensor, da: torch.Tensor, limit: float):
    """``(dh [N, 2F] in h's dtype, dw [N] in w's dtype)`` for the upstream gradient ``da [N, F]``."""
    N, F = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    grid = _grid(N, F)
    partial = torch.empty((grid[1], N), dtype=torch.float32, device=h.device)
    if N and F:
        _swiglu_bwd_kernel[grid](h, w, da, dh, partial, N, F, float(limit), HAS_LIMIT=limit > 0, BR=BR, BF=BF,
                                 num_warps=4)
    return dh, partial.sum(0).to(w.dtype)


@gpu_ops.traceable
def weighted_swiglu(h: torch.Tensor, w: torch.Tensor, limit: float,
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """:func:`kernels.reference.moe.weighted_swiglu` in one kernel each way: ``h = [gate | up]`` ``[N, 2F]``
    (CUDA, bf16/fp16/fp32), ``w [N]`` (fp32 or h's dtype) -> ``[N, F]`` in ``out_dtype`` (default fp32, the
    reference's compute dtype). Differentiable in ``h`` and ``w``. Anything else is refused with the reason."""
    gpu_common.check_op_input("weighted_swiglu", h, "h")
    gpu_common.check_op_input("weighted_swiglu", w, "w")
    out = torch.float32 if out_dtype is None else out_dtype
    if out not in (torch.bfloat16, torch.float16, torch.float32):
        raise gpu_common.op_refusal("weighted_swiglu", f"an output of {out} (the kernel writes bf16, fp16 or fp32)")
    if h.dim() != 2 or h.shape[1] % 2 or w.shape != h.shape[:1]:
        raise gpu_common.op_refusal("weighted_swiglu", f"h {tuple(h.shape)} with w {tuple(w.shape)} (needs "
                                                       f"h [N, 2F] and w [N])")
    return gpu_ops.TRITON.weighted_swiglu(h.contiguous(), w.contiguous(), float(limit), out)
