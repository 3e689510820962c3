"""Triton Sinkhorn normalisation of the mHC residual-mixing matrices (``kernels.reference.mhc.sinkhorn``).

Each token owns one ``n x n`` matrix (hc_mult 4: 16 numbers), so the whole loop of ``iters`` row/column
normalisations runs in registers on a ``[BT, NP, NP]`` tile (``BT`` tokens, ``NP`` = n padded to a power of
two; padded entries are held at exactly 0, which every normalisation keeps at 0). The reference op runs the
same loop as ``4 * iters`` separate elementwise kernels over the whole ``[T, n, n]`` tensor, forward and again
in the backward.

Forward (``m[j, k]``: row ``j`` = input stream, column ``k`` = output stream)::

    m = softmax_k(c) + eps;  m = m / (sum_j m + eps)                 step 0: column
    repeat iters - 1 times:  m = m / (sum_k m + eps);  m = m / (sum_j m + eps)

so the normalisation steps are ``s = 0 .. 2*iters - 2``, columns for even ``s`` and rows for odd ``s``.

Backward without saved iterates: the gradient of ``y = m / (sum m + eps)`` is ``(dy - sum(dy * y)) / (sum m +
eps)``, which needs only the step's input ``m``. The backward walks the steps from the last to the first and
recomputes each step's input from the softmax (``O(iters^2)`` normalisations of a register tile, no memory
traffic and nothing saved for the backward but the logits).

:func:`sinkhorn_fwd_tile` / :func:`sinkhorn_bwd_tile` are ``triton.jit`` helpers that ``kernels.triton.mhc``
calls inside its fused ``hc_pre`` kernels; :func:`sinkhorn` is the stand-alone op of the op table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_ops
from kernels.triton import mhc_checks

__all__ = ["sinkhorn", "sinkhorn_fwd", "sinkhorn_bwd", "sinkhorn_fwd_tile", "sinkhorn_bwd_tile", "SINKHORN_BT"]

SINKHORN_BT = 32  # tokens per program of the stand-alone kernels


@triton.jit
def _softmax_eps(c, valid, eps):
    """``(p, m0)``: the row softmax ``p`` of the valid entries and ``m0 = p + eps`` (0 outside ``valid``)."""
    c = tl.where(valid, c, -1e30)  # finite, so a fully padded row stays finite too
    e = tl.where(valid, tl.exp(c - tl.max(c, 2)[:, :, None]), 0.0)
    p = e / tl.maximum(tl.sum(e, 2), 1e-30)[:, :, None]  # a real row sums to >= 1; a padded one to 0
    return p, tl.where(valid, p + eps, 0.0)


@triton.jit
def _normalize(m, s, eps):
    """Step ``s`` of the loop: column normalisation (sum over rows, axis 1) for even ``s``, row otherwise."""
    if s % 2 == 0:
        m = m / (tl.sum(m, 1)[:, None, :] + eps)
    else:
        m = m / (tl.sum(m, 2)[:, :, None] + eps)
    return m


@triton.jit
def sinkhorn_fwd_tile(c, valid, iters, eps):
    """``[BT, NP, NP]`` fp32 logits -> the near doubly-stochastic ``M`` (0 outside ``valid``)."""
    _, m = _softmax_eps(c, valid, eps)
    for s in range(0, 2 * iters - 1):
        m = _normalize(m, s, eps)
    return m


@triton.jit
def sinkhorn_bwd_tile(c, g, valid, iters, eps):
    """The gradient w.r.t. the logits ``c`` of ``sum(g * sinkhorn(c))``, by recomputation (module docstring)."""
    p, m0 = _softmax_eps(c, valid, eps)
    g = tl.where(valid, g, 0.0)
    n_steps = 2 * iters - 1
    for back in range(0, n_steps):
        step = n_steps - 1 - back
        m = m0
        for s in range(0, step):
            m = _normalize(m, s, eps)
        if step % 2 == 0:  # (the two branches' sums have different shapes, hence two names)
            rc = tl.sum(m, 1)[:, None, :] + eps
            g = (g - tl.sum(g * (m / rc), 1)[:, None, :]) / rc
        else:
            rr = tl.sum(m, 2)[:, :, None] + eps
            g = (g - tl.sum(g * (m / rr), 2)[:, :, None]) / rr
        g = tl.where(valid, g, 0.0)  # padded entries are constants: a gradient there would grow by 1/eps a step
    dc = p * (g - tl.sum(g * p, 2)[:, :, None])
    return tl.where(valid, dc, 0.0)


@triton.jit
def _tile_offsets(pid, T, n, BT: tl.constexpr, NP: tl.constexpr):
    """Offsets ``t*n*n + j*n + k`` of a ``[BT, NP, NP]`` tile of a contiguous ``[T, n, n]`` tensor and its mask."""
    t = pid * BT + tl.arange(0, BT)
    j = tl.arange(0, NP)
    offs = t.to(tl.int64)[:, None, None] * (n * n) + j[None, :, None] * n + j[None, None, :]
    inside = (j[None, :, None] < n) & (j[None, None, :] < n)
    return offs, inside, (t < T)[:, None, None] & inside


@triton.jit
def _sinkhorn_fwd_kernel(C, OUT, T, n, iters, eps, BT: tl.constexpr, NP: tl.constexpr):
    offs, inside, mask = _tile_offsets(tl.program_id(0), T, n, BT, NP)
    c = tl.load(C + offs, mask=mask, other=0.0).to(tl.float32)
    m = sinkhorn_fwd_tile(c, inside, iters, eps)
    tl.store(OUT + offs, m.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(C, G, DC, T, n, iters, eps, BT: tl.constexpr, NP: tl.constexpr):
    offs, inside, mask = _tile_offsets(tl.program_id(0), T, n, BT, NP)
    c = tl.load(C + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    dc = sinkhorn_bwd_tile(c, g, inside, iters, eps)
    tl.store(DC + offs, dc.to(DC.dtype.element_ty), mask=mask)


def sinkhorn_fwd(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Launcher of the ``dsv4_triton::sinkhorn`` custom op: ``logits [T, n, n]`` -> ``M [T, n, n]`` in the
    logits' dtype, fp32 inside."""
    logits = logits.contiguous()
    T, n, _ = logits.shape
    out = torch.empty_like(logits)
    if T:
        _sinkhorn_fwd_kernel[(triton.cdiv(T, SINKHORN_BT),)](
            logits, out, T, n, iters, eps, BT=SINKHORN_BT, NP=mhc_checks.padded(n), num_warps=4)
    return out


def sinkhorn_bwd(logits: torch.Tensor, g: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Launcher of ``dsv4_triton::sinkhorn_bwd``: the gradient w.r.t. ``logits [T, n, n]`` (their dtype)."""
    logits = logits.contiguous()
    T, n, _ = logits.shape
    dc = torch.empty_like(logits)
    if T:
        _sinkhorn_bwd_kernel[(triton.cdiv(T, SINKHORN_BT),)](
            logits, g.contiguous(), dc, T, n, iters, eps, BT=SINKHORN_BT, NP=mhc_checks.padded(n), num_warps=4)
    return dc


@gpu_ops.traceable
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Same contract as ``kernels.reference.mhc.sinkhorn``: ``[..., n, n]`` logits -> ``M`` of the same shape
    and dtype (bf16/fp16/fp32 inputs, fp32 math); other inputs are refused with the reason. Runs the
    ``dsv4_triton::sinkhorn`` custom op (``kernels.gpu_ops``; backward ``sinkhorn_bwd``)."""
    mhc_checks.check_sinkhorn(logits, iters)
    n = logits.shape[-1]
    out = gpu_ops.TRITON.sinkhorn(logits.reshape(-1, n, n), int(iters), float(eps))
    return out.view(logits.shape)
