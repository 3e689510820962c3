"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4; all coefficient math in fp32.

Per token, streams ``X [n, d]`` flattened stream-major to ``xhat [n*d]``::

    rho = rsqrt(mean(xhat^2) + norm_eps);  m = rho * (fn @ xhat)           (fn [(2+n)n, n d])
    pre_j  = sigmoid(scale[0] m[j] + base[j]) + hc_eps
    post_j = 2 sigmoid(scale[1] m[n+j] + base[n+j])
    C[j,k] = scale[2] m[2n + j n + k] + base[2n + j n + k];  M = sinkhorn(C)
    u = sum_j pre_j X_j  -> sublayer F -> f
    X'_k = post_k f + sum_j M[j,k] X_j          (TRANSPOSED residual mix: X' = post (x) f + M^T X)

Final collapse: ``y = sum_j (sigmoid(scale * rho * (fn_head @ xhat) + base) + hc_eps)_j X_j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import rms_norm, rms_normalize

__all__ = ["sinkhorn", "hc_split", "hc_pre", "hc_pre_norm", "hc_post", "hc_head", "hc_head_norm"]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` logits -> near doubly-stochastic ``M``: row softmax + eps, column
    normalisation, then ``iters - 1`` rounds of (row, column) normalisation."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
             sinkhorn_iters: int, hc_eps: float):
    """``mixes [..., (2+n)n]`` (already multiplied by rho) -> ``pre [..., n]``, ``post [..., n]``,
    ``comb [..., n, n]`` (row j = input stream j, column k = output stream k)."""
    scale = scale.to(mixes.dtype)
    base = base.to(mixes.dtype)
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    c = mixes[..., 2 * n:] * scale[2] + base[2 * n:]
    comb = sinkhorn(c.unflatten(-1, (n, n)), sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """``x [B,S,n,d]`` -> ``(u [B,S,d] in x.dtype, post [B,S,n], comb [B,S,n,n])`` (fp32 coefficients)."""
    n = x.shape[-2]
    flat = rms_normalize(x.flatten(-2), norm_eps)  # rho * xhat (fp32)
    mixes = F.linear(flat, fn.to(flat.dtype))
    pre, post, comb = hc_split(mixes, scale, base, n, sinkhorn_iters, hc_eps)
    u = (pre.unsqueeze(-1) * x.to(pre.dtype)).sum(dim=-2)
    return u.to(x.dtype), post, comb


def hc_pre_norm(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                hc_eps: float, sinkhorn_iters: int, weight: torch.Tensor, eps: float):
    """:func:`hc_pre` and the sublayer's weighted RMS norm of its ``u`` (``weight [d]``, ``eps``):
    ``(rms_norm(u), post, comb)``. The contract of a GPU backend's one-launch decode op (the triton backend's
    ``kernels/triton/mhc_decode.py``), which the eager static decode step calls where the run's table has it
    (``kernels.reference.slots.decode_layer``)."""
    u, post, comb = hc_pre(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)
    return rms_norm(u, weight, eps), post, comb


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_k = post_k f + sum_j comb[j,k] X_j``; ``f [B,S,d]``, ``x [B,S,n,d]`` -> ``[B,S,n,d]`` (x.dtype)."""
    ct = post.dtype
    mixed = torch.einsum("bsjk,bsjd->bskd", comb, x.to(ct))
    return (post.unsqueeze(-1) * f.to(ct).unsqueeze(-2) + mixed).to(x.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Collapse ``x [B,S,n,d]`` to ``[B,S,d]`` with ``pre = sigmoid(scale * m + base) + hc_eps``."""
    flat = rms_normalize(x.flatten(-2), norm_eps)
    mixes = F.linear(flat, fn.to(flat.dtype))
    pre = torch.sigmoid(mixes * scale.to(flat.dtype) + base.to(flat.dtype)) + hc_eps
    return (pre.unsqueeze(-1) * x.to(pre.dtype)).sum(dim=-2).to(x.dtype)


def hc_head_norm(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                 hc_eps: float, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`hc_head` and the model's final weighted RMS norm (``weight [d]``, ``eps``): the contract of a GPU
    backend's one-launch decode op (``kernels/triton/mhc_decode.py``), which the eager static decode step's head
    calls where the run's table has it (``kernels.reference.slots.decode_head``)."""
    return rms_norm(hc_head(x, fn, scale, base, norm_eps, hc_eps), weight, eps)
