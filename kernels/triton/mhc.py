"""Fused Triton kernels of the mHC hyper-connection ops, forward and backward (``kernels.reference.mhc``).

Per token the streams ``X [n, d]`` (bf16/fp16) are flattened to ``x [K = n*d]``; the coefficient math is fp32::

    rho = rsqrt(mean(x^2) + norm_eps);  mix = rho * (x @ fn^T)                  fn [M, K] fp32
    a   = mix * svec + base   (svec: scale[0] on the pre rows, scale[1] on post, scale[2] on comb)
    pre = sigmoid(a_pre) + hc_eps;  post = 2 sigmoid(a_post);  comb = sinkhorn(a_comb)
    u   = sum_j pre_j X_j                                                        (hc_pre: M = (2+n)n)
    y   = sum_j pre_j X_j with one scale                                        (hc_head: M = n)
    X'_k = post_k f + sum_j comb[j, k] X_j                                       (hc_post)

Why fused: in the reference these are dozens of elementwise kernels per site over ``[T, n, d]`` plus an fp32
copy of the streams (the Flash-shaped step's profile: elementwise multiplies and copies took over a quarter of
the GPU time), and each of the ``iters`` Sinkhorn rounds is a few kernels of its own, forward and backward.
Here ``hc_pre`` is two kernels (a mixing GEMM that also reduces ``sum x^2``, then one kernel that does the
sigmoids, the whole Sinkhorn loop in registers and ``u``), its backward four (coefficient gradients, ``dx``,
``dfn``, then a few small torch reductions over ``[T, M]`` for ``dscale``/``dbase``); ``hc_post`` is one kernel
each way. The streams are read as bf16 and never copied to fp32. A decode step's few tokens split the mixing GEMM
over ``K`` (its partials summed by one more kernel). A post, the next pre and its norm in two launches
(``hc_post_pre``) was built and taken out: in a decode step on an H100 it took about 34 us a site where these
kernels take about 17 (``bench/results/rollout-h100-flash-shaped-triton-eager-hc-post-pre.json``,
``bench/results/rollout-h100-flash-shaped-triton-profile-linear-group.json``; the code is in the history).

The GEMMs with fp32 operands (``x @ fn^T``, ``dz @ fn``, ``dz^T @ x``) use ``tf32x3`` (three TF32 products,
about fp32 accuracy on the tensor cores), not plain TF32: the reference computes them in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_ops
from kernels.triton import mhc_checks
from kernels.triton import pdl
from kernels.triton.experts import pairs_sum
from kernels.triton.sinkhorn import sinkhorn, sinkhorn_bwd_tile, sinkhorn_fwd_tile

__all__ = ["sinkhorn", "hc_pre", "hc_post", "hc_head", "hc_pre_fwd", "hc_pre_bwd", "hc_head_fwd", "hc_head_bwd",
           "hc_post_fwd", "hc_post_bwd", "combine_post_fwd", "MHC_CONFIG"]

# Launch settings (the ``config`` argument of the launchers overrides them):
#   mix / dfn: BT tokens x BK columns of K per step (mix: split over K below mix_programs programs);
#   coef: BT tokens, BD of d per step (d split over the grid below coef_programs programs);
#   dx: BT x BK tiles; post / post_bwd: BT tokens x BD.
# Chosen so that ptxas (sm_90a, Triton 3.6) reports no register spills for hc_mult 4. dx and post_bwd were then
# tuned on an H200 at the Flash shape (python -m bench.kernels_mhc_sweep, bench/results/kernels-mhc-sweep-h200.json):
# post_bwd's BD 64 -> 128 took a call from 910 to 170 us, dx's BT 32 -> 64 took hc_pre's backward from 606 to 583 us.
MHC_CONFIG = dict(mix_BT=16, mix_BK=64, mix_warps=4, mix_stages=3, mix_programs=256,
                  coef_BT=16, coef_BD=64, coef_warps=4, coef_programs=256,
                  dx_BT=64, dx_BK=64, dx_warps=4,
                  dfn_BT=64, dfn_BK=64, dfn_warps=4, dfn_stages=3,
                  post_BT=8, post_BD=128, post_warps=4,
                  post_bwd_BT=8, post_bwd_BD=128, post_bwd_warps=4)
PRECISION = "tf32x3"
FINISH_TILE = 4096     # fp32 partials one program of the split mixing GEMM's sum loads at once


_mp = gpu_ops.mix_width  # the mixing GEMM's padded width (the custom ops' fake implementations use it too)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mix_kernel(X, FN, MIX, RHO, T, K, M, norm_eps,
                BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                PDL: tl.constexpr = False):
    """``MIX[t, :M] = rho_t * (x_t @ fn^T)`` (fp32, padded to MP columns of zeros) and ``RHO[t]``."""
    pdl.wait_prior(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    acc, ss = _mix_columns(X, FN, t64, tmask, m, K, M, 0, K, BT, BK, MP, PREC, STAGES)
    rho = tl.rsqrt(ss / K + norm_eps)
    tl.store(MIX + t64[:, None] * MP + m[None, :], acc * rho[:, None], mask=tmask[:, None])
    tl.store(RHO + t, rho, mask=tmask)


@triton.jit
def _mix_part_kernel(X, FN, PART, SSP, T, K, M, KPER,
                     BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, PREC: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Split-K :func:`_mix_kernel` for few tokens (a decode step): program ``(i, s)`` sums columns
    ``[s * KPER, (s + 1) * KPER)`` into ``PART[s, t, :]`` and their squares into ``SSP[s, t]``."""
    pdl.wait_prior(PDL)
    mix_partial(X, FN, PART, SSP, T, K, M, KPER, tl.program_id(0) * BT, tl.program_id(1), BT, BK, MP, PREC, STAGES)


@triton.jit
def mix_partial(X, FN, PART, SSP, T, K, M, KPER, t0, s, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
                PREC: tl.constexpr, STAGES: tl.constexpr):
    """Tokens ``t0 .. t0 + BT`` of split ``s`` of the mixing GEMM (:func:`_mix_part_kernel`'s work; also the first
    phase of ``kernels.triton.mhc_decode``'s one-launch kernel)."""
    t = t0 + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    acc, ss = _mix_columns(X, FN, t64, tmask, m, K, M, s * KPER, s * KPER + KPER, BT, BK, MP, PREC, STAGES)
    base = s.to(tl.int64) * T
    tl.store(PART + (base + t64)[:, None] * MP + m[None, :], acc, mask=tmask[:, None])
    tl.store(SSP + base + t64, ss, mask=tmask)


@triton.jit
def _mix_columns(X, FN, t64, tmask, m, K, M, k_lo, k_hi, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
                 PREC: tl.constexpr, STAGES: tl.constexpr):
    """``(x_t[k_lo:k_hi] @ fn[:, k_lo:k_hi]^T [BT, MP], sum of x_t[k_lo:k_hi]^2 [BT])`` in fp32 for tokens ``t64``
    (``m``: the ``MP`` padded columns, ``M`` of them real): the loop of the one-pass and the split mixing GEMM."""
    mmask = m < M
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        x = tl.load(X + t64[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        w = tl.load(FN + m.to(tl.int64)[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        ss += tl.sum(x * x, 1)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    return acc, ss


@triton.jit
def mix_sums(PART, SSP, T, K, SPLIT, norm_eps, t, BT: tl.constexpr, MP: tl.constexpr, SB: tl.constexpr):
    """``(mix [BT, MP], rho [BT])`` of tokens ``t`` (:func:`_mix_kernel`'s values) from the ``SPLIT`` partials of
    :func:`mix_partial`, ``SB`` a load, summed in a fixed order (the same sums on every call). The loads skip L1
    (``.cg``): the partials were written by other programs (``kernels.triton.mhc_decode``'s last one reads them in
    the launch that wrote them)."""
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    sb = tl.arange(0, SB)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for s0 in range(0, SPLIT, SB):
        s = s0 + sb
        st = (s.to(tl.int64) * T)[:, None] + t64[None, :]                       # [SB, BT] rows of the partials
        smask = (s < SPLIT)[:, None] & tmask[None, :]
        acc += tl.sum(tl.load(PART + st[:, :, None] * MP + m[None, None, :], mask=smask[:, :, None], other=0.0,
                              cache_modifier=".cg"), 0)
        ss += tl.sum(tl.load(SSP + st, mask=smask, other=0.0, cache_modifier=".cg"), 0)
    rho = tl.rsqrt(ss / K + norm_eps)
    return acc * rho[:, None], rho


@triton.jit
def _mix_finish_kernel(PART, SSP, MIX, RHO, T, K, SPLIT, norm_eps, BT: tl.constexpr, MP: tl.constexpr,
                       SB: tl.constexpr, PDL: tl.constexpr = False):
    """The sum of :func:`_mix_part_kernel`'s partials: ``MIX``, ``RHO`` as :func:`_mix_kernel` writes them. ``SB``
    partials a load: one partial a loop step was 64 dependent loads of a decode step's token, 8.6 us a call."""
    pdl.wait_prior(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    mix, rho = mix_sums(PART, SSP, T, K, SPLIT, norm_eps, t, BT, MP, SB)
    tl.store(MIX + t64[:, None] * MP + m[None, :], mix, mask=tmask[:, None])
    tl.store(RHO + t, rho, mask=tmask)


@triton.jit
def _coef_offsets(n, NP: tl.constexpr):
    """Per-token column offsets into MIX of the pre / post rows (``[NP]``) and the comb rows (``[NP, NP]``)."""
    j = tl.arange(0, NP)
    jmask = j < n
    cidx = 2 * n + j[:, None] * n + j[None, :]
    valid = jmask[:, None] & jmask[None, :]
    return j, jmask, cidx, valid


@triton.jit
def coefficients(MIX, SCALE, BASE, POST, COMB, t, tmask, n, hc_eps, iters, write, HAS_RES: tl.constexpr,
                 NP: tl.constexpr, MP: tl.constexpr):
    """Tokens ``t``' coefficients from their mixes ``MIX [T, MP]``: ``(pre [BT, NP], j, tj)`` returned, and with
    ``HAS_RES`` ``post`` and the Sinkhorn loop's ``comb`` stored where ``write`` (``_pre_fwd_kernel``'s and
    ``kernels.triton.mhc_decode``'s)."""
    t64 = t.to(tl.int64)
    j, jmask, cidx, valid = _coef_offsets(n, NP)
    tj = tmask[:, None] & jmask[None, :]
    mrow = MIX + t64[:, None] * MP
    a = tl.load(mrow + j[None, :], mask=tj, other=0.0) * tl.load(SCALE) + tl.load(BASE + j, mask=jmask, other=0.0)
    pre = tl.where(jmask[None, :], tl.sigmoid(a) + hc_eps, 0.0)
    if HAS_RES:
        ap = tl.load(mrow + n + j[None, :], mask=tj, other=0.0) * tl.load(SCALE + 1) \
            + tl.load(BASE + n + j, mask=jmask, other=0.0)
        tl.store(POST + t64[:, None] * n + j[None, :], 2.0 * tl.sigmoid(ap), mask=tj & write)
        tv = tmask[:, None, None] & valid[None, :, :]
        c = tl.load(MIX + t64[:, None, None] * MP + cidx[None, :, :], mask=tv, other=0.0) * tl.load(SCALE + 2) \
            + tl.load(BASE + cidx, mask=valid, other=0.0)[None, :, :]
        comb = sinkhorn_fwd_tile(c, valid[None, :, :], iters, hc_eps)
        tl.store(COMB + t64[:, None, None] * (n * n) + (j[:, None] * n + j[None, :])[None, :, :], comb,
                 mask=tv & write)
    return pre, j, tj


@triton.jit
def _pre_fwd_kernel(MIX, SCALE, BASE, X, U, PRE, POST, COMB, T, n, d, hc_eps, iters, d_per,
                    HAS_RES: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, MP: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Coefficients of ``BT`` tokens (sigmoids, the Sinkhorn loop) and ``u = sum_j pre_j X_j`` over columns
    ``[pid1 * d_per, (pid1 + 1) * d_per)`` of ``d``: few tokens (a decode step) split ``d`` over the grid's second
    dimension, each program recomputing the tokens' coefficients (a few hundred flops) and the first storing
    them."""
    pdl.wait_prior(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    first = tl.program_id(1) == 0
    tmask = t < T
    t64 = t.to(tl.int64)
    pre, j, tj = coefficients(MIX, SCALE, BASE, POST, COMB, t, tmask, n, hc_eps, iters, first, HAS_RES, NP, MP)
    tl.store(PRE + t64[:, None] * NP + j[None, :], pre, mask=tmask[:, None] & first)
    xrow = X + t64[:, None, None] * (n * d) + j[None, :, None] * d
    d_lo = tl.program_id(1) * d_per
    for d0 in range(d_lo, tl.minimum(d_lo + d_per, d), BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < d
        x = tl.load(xrow + dd[None, None, :], mask=tj[:, :, None] & dmask[None, None, :], other=0.0)
        u = tl.sum(pre[:, :, None] * x.to(tl.float32), 1)
        tl.store(U + t64[:, None] * d + dd[None, :], u.to(U.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _pre_bwd_kernel(MIX, RHO, SCALE, BASE, X, DU, DPOST, DCOMB, DA, DZ, COEF, T, n, d, hc_eps, iters,
                    HAS_RES: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, MP: tl.constexpr):
    """Gradients of the coefficients: ``DA = dL/da``, ``DZ = dL/d(x @ fn^T)`` and the rms term ``COEF`` of dx."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    j, jmask, cidx, valid = _coef_offsets(n, NP)
    tj = tmask[:, None] & jmask[None, :]
    # dL/dpre_j = sum_d du * X_j
    xrow = X + t64[:, None, None] * (n * d) + j[None, :, None] * d
    dpre = tl.zeros([BT, NP], dtype=tl.float32)
    for d0 in range(0, d, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < d
        x = tl.load(xrow + dd[None, None, :], mask=tj[:, :, None] & dmask[None, None, :], other=0.0)
        du = tl.load(DU + t64[:, None] * d + dd[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
        dpre += tl.sum(x.to(tl.float32) * du.to(tl.float32)[:, None, :], 2)
    rho = tl.load(RHO + t, mask=tmask, other=1.0)
    mrow = MIX + t64[:, None] * MP
    darow = DA + t64[:, None] * MP
    dzrow = DZ + t64[:, None] * MP
    s0 = tl.load(SCALE)
    mix = tl.load(mrow + j[None, :], mask=tj, other=0.0)
    sg = tl.sigmoid(mix * s0 + tl.load(BASE + j, mask=jmask, other=0.0))
    da = dpre * sg * (1.0 - sg)
    tl.store(darow + j[None, :], da, mask=tj)
    tl.store(dzrow + j[None, :], da * s0 * rho[:, None], mask=tj)
    drho = tl.sum(da * s0 * mix, 1)
    if HAS_RES:
        s1 = tl.load(SCALE + 1)
        mix = tl.load(mrow + n + j[None, :], mask=tj, other=0.0)
        sg = tl.sigmoid(mix * s1 + tl.load(BASE + n + j, mask=jmask, other=0.0))
        da = tl.load(DPOST + t64[:, None] * n + j[None, :], mask=tj, other=0.0) * 2.0 * sg * (1.0 - sg)
        tl.store(darow + n + j[None, :], da, mask=tj)
        tl.store(dzrow + n + j[None, :], da * s1 * rho[:, None], mask=tj)
        drho += tl.sum(da * s1 * mix, 1)
        s2 = tl.load(SCALE + 2)
        tv = tmask[:, None, None] & valid[None, :, :]
        mix3 = tl.load(MIX + t64[:, None, None] * MP + cidx[None, :, :], mask=tv, other=0.0)
        c = mix3 * s2 + tl.load(BASE + cidx, mask=valid, other=0.0)[None, :, :]
        g = tl.load(DCOMB + t64[:, None, None] * (n * n) + (j[:, None] * n + j[None, :])[None, :, :], mask=tv, other=0.0)
        dc = sinkhorn_bwd_tile(c, g, valid[None, :, :], iters, hc_eps)
        tl.store(DA + t64[:, None, None] * MP + cidx[None, :, :], dc, mask=tv)
        tl.store(DZ + t64[:, None, None] * MP + cidx[None, :, :], dc * s2 * rho[:, None, None], mask=tv)
        drho += tl.sum(tl.sum(dc * s2 * mix3, 2), 1)
    # mix = rho * z: dL/drho = sum_m dmix_m z_m = drho / rho here; d rho / dx = -rho^3 x / K
    K = n * d
    tl.store(COEF + t, -(drho / rho) * rho * rho * rho / K, mask=tmask)


@triton.jit
def _dx_kernel(X, DU, PRE, DZ, FN, COEF, DX, T, d, K, M,
               BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, PREC: tl.constexpr):
    """``dx[t, k] = pre[t, k // d] du[t, k % d] + (dz @ fn)[t, k] + coef[t] x[t, k]``."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    tmask = t < T
    kmask = k < K
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    dz = tl.load(DZ + t64[:, None] * MP + m[None, :], mask=tmask[:, None], other=0.0)
    w = tl.load(FN + m.to(tl.int64)[:, None] * K + k[None, :], mask=(m < M)[:, None] & kmask[None, :], other=0.0)
    acc = tl.dot(dz, w, input_precision=PREC)
    mask = tmask[:, None] & kmask[None, :]
    pre = tl.load(PRE + t64[:, None] * NP + (k // d)[None, :], mask=mask, other=0.0)
    du = tl.load(DU + t64[:, None] * d + (k % d)[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + t64[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    coef = tl.load(COEF + t, mask=tmask, other=0.0)
    dx = acc + pre * du + coef[:, None] * x
    tl.store(DX + t64[:, None] * K + k[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _dfn_kernel(DZ, X, DFN, T, K, M,
                BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr):
    """``dfn[:, k-block] = dz^T @ x[:, k-block]`` over all tokens (one program per column block)."""
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = k < K
    m = tl.arange(0, MP)
    acc = tl.zeros([MP, BK], dtype=tl.float32)
    for t0 in tl.range(0, T, BT, num_stages=STAGES):
        t = t0 + tl.arange(0, BT)
        tmask = t < T
        t64 = t.to(tl.int64)
        dz = tl.load(DZ + t64[:, None] * MP + m[None, :], mask=tmask[:, None], other=0.0)
        x = tl.load(X + t64[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(tl.trans(dz), x.to(tl.float32), acc, input_precision=PREC)
    tl.store(DFN + m.to(tl.int64)[:, None] * K + k[None, :], acc, mask=(m < M)[:, None] & kmask[None, :])


@triton.jit
def _post_fwd_kernel(F, X, POST, COMB, OUT, T, n, d,
                     BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, N: tl.constexpr, SHARED=None,
                     TOPK: tl.constexpr = 0, PDL: tl.constexpr = False):
    """``OUT[t, k] = post[t, k] f[t] + sum_j comb[t, j, k] X[t, j]`` for a ``BT x BD`` tile. ``TOPK`` > 0: ``F`` is
    the MoE's pairs ``[T * TOPK, d]`` and ``f[t]`` their sum with ``SHARED[t]`` (``kernels.triton.experts.pairs_sum``,
    the bits of ``moe_combine``); 0: ``F`` is ``f`` (training, the attention's output)."""
    pdl.wait_prior(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    tmask = t < T
    dmask = dd < d
    t64 = t.to(tl.int64)
    td = tmask[:, None] & dmask[None, :]
    if TOPK:
        # the MoE's output as moe_combine rounds it, once, to the shared expert's dtype
        f = pairs_sum(F, SHARED, t64, dd, td, d, TOPK, BT, BD).to(SHARED.dtype.element_ty).to(tl.float32)
    else:
        f = tl.load(F + t64[:, None] * d + dd[None, :], mask=td, other=0.0).to(tl.float32)
    post_tile(f, X, POST, COMB, OUT, t64, tmask, dd, dmask, n, d, NP, N)


@triton.jit
def post_tile(f, X, POST, COMB, OUT, t64, tmask, dd, dmask, n, d, NP: tl.constexpr, N: tl.constexpr):
    """The mHC post of a tile: ``OUT[t, k, dd] = post[t, k] f[t, dd] + sum_j comb[t, j, k] X[t, j, dd]`` for the
    tokens ``t64`` (``tmask``) and columns ``dd`` (``dmask``) of ``f`` (fp32, as the sublayer's output was
    rounded), in fp32, stored in ``OUT``'s dtype: :func:`_post_fwd_kernel`'s, and the epilogue of
    ``kernels.triton.linear_group``'s ``linear_post`` (the same expression, so the same bits)."""
    kk = tl.arange(0, NP)
    tk = tmask[:, None] & (kk < n)[None, :]
    td = tmask[:, None] & dmask[None, :]
    post = tl.load(POST + t64[:, None] * n + kk[None, :], mask=tk, other=0.0)
    acc = post[:, :, None] * f[:, None, :]
    for jj in tl.static_range(N):
        xj = tl.load(X + t64[:, None] * (n * d) + jj * d + dd[None, :], mask=td, other=0.0).to(tl.float32)
        cj = tl.load(COMB + t64[:, None] * (n * n) + jj * n + kk[None, :], mask=tk, other=0.0)
        acc += cj[:, :, None] * xj[:, None, :]
    out = OUT + t64[:, None, None] * (n * d) + kk[None, :, None] * d + dd[None, None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=tk[:, :, None] & dmask[None, None, :])


@triton.jit
def _post_bwd_kernel(F, X, POST, COMB, G, DF, DX, DPOST, DCOMB, T, n, d,
                     BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, N: tl.constexpr):
    """``df = sum_k post_k g_k``, ``dX_j = sum_k comb[j, k] g_k`` (per d-block) and ``dpost_k = <g_k, f>``,
    ``dcomb[j, k] = <X_j, g_k>`` (reduced over all of d in registers)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    kk = tl.arange(0, NP)
    tk = tmask[:, None] & (kk < n)[None, :]
    post = tl.load(POST + t64[:, None] * n + kk[None, :], mask=tk, other=0.0)
    dpost = tl.zeros([BT, NP], dtype=tl.float32)
    dcomb = tl.zeros([BT, NP, NP], dtype=tl.float32)
    for d0 in range(0, d, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < d
        td = tmask[:, None] & dmask[None, :]
        g = tl.load(G + t64[:, None, None] * (n * d) + kk[None, :, None] * d + dd[None, None, :],
                    mask=tk[:, :, None] & dmask[None, None, :], other=0.0).to(tl.float32)
        f = tl.load(F + t64[:, None] * d + dd[None, :], mask=td, other=0.0).to(tl.float32)
        tl.store(DF + t64[:, None] * d + dd[None, :], tl.sum(post[:, :, None] * g, 1).to(DF.dtype.element_ty),
                 mask=td)
        dpost += tl.sum(g * f[:, None, :], 2)
        for jj in tl.static_range(N):
            xj = tl.load(X + t64[:, None] * (n * d) + jj * d + dd[None, :], mask=td, other=0.0).to(tl.float32)
            cj = tl.load(COMB + t64[:, None] * (n * n) + jj * n + kk[None, :], mask=tk, other=0.0)
            tl.store(DX + t64[:, None] * (n * d) + jj * d + dd[None, :],
                     tl.sum(cj[:, :, None] * g, 1).to(DX.dtype.element_ty), mask=td)
            dcomb += tl.where(kk[None, :, None] == jj, tl.sum(xj[:, None, :] * g, 2)[:, None, :], 0.0)
    tl.store(DPOST + t64[:, None] * n + kk[None, :], dpost, mask=tk)
    tl.store(DCOMB + t64[:, None, None] * (n * n) + kk[None, :, None] * n + kk[None, None, :], dcomb,
             mask=tk[:, :, None] & (kk < n)[None, None, :])


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _cfg(config):
    return {**MHC_CONFIG, **(config or {})}


def _mix(x2, fn, mix, rho, norm_eps, cfg):
    """``mix``, ``rho`` of the mixing GEMM: one program per ``mix_BT`` tokens over all of ``K``, or, when that
    leaves most of the GPU idle (a decode step: 64 tokens were 4 programs, 0.2 ms a call on an H200), split
    over ``K`` into about ``mix_programs`` programs (:func:`mix_parts`) and summed by a second kernel."""
    T, K = x2.shape
    M, MP = fn.shape[0], mix.shape[1]
    split = mix_split(T, K, cfg)
    if split <= 1:
        _mix_kernel[(triton.cdiv(T, cfg["mix_BT"]),)](x2, fn, mix, rho, T, K, M, norm_eps, BT=cfg["mix_BT"],
                                                      BK=cfg["mix_BK"], MP=MP, PREC=PRECISION,
                                                      STAGES=cfg["mix_stages"], num_warps=cfg["mix_warps"],
                                                      **pdl.launch(x2.device))
        return
    part, ssp, split = mix_parts(x2, fn, MP, cfg, split)
    bt = min(4, triton.next_power_of_2(T))                      # a decode step's tokens over a few programs
    sb = partials_a_load(split, bt, MP)
    _mix_finish_kernel[(triton.cdiv(T, bt),)](part, ssp, mix, rho, T, K, split, norm_eps, BT=bt, MP=MP, SB=sb,
                                              num_warps=4, **pdl.launch(part.device))


def mix_parts(x2, fn, MP, cfg, split: int):
    """The split mixing GEMM's first kernel (:func:`_mix_part_kernel`) over about ``split`` column ranges (whole
    ``mix_BK`` chunks; :func:`mix_split`) -> ``(part [split', T, MP], ssp [split', T], split')``."""
    T, K = x2.shape
    kper = triton.cdiv(triton.cdiv(K, split), cfg["mix_BK"]) * cfg["mix_BK"]
    split = triton.cdiv(K, kper)
    part = torch.empty(split, T, MP, dtype=torch.float32, device=x2.device)
    ssp = torch.empty(split, T, dtype=torch.float32, device=x2.device)
    _mix_part_kernel[(triton.cdiv(T, cfg["mix_BT"]), split)](
        x2, fn, part, ssp, T, K, fn.shape[0], kper, BT=cfg["mix_BT"], BK=cfg["mix_BK"], MP=MP, PREC=PRECISION,
        STAGES=cfg["mix_stages"], num_warps=cfg["mix_warps"], **pdl.launch(x2.device))
    return part, ssp, split


def partials_a_load(split: int, bt: int, width: int) -> int:
    """How many partials a program of the sums loads at once: up to ``FINISH_TILE`` values."""
    return min(triton.next_power_of_2(split), max(1, FINISH_TILE // (bt * width)))


def mix_split(T: int, K: int, cfg) -> int:
    """The split :func:`_mix` takes for ``T`` tokens over ``K`` channels (1: one pass)."""
    return min(cfg["mix_programs"] // triton.cdiv(T, cfg["mix_BT"]), triton.cdiv(K, 4 * cfg["mix_BK"]))


def _coef_forward(x2, fn, scale, base, n, d, norm_eps, hc_eps, iters, has_res, cfg):
    """The mixing GEMM and the coefficient kernel: ``(u, pre [T, NP], post, comb, mix [T, MP], rho)``."""
    T, K = x2.shape
    M = fn.shape[0]
    MP, NP = _mp(M), mhc_checks.padded(n)
    dev = x2.device
    mix = torch.empty(T, MP, dtype=torch.float32, device=dev)
    rho = torch.empty(T, dtype=torch.float32, device=dev)
    u = torch.empty(T, d, dtype=x2.dtype, device=dev)
    pre = torch.empty(T, NP, dtype=torch.float32, device=dev)
    post = torch.empty(T, n if has_res else 0, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n if has_res else 0, n, dtype=torch.float32, device=dev)
    if T:
        _mix(x2, fn, mix, rho, norm_eps, cfg)
        rows, d_per = triton.cdiv(T, cfg["coef_BT"]), _coef_columns(T, d, cfg)
        _pre_fwd_kernel[(rows, triton.cdiv(d, d_per))](
            mix, scale, base, x2, u, pre, post if has_res else mix, comb if has_res else mix, T, n, d, hc_eps, iters,
            d_per, HAS_RES=has_res,
            BT=cfg["coef_BT"], NP=NP, BD=cfg["coef_BD"], MP=MP, num_warps=cfg["coef_warps"], **pdl.launch(mix.device))
    return u, pre, post, comb, mix, rho


def _coef_columns(T: int, d: int, cfg) -> int:
    """Columns of ``d`` per program of the coefficient kernel: all of them when the tokens alone fill about
    ``coef_programs`` programs (training), else ``d`` split so that they do (a decode step of 64 tokens was 4
    programs, each reading its 16 tokens' four streams alone: 37 us a call on an H200), in whole ``coef_BD``
    tiles of at least two."""
    rows = triton.cdiv(T, cfg["coef_BT"])
    split = max(1, min(cfg["coef_programs"] // rows, triton.cdiv(d, 2 * cfg["coef_BD"])))
    return triton.cdiv(triton.cdiv(d, split), cfg["coef_BD"]) * cfg["coef_BD"]


def _coef_backward(x2, fn, scale, base, pre, mix, rho, du, dpost, dcomb, n, d, hc_eps, iters, cfg):
    """``(dx2, dfn, dscale, dbase)`` of :func:`_coef_forward` (``dpost``/``dcomb`` None for hc_head)."""
    has_res = dpost is not None
    T, K = x2.shape
    M = fn.shape[0]
    MP, NP = mix.shape[1], pre.shape[1]
    dev = x2.device
    da = torch.zeros(T, MP, dtype=torch.float32, device=dev)
    dz = torch.zeros(T, MP, dtype=torch.float32, device=dev)
    coef = torch.empty(T, dtype=torch.float32, device=dev)
    dx = torch.empty_like(x2)
    dfn = torch.empty(M, K, dtype=torch.float32, device=dev)
    du = du.reshape(T, d).contiguous()
    if has_res:
        dpost, dcomb = dpost.reshape(T, n).float().contiguous(), dcomb.reshape(T, n, n).float().contiguous()
    else:
        dpost = dcomb = mix  # unused (HAS_RES=False)
    if T:
        _pre_bwd_kernel[(triton.cdiv(T, cfg["coef_BT"]),)](
            mix, rho, scale, base, x2, du, dpost, dcomb, da, dz, coef, T, n, d, hc_eps, iters,
            HAS_RES=has_res, BT=cfg["coef_BT"], NP=NP, BD=cfg["coef_BD"], MP=MP, num_warps=cfg["coef_warps"])
        _dx_kernel[(triton.cdiv(T, cfg["dx_BT"]), triton.cdiv(K, cfg["dx_BK"]))](
            x2, du, pre, dz, fn, coef, dx, T, d, K, M, BT=cfg["dx_BT"], BK=cfg["dx_BK"], MP=MP, NP=NP,
            PREC=PRECISION, num_warps=cfg["dx_warps"])
        _dfn_kernel[(triton.cdiv(K, cfg["dfn_BK"]),)](
            dz, x2, dfn, T, K, M, BT=cfg["dfn_BT"], BK=cfg["dfn_BK"], MP=MP, PREC=PRECISION,
            STAGES=cfg["dfn_stages"], num_warps=cfg["dfn_warps"])
    else:
        dfn.zero_()
    da = da[:, :M]
    dbase = da.sum(0)
    per_row = (da * mix[:, :M]).sum(0)  # dL/dsvec
    if has_res:
        dscale = torch.stack((per_row[:n].sum(), per_row[n:2 * n].sum(), per_row[2 * n:].sum()))
    else:
        dscale = per_row.sum().reshape(1)
    return dx, dfn, dscale, dbase


# ----------------------------------------------------------------------------------------------
# launchers of the dsv4_triton custom ops (kernels.gpu_ops; x [T, n, d], inputs already checked)
# ----------------------------------------------------------------------------------------------


def hc_pre_fwd(x, fn, scale, base, norm_eps, hc_eps, iters, config=None):
    """``-> (u [T, d], post [T, n], comb [T, n, n], pre, mix, rho)`` (the last three for the backward)."""
    T, n, d = x.shape
    u, pre, post, comb, mix, rho = _coef_forward(x.reshape(T, n * d).contiguous(), fn, scale, base, n, d,
                                                 norm_eps, hc_eps, iters, True, _cfg(config))
    return u, post, comb, pre, mix, rho


def hc_pre_bwd(x, fn, scale, base, pre, mix, rho, du, dpost, dcomb, hc_eps, iters, config=None):
    """``-> (dx [T, n, d], dfn, dscale [3], dbase)``."""
    T, n, d = x.shape
    dx, dfn, dscale, dbase = _coef_backward(x.reshape(T, n * d).contiguous(), fn, scale, base, pre, mix, rho, du,
                                            dpost, dcomb, n, d, hc_eps, iters, _cfg(config))
    return dx.view(T, n, d), dfn, dscale, dbase


def hc_head_fwd(x, fn, scale, base, norm_eps, hc_eps, config=None):
    """``-> (y [T, d], pre, mix, rho)``."""
    T, n, d = x.shape
    u, pre, _, _, mix, rho = _coef_forward(x.reshape(T, n * d).contiguous(), fn, scale, base, n, d, norm_eps,
                                           hc_eps, 1, False, _cfg(config))
    return u, pre, mix, rho


def hc_head_bwd(x, fn, scale, base, pre, mix, rho, dy, hc_eps, config=None):
    """``-> (dx [T, n, d], dfn, dscale [1], dbase)``."""
    T, n, d = x.shape
    dx, dfn, dscale, dbase = _coef_backward(x.reshape(T, n * d).contiguous(), fn, scale, base, pre, mix, rho, dy,
                                            None, None, n, d, hc_eps, 1, _cfg(config))
    return dx.view(T, n, d), dfn, dscale, dbase


def hc_post_fwd(f, x, post, comb, config=None):
    """``f [T, d]``, ``x [T, n, d]``, ``post [T, n]``, ``comb [T, n, n]`` -> ``[T, n, d]`` in x's dtype."""
    return _post_launch(f, x, post, comb, config)


def combine_post_fwd(pairs, shared, topk: int, x, post, comb, config=None):
    """:func:`hc_post_fwd` of the MoE's output given as its pairs ``pairs [T * topk, d]`` and shared expert ``shared
    [T, d]`` (``moe_combine``'s inputs), summed inside the kernel: ``x [T, n, d]``, ``post [T, n]``, ``comb [T, n,
    n]`` -> ``[T, n, d]`` in x's dtype."""
    return _post_launch(pairs, x, post, comb, config, shared.contiguous(), int(topk))


def _post_launch(f, x, post, comb, config, shared=None, topk: int = 0):
    """:func:`_post_fwd_kernel` over ``x``'s tokens: of ``f``, or with ``topk`` of the pairs ``f`` and ``shared``."""
    T, n, d = x.shape
    f, x, post, comb = f.contiguous(), x.contiguous(), post.contiguous(), comb.contiguous()
    cfg = _cfg(config)
    out = torch.empty_like(x)
    if T:
        _post_fwd_kernel[(triton.cdiv(T, cfg["post_BT"]), triton.cdiv(d, cfg["post_BD"]))](
            f, x, post, comb, out, T, n, d, BT=cfg["post_BT"], NP=mhc_checks.padded(n), BD=cfg["post_BD"],
            N=n, SHARED=shared, TOPK=topk, num_warps=cfg["post_warps"], **pdl.launch(x.device))
    return out


def hc_post_bwd(f, x, post, comb, g, config=None):
    """``-> (df, dx, dpost, dcomb)``, each shaped and typed like its input."""
    T, n, d = x.shape
    f, x, post, comb, g = f.contiguous(), x.contiguous(), post.contiguous(), comb.contiguous(), g.contiguous()
    cfg = _cfg(config)
    df, dx = torch.empty_like(f), torch.empty_like(x)
    dpost, dcomb = torch.empty_like(post), torch.empty_like(comb)
    if T:
        _post_bwd_kernel[(triton.cdiv(T, cfg["post_bwd_BT"]),)](
            f, x, post, comb, g, df, dx, dpost, dcomb, T, n, d, BT=cfg["post_bwd_BT"],
            NP=mhc_checks.padded(n), BD=cfg["post_bwd_BD"], N=n, num_warps=cfg["post_bwd_warps"])
    return df, dx, dpost, dcomb


# ----------------------------------------------------------------------------------------------
# ops (the reference contracts)
# ----------------------------------------------------------------------------------------------


@gpu_ops.traceable
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """Same contract as ``kernels.reference.mhc.hc_pre``: ``x [..., n, d]`` (bf16/fp16), fp32 ``fn
    [(2+n)n, n d]``, ``scale [3]``, ``base [(2+n)n]`` -> ``(u [..., d] in x.dtype, post [..., n], comb [..., n, n]
    fp32)``; other inputs are refused with the reason (``kernels/triton/mhc_checks.py``). Runs the
    ``dsv4_triton::hc_pre`` custom op (``kernels.gpu_ops``; backward ``hc_pre_bwd``)."""
    mhc_checks.check_hc_pre(x, fn, scale, base, sinkhorn_iters)
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    u, post, comb, *_ = gpu_ops.TRITON.hc_pre(x.reshape(-1, n, d), fn, scale, base, float(norm_eps),
                                              float(hc_eps), int(sinkhorn_iters))
    return u.view(*lead, d), post.view(*lead, n), comb.view(*lead, n, n)


@gpu_ops.traceable
def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.reference.mhc.hc_post``: ``X'_k = post_k f + sum_j comb[j,k] X_j`` in x.dtype,
    fp32 inside; ``x`` bf16/fp16, ``f`` bf16/fp16/fp32, ``post``/``comb`` fp32 (``dsv4_triton::hc_post``)."""
    mhc_checks.check_hc_post(f, x, post, comb)
    n, d = x.shape[-2:]
    out = gpu_ops.TRITON.hc_post(f.reshape(-1, d), x.reshape(-1, n, d), post.reshape(-1, n), comb.reshape(-1, n, n))
    return out.view(x.shape)


@gpu_ops.traceable
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Same contract as ``kernels.reference.mhc.hc_head``: ``x [..., n, d]`` -> ``[..., d]`` in x.dtype
    (``dsv4_triton::hc_head``)."""
    mhc_checks.check_hc_head(x, fn, scale, base)
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    y = gpu_ops.TRITON.hc_head(x.reshape(-1, n, d), fn, scale, base, float(norm_eps), float(hc_eps))[0]
    return y.view(*lead, d)
