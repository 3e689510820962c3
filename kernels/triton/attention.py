"""Triton sparse MQA attention with an attention sink (DeepSeek-V4 CSA/HCA/window layers).

Math (reference_system.md §1.7; ``kernels.reference.attention.sparse_attention_with_sink``)::

    z_j   = scale * <q[t,h], kv[idx[t,j]]>            j over the K slots of row t, idx = -1 skipped
    m     = max(max_j z_j, sink[h])                   the sink is a logit (not scaled) in the denominator only
    Z     = sum_j exp(z_j - m) + exp(sink[h] - m)
    o     = sum_j exp(z_j - m) / Z * kv[idx[t,j]]
    lse   = m + log Z                                 (natural log, fp32; the kernels keep it in log2 units)

Backward, with Delta[t,h] = <o[t,h], do[t,h]>::

    P_j    = exp(z_j - lse);   dS_j = P_j * (<do, kv_j> - Delta)
    dq     = scale * sum_j dS_j kv_j
    dkv_j += scale * dS_j q + P_j do                  (fp32 scatter-add with atomics over the selected rows)
    d_sink = -sum_t Delta[t,h] * exp(sink[h] - lse[t,h])

Layout is flattened THD: ``q [T,H,D]``, ``kv [Tkv,D]`` (one shared K=V head), ``idx [T,K]`` int32
with ``-1`` for empty slots, ``sink [H]`` fp32. Inputs bf16/fp16, accumulation fp32.

Kernels (one program = one query token x a block of ``BH`` heads; for H=128 the two head blocks of a
token are adjacent in launch order so the second one reads the gathered KV rows from L2):

* ``_fwd_kernel``: online softmax over ``BK``-row gathered KV tiles. The running max starts at the
  sink logit and the running sum at 1 (the sink's own term), so a row whose slots are all ``-1``
  gives ``o = 0``, ``lse = sink`` with no NaN.
* ``_delta_kernel``: ``Delta = sum_d o*do`` in fp32.
* ``_bwd_dq_kernel``: recomputes S and dP per tile; dq accumulates in fp32 registers
  (deterministic); writes ``P`` and ``scale*dS`` (bf16, ``[T,H,K]``) for the next pass.
* ``_bwd_dkv_kernel``: one program = one token x one ``DC``-wide slice of D, over all heads:
  ``dkv[idx] += (scale*dS)^T q + P^T do`` with vectorised fp32 atomics (``REDG.F32x4``) into an fp32
  buffer, cast to kv.dtype at the end. Reducing over all H heads in-register before the atomic halves
  the atomic traffic for H=128 compared with one atomic per 64-head block. dkv is NOT bitwise
  deterministic run to run (fp32 addition order of the atomics); dq, d_sink, o and lse are.
* d_sink is a torch reduction of ``-Delta*exp(sink-lse)`` over tokens (deterministic).

Decode (``attention_inverse_rope``, the eager rollout step's op): whichever of ``_fwd_kernel`` and ``_combine_kernel``
writes the output then rotates its last rope channels back in place (``_inverse_rope_epilogue``: the stored output
read back and rotated with ``kernels/triton/rope.py``'s math, the bits of that kernel run after), and token ``t``
reads its own sequence's cache (``stride_kvt``, the split kernel too); without those arguments the kernels compile
as before.

Known limitation (Triton codegen): with a chained dot and ``M = BH = 64`` rows on 8 warps, Triton
assigns both warpgroups to the M axis, so the ``q.kv^T`` (and ``do.kv^T``) products are computed by both
warpgroups redundantly; the tensor-core work of the forward is 1.5x the useful FLOPs. See bench.py.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.gpu_common import LN2, LOG2E  # noqa: F401  (re-exported: bench.py uses A.LOG2E)
from kernels.triton import pdl
from kernels.triton.rope import _rotate_channels

__all__ = [
    "sparse_attention_with_sink",
    "sparse_attention_with_sink_thd",
    "sparse_attention_fwd",
    "sparse_attention_bwd",
    "attention_inverse_rope",
    "FWD_CONFIG",
    "BWD_CONFIG",
]

# Launch parameters; bench.py may override them per call (the ``config`` argument).
FWD_CONFIG = dict(BH=64, BK=64, num_warps=8, num_stages=2, SPLIT=1)
# (fastest of bench.py's sweep on the H200; BK=64 with 2 stages does not fit in shared memory)
# Few tokens (a decode step): narrower head blocks, so more programs share the work (fwd_settings). ptxas (sm_90a,
# triton 3.6): no spills at 8 warps; at 4 it spills 800 bytes (BK=32 with 3 stages does not)
FEW_TOKENS_CONFIG = dict(BH=16, BK=64, num_warps=8, num_stages=2, SPLIT=1)
FEW_PROGRAMS = 128             # programs of FWD_CONFIG's grid below which FEW_TOKENS_CONFIG runs
BWD_CONFIG = dict(BH=64, BK=64, num_warps=8, num_stages=1,     # dq pass
                  BK2=64, DC=64, num_warps2=4, num_stages2=3)  # dkv pass


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attend_tiles(q, KV, idx_row, k_lo, k_hi, m_i, l_i, acc, scale_log2, stride_kv,
                  BK: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The online softmax of ``q [BH, D]`` over the gathered rows ``idx_row[k_lo:k_hi]`` in ``BK``-row tiles,
    from the running max ``m_i``, sum ``l_i`` (log2 units) and output ``acc``: ``(m_i, l_i, acc)`` after them."""
    offs_d = tl.arange(0, D)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BK)
        idx = tl.load(idx_row + offs_k, mask=offs_k < k_hi, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        kv = tl.load(KV + rows[:, None] * stride_kv + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kv)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _inverse_rope_epilogue(O_t, offs_h, hmask, stride_oh, COS_t, SIN_t, D: tl.constexpr, PAIRS: tl.constexpr,
                           ROUNDED: tl.constexpr):
    """The inverse rotation, in place, of the rows ``O_t + offs_h stride_oh`` that this program has just stored: their
    last ``2 PAIRS`` channels, interleaved pairs, by the token's angles ``COS_t``/``SIN_t`` ``[PAIRS]`` fp32. It
    reads back the output as stored (rounded to its dtype) and rotates it with :func:`_rope_kernel`'s math
    (``kernels.triton.rope._rotate_channels``), so the result has the bits of that kernel run after this one.
    The first barrier orders the program's stores before its reloads, the second every reload (a channel and its
    partner are read by different threads) before the rotated stores; no other program touches these rows."""
    RW: tl.constexpr = triton.next_power_of_2(2 * PAIRS)
    j = tl.arange(0, RW)
    is_rope = j < 2 * PAIRS
    cols = (D - 2 * PAIRS) + j                       # the rope channels start at an even column (D is even)
    mask = hmask[:, None] & is_rope[None, :]
    rows = O_t + offs_h[:, None] * stride_oh
    tl.debug_barrier()
    x = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(rows + (cols ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    pair = tl.where(is_rope, j // 2, 0)
    c = tl.load(COS_t + pair, mask=is_rope, other=1.0)
    s = tl.load(SIN_t + pair, mask=is_rope, other=0.0)
    out = _rotate_channels(x, partner, c[None, :], s[None, :], ((j & 1) == 1)[None, :], True, ROUNDED)
    tl.debug_barrier()
    tl.store(rows + cols[None, :], out.to(O_t.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_kernel(Q, KV, IDX, SINK, O, LSE2,
                H, K, scale_log2,
                stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
                BH: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr,
                stride_kvt=None, COS=None, SIN=None, ROPE: tl.constexpr = 0, ROUNDED: tl.constexpr = False,
                PDL: tl.constexpr = False):
    """Program ``(hb, t)``: token ``t``'s heads of block ``hb``. ``stride_kvt``: token ``t``'s rows start at ``KV +
    t stride_kvt`` (one sequence's cache a token, the decode step's; None: one ``KV`` for every token). ``ROPE``:
    that many trailing pairs of the output are then rotated back by the token's angles ``COS``/``SIN``
    (:func:`_inverse_rope_epilogue`; 0: none, the training forward)."""
    pdl.wait_prior(PDL)
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    if stride_kvt is not None:
        KV += t * stride_kvt
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)

    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None], other=0.0)
    # the sink is the first "key": running max = sink (log2 units), running sum = 1
    m_i = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BH], 1.0, dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    m_i, l_i, acc = _attend_tiles(q, KV, IDX + t * stride_it, 0, K, m_i, l_i, acc, scale_log2, stride_kv,
                                  BK, D, NUM_STAGES)

    o = acc / l_i[:, None]
    tl.store(O + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=hmask[:, None])
    tl.store(LSE2 + t * H + offs_h, m_i + tl.log2(l_i), mask=hmask)
    if ROPE:
        _inverse_rope_epilogue(O + t * stride_ot, offs_h, hmask, stride_oh, COS + t * ROPE, SIN + t * ROPE,
                               D, ROPE, ROUNDED)


@triton.jit
def _fwd_split_kernel(Q, KV, IDX, PO, PM, PL,
                      H, K, KPER, scale_log2,
                      stride_qt, stride_qh, stride_kv, stride_it,
                      BH: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr,
                      stride_kvt=None, PDL: tl.constexpr = False):
    """Program ``(hb, s, t)``: the online softmax of token ``t``'s heads over its rows ``[s KPER, (s+1) KPER)``,
    unnormalized (``PO [T, S, H, D]`` fp32) with its max and sum (``PM``, ``PL`` ``[T, S, H]``, log2 units);
    :func:`_combine_kernel` adds the sink and the splits. A finite start (not -inf) keeps a split without a
    valid row at ``l = 0`` without NaN. ``stride_kvt``: as :func:`_fwd_kernel`'s."""
    pdl.wait_prior(PDL)
    hb = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    if stride_kvt is not None:
        KV += t * stride_kvt
    S = tl.num_programs(1)
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None], other=0.0)
    m_i = tl.full([BH], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    k_lo = sp * KPER
    m_i, l_i, acc = _attend_tiles(q, KV, IDX + t * stride_it, k_lo, tl.minimum(k_lo + KPER, K), m_i, l_i, acc,
                                  scale_log2, stride_kv, BK, D, NUM_STAGES)
    row = (t * S + sp) * H + offs_h                                       # [BH] rows of [T, S, H]
    tl.store(PO + row[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])
    tl.store(PM + row, m_i, mask=hmask)
    tl.store(PL + row, l_i, mask=hmask)


@triton.jit
def _combine_kernel(PO, PM, PL, SINK, O, LSE2, H, S, stride_ot, stride_oh,
                    BH: tl.constexpr, D: tl.constexpr,
                    COS=None, SIN=None, ROPE: tl.constexpr = 0, ROUNDED: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Program ``(hb, t)``: token ``t``'s output and log-sum-exp from its splits' partials and the sink (a
    logit in the denominator only), as :func:`_fwd_kernel` writes them (its ``ROPE`` epilogue too)."""
    pdl.wait_prior(PDL)
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    sink = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    m = sink
    for sp in range(0, S):
        m = tl.maximum(m, tl.load(PM + (t * S + sp) * H + offs_h, mask=hmask, other=-1.0e30))
    z = tl.exp2(sink - m)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    for sp in range(0, S):
        row = (t * S + sp) * H + offs_h
        w = tl.exp2(tl.load(PM + row, mask=hmask, other=-1.0e30) - m)
        z += tl.load(PL + row, mask=hmask, other=0.0) * w
        acc += tl.load(PO + row[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0) * w[:, None]
    tl.store(O + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             (acc / z[:, None]).to(O.dtype.element_ty), mask=hmask[:, None])
    tl.store(LSE2 + t * H + offs_h, m + tl.log2(z), mask=hmask)
    if ROPE:
        _inverse_rope_epilogue(O + t * stride_ot, offs_h, hmask, stride_oh, COS + t * ROPE, SIN + t * ROPE,
                               D, ROPE, ROUNDED)


@triton.jit
def _delta_kernel(O, DO, DELTA, N, D: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < N
    offs_d = tl.arange(0, D)
    ptr = r.to(tl.int64)[:, None] * D + offs_d[None, :]
    o = tl.load(O + ptr, mask=rmask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + ptr, mask=rmask[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + r, tl.sum(o * do, 1), mask=rmask)


@triton.jit
def _bwd_dq_kernel(Q, KV, IDX, DO, LSE2, DELTA, DQ, PT, DST,
                   H, K, scale, scale_log2,
                   stride_qt, stride_qh, stride_kv, stride_it, stride_dot, stride_doh,
                   BH: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """dq for one (head block, token); also writes P and scale*dS (bf16) as [T, H, K] for the dkv pass."""
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)

    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
    do = tl.load(DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_d[None, :], mask=hmask[:, None],
                 other=0.0)
    lse2 = tl.load(LSE2 + t * H + offs_h, mask=hmask, other=0.0)
    delta = tl.load(DELTA + t * H + offs_h, mask=hmask, other=0.0)

    dq = tl.zeros([BH, D], dtype=tl.float32)
    idx_row = IDX + t * stride_it
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        idx = tl.load(idx_row + offs_k, mask=kmask, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        kv = tl.load(KV + rows[:, None] * stride_kv + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kv))
        dp = tl.dot(do, tl.trans(kv))
        keep = hmask[:, None] & valid[None, :]
        p = tl.where(keep, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kv.dtype), kv, dq)
        pk = (t * H + offs_h[:, None]) * K + offs_k[None, :]
        smask = hmask[:, None] & kmask[None, :]
        tl.store(PT + pk, p.to(PT.dtype.element_ty), mask=smask)
        tl.store(DST + pk, (ds * scale).to(DST.dtype.element_ty), mask=smask)

    tl.store(DQ + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _bwd_dkv_kernel(Q, DO, IDX, PT, DST, DKV,
                    H, K,
                    stride_qt, stride_qh, stride_it, stride_dot, stride_doh,
                    HP: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr, D: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """dkv[idx[t,k], chunk] += dS^T q + P^T do over all heads of token t, for one D chunk (atomics)."""
    c = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, HP)
    hmask = offs_h < H
    offs_c = c * DC + tl.arange(0, DC)
    qc = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_c[None, :], mask=hmask[:, None], other=0.0)
    doc = tl.load(DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_c[None, :], mask=hmask[:, None],
                  other=0.0)
    idx_row = IDX + t * stride_it
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        idx = tl.load(idx_row + offs_k, mask=kmask, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        pk = (t * H + offs_h[None, :]) * K + offs_k[:, None]
        lmask = kmask[:, None] & hmask[None, :]
        dsT = tl.load(DST + pk, mask=lmask, other=0.0)
        pT = tl.load(PT + pk, mask=lmask, other=0.0)
        acc = tl.dot(dsT, qc)
        acc = tl.dot(pT, doc, acc)
        tl.atomic_add(DKV + rows[:, None] * D + offs_c[None, :], acc, mask=valid[:, None], sem="relaxed")


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor) -> None:
    gpu_common.check_attention_inputs(q, kv, idx, sink, "triton", need_cuda=not gpu_common.interpreting(),
                                      cuda_hint=" (or TRITON_INTERPRET=1 for CPU debugging)")


def _head_block(H: int, BH: int) -> int:
    return max(16, min(BH, triton.next_power_of_2(H)))


def fwd_settings(T: int, H: int, K: int = 0) -> dict:
    """The forward's launch settings for ``T`` tokens of ``H`` heads over ``K`` gathered rows:
    :data:`FWD_CONFIG`, or for fewer than :data:`FEW_PROGRAMS` of its programs :data:`FEW_TOKENS_CONFIG`, whose
    ``SPLIT`` (rows split over that many programs a head block, at least two tiles each) is raised while a
    token's head blocks alone leave most of the GPU idle. Why: every head of a token multiplies that token's
    gathered rows (one shared key-value head), 84 MFLOP a token for V4-Flash's 64 heads over 640 rows, and a
    program of 64 heads does it on one SM: a decode step of one sequence ran each layer's attention on one SM
    (16 us a call) and one of 64 sequences on 64 of the H200's 132 (21 us;
    ``bench/results/rollout-h200-flash-shaped-triton-eager-route-order.json``). 16-head blocks give each token
    four programs (64 sequences: 48.5 us for 640 rows; one: 30.7 us, four programs;
    ``bench/results/kernels-decode-sweep-h200.json``); a split gives one token's four blocks more. Each head's
    row is computed alike in each (its dot products over ``D``, its online softmax over the same row tiles;
    split, the partial sums meet in fp32)."""
    blocks = triton.cdiv(H, _head_block(H, FWD_CONFIG["BH"]))
    if blocks * T >= FEW_PROGRAMS:
        return dict(FWD_CONFIG)
    cfg = dict(FEW_TOKENS_CONFIG)
    programs = triton.cdiv(H, _head_block(H, cfg["BH"])) * T
    cfg["SPLIT"] = max(1, min(FEW_PROGRAMS // programs, K // (2 * cfg["BK"])))
    return cfg


def sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float, config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward only. Returns ``o [T,H,D]`` (q.dtype) and ``lse2 [T,H]`` fp32 in log2 units; launch settings
    :func:`fwd_settings`, ``config`` overrides their keys."""
    _check(q, kv, idx, sink)
    cfg = {**fwd_settings(q.shape[0], q.shape[1], idx.shape[-1]), **(config or {})}
    q, kv = q.contiguous(), kv.contiguous()
    # int64 ids as they come (a decode step's): their cast was a launch a layer; the kernels load either width
    idx = (idx if idx.dtype == torch.int64 else idx.to(torch.int32)).contiguous()
    sink = sink.to(torch.float32).contiguous()
    T, H = q.shape[:2]
    o = torch.empty_like(q)
    lse2 = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return o, lse2
    _forward(q, kv, idx, sink, o, lse2, scale, cfg)
    return o, lse2


def _forward(q, kv, idx, sink, o, lse2, scale, cfg, **decode) -> None:
    """The forward's launches into ``o [T,H,D]`` and ``lse2 [T,H]``: ``q [T,H,D]``, the rows of ``kv``
    (``kv.stride(-2)`` apart), ``idx [T,K]`` (unit stride along K), fp32 ``sink``. ``decode`` (the decode step's op,
    :func:`attention_inverse_rope`): ``stride_kvt``, token ``t``'s rows start at ``kv + t stride_kvt``, and ``COS``,
    ``SIN`` ``[T, ROPE]`` fp32 with ``ROPE`` and ``ROUNDED``, the inverse-rope epilogue; none: the training forward's
    kernels, as compiled before the epilogue existed."""
    T, H, D = q.shape
    K = idx.shape[1]
    BH = _head_block(H, cfg["BH"])
    if cfg.get("SPLIT", 1) > 1:
        _split_forward(q, kv, idx, sink, o, lse2, scale, BH, cfg, **decode)
        return
    grid = (triton.cdiv(H, BH), T)
    _fwd_kernel[grid](q, kv, idx, sink, o, lse2, H, K, float(scale) * LOG2E,
                      q.stride(0), q.stride(1), kv.stride(-2), idx.stride(0), o.stride(0), o.stride(1),
                      BH=BH, BK=cfg["BK"], D=D, NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"], **decode,
                      **pdl.launch(q.device))


def _split_forward(q, kv, idx, sink, o, lse2, scale, BH, cfg, stride_kvt=None, **rope) -> None:
    """The forward with each token's rows split ``cfg["SPLIT"]`` ways (whole ``BK`` tiles each): the split
    kernel's fp32 partials, then the combine into ``o`` and ``lse2`` (in place); ``stride_kvt`` and ``rope`` as
    :func:`_forward`'s ``decode`` (the combine writes the output, so it runs the epilogue)."""
    T, H, D = q.shape
    K = idx.shape[1]
    kper = triton.cdiv(triton.cdiv(K, cfg["SPLIT"]), cfg["BK"]) * cfg["BK"]
    split = triton.cdiv(K, kper)
    po = torch.empty(T, split, H, D, dtype=torch.float32, device=q.device)
    pm = torch.empty(T, split, H, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    per_token = {} if stride_kvt is None else dict(stride_kvt=stride_kvt)
    _fwd_split_kernel[(triton.cdiv(H, BH), split, T)](
        q, kv, idx, po, pm, pl, H, K, kper, float(scale) * LOG2E, q.stride(0), q.stride(1), kv.stride(-2),
        idx.stride(0), BH=BH, BK=cfg["BK"], D=D, NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
        **per_token, **pdl.launch(q.device))
    _combine_kernel[(triton.cdiv(H, BH), T)](po, pm, pl, sink, o, lse2, H, split, o.stride(0), o.stride(1),
                                             BH=BH, D=D, num_warps=4, **rope, **pdl.launch(o.device))


def attention_inverse_rope(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                           scale: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.reference.attention.attention_inverse_rope` for a decode step, the same bits as this backend's
    ``sparse_attention_with_sink`` then its ``apply_rope(..., inverse=True)``, in one launch (two where a token's
    rows are split, :func:`fwd_settings`): ``q [B, 1, H, D]`` (bf16/fp16, a power-of-two head dim), ``kv [B, N, D]``
    (each sequence's cache, read where it lies: no batch offsets added to the ids), ``indices [B, 1, K]`` int64 or
    int32 (``-1`` = empty), ``sink [H]``, ``cos``/``sin`` ``[B, 1, r/2]`` (cast to fp32, as ``apply_rope``'s) ->
    ``[B, 1, H, D]``. The kernel that writes the output rotates its last ``r`` channels back in place
    (:func:`_inverse_rope_epilogue`).

    Why: the eager decode step (``kernels.reference.decode._attend``) ran the inverse rotation as a launch of its
    own after every attention layer's: on an H200 the Flash-shaped step's four ``_rope_kernel`` launches took 8.6 us
    at 1 sequence, 12.8 at 64 and 39.9 at 256, on top of the gaps between launches
    (``bench/results/rollout-h200-flash-shaped-triton-profile-linear-group-head.json``); above one sequence the
    batched entry point's id offsets were four launches more a layer. Forward only (no backward: the training
    forward keeps the two ops). Anything else is refused with the reason."""
    op = "attention_inverse_rope"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, kv, sink)):
        raise gpu_common.op_refusal(op, "its inputs require a gradient and the op has no backward (the decode "
                                        "step's only)")
    if (q.dim() != 4 or q.shape[1] != 1 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or indices.dim() != 3
            or indices.shape[:2] != q.shape[:2]):
        raise gpu_common.op_refusal(op, f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)} "
                                        f"(needs one token a sequence: q [B, 1, H, D], kv [B, N, D], indices "
                                        f"[B, 1, K])")
    B, _, H, D = q.shape
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape != (B, 1, half) or not 0 < 2 * half <= D or cos.device != q.device:
        raise gpu_common.op_refusal(op, f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} on {cos.device} for q "
                                        f"{tuple(q.shape)} on {q.device} (needs one angle row a sequence, [B, 1, "
                                        f"r/2] with 0 < r <= D, on q's device)")
    if indices.dtype not in (torch.int32, torch.int64):
        raise gpu_common.op_refusal(op, f"indices are {indices.dtype} (needs int32 or int64 row ids)")
    q, kv = q.contiguous(), (kv if kv.stride(-1) == 1 else kv.contiguous())     # as they come in a decode step
    idx = indices[:, 0] if indices.stride(-1) == 1 else indices[:, 0].contiguous()
    try:                                       # the attention's own refusals: dtypes, head dim, devices, shapes
        _check(q.view(B, H, D), kv[:1].flatten(0, 1), idx, sink)
    except ValueError as e:
        raise gpu_common.op_refusal(op, str(e)) from None
    o = torch.empty_like(q)
    if B == 0:
        return o
    lse2 = torch.empty(B, H, dtype=torch.float32, device=q.device)
    angles = [a.to(torch.float32).reshape(B, half).contiguous() for a in (cos, sin)]
    cfg = fwd_settings(B, H, idx.shape[-1])
    _forward(q.view(B, H, D), kv, idx, sink.to(torch.float32).contiguous(), o.view(B, H, D), lse2, scale, cfg,
             stride_kvt=kv.stride(0), COS=angles[0], SIN=angles[1], ROPE=half, ROUNDED=not gpu_common.interpreting())
    return o


def sparse_attention_bwd(q, kv, idx, sink, o, lse2, do, scale, config: Optional[dict] = None):
    """Backward. Returns ``dq [T,H,D]`` (q.dtype), ``dkv [Tkv,D]`` (kv.dtype), ``dsink [H]`` fp32."""
    cfg = {**BWD_CONFIG, **(config or {})}
    q, kv, o, do = q.contiguous(), kv.contiguous(), o.contiguous(), do.contiguous()
    idx = idx.to(torch.int32).contiguous()
    T, H, D = q.shape
    K = idx.shape[1]
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if T > 0:
        BR = 16
        _delta_kernel[(triton.cdiv(T * H, BR),)](o, do, delta, T * H, D=D, BR=BR, num_warps=4)
        BH = _head_block(H, cfg["BH"])
        pt = torch.empty(T, H, K, dtype=q.dtype, device=q.device)
        dst = torch.empty(T, H, K, dtype=q.dtype, device=q.device)
        _bwd_dq_kernel[(triton.cdiv(H, BH), T)](
            q, kv, idx, do, lse2, delta, dq, pt, dst, H, K, float(scale), float(scale) * LOG2E,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), do.stride(0), do.stride(1),
            BH=BH, BK=cfg["BK"], D=D, NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
        DC = min(cfg["DC"], D)
        _bwd_dkv_kernel[(D // DC, T)](
            q, do, idx, pt, dst, dkv32, H, K,
            q.stride(0), q.stride(1), idx.stride(0), do.stride(0), do.stride(1),
            HP=max(16, triton.next_power_of_2(H)), BK=cfg["BK2"], DC=DC, D=D,
            NUM_STAGES=cfg["num_stages2"], num_warps=cfg["num_warps2"])
    dsink = gpu_common.dsink_from_delta(delta, sink, lse2)
    return dq, dkv32.to(kv.dtype), dsink


# THD and batched entry points over the dsv4_triton custom ops (kernels.gpu_ops: autograd, torch.compile);
# bf16/fp16 with a power-of-two head dim >= 32 run the triton kernels; anything else, e.g. fp32/fp64 or odd
# head dims, is refused with the fix
sparse_attention_with_sink_thd, sparse_attention_with_sink = gpu_common.make_attention_api(
    gpu_ops.TRITON, _check, gpu_common.half_pow2_head_dim, __name__)
