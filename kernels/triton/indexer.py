"""Triton Lightning-Indexer scores and top-k (reference_system.md §1.6; ``kernels.reference.indexer``).

    I[t, j] = sum_h w[t, h] * relu(<q[t, h, :], k[j, :]>)        fp32 accumulation, fp32 output

THD layout: ``q [T, H, D]``, ``k [N, D]``, ``w [T, H]``; optional per-query key ranges
``ks [T]``, ``ke [T]`` (int32; visible keys ``ks[t] <= j < ke[t]``, e.g. causal ``ke = (p+1)//4``
or segment-local ranges of a packed THD batch). Scores outside the range are ``-inf`` and a
``[BT, BN]`` tile that no query of the block can see is not computed at all.

One program = ``BT`` queries x ``BN`` keys; the loop over heads does one ``[BT, D] x [D, BN]`` dot per
head, applies ReLU and the weight, and accumulates in fp32 registers. A few queries a sequence (a decode
step's one) take :func:`_indexer_heads_kernel` instead: one query's heads are the rows of a single ``[H, D] x
[D, BN]`` dot, where the loop would run its ``H`` dots one after another on a tile of one real row (26 us a
call at one or 64 sequences in a decode step on an H100,
``bench/results/rollout-h100-flash-shaped-triton-eager-hc-post-pre.json``). Top-k is the reference's stable
top-k (``kernels.reference.topk``) on the fp32 scores (``-1`` where fewer entries are visible).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.triton import pdl

__all__ = ["indexer_scores", "indexer_scores_thd", "indexer_scores_launch", "indexer_topk", "INDEXER_CONFIG"]

# heads_*: the few-query kernel's (below heads_below queries a sequence; 0: never, bench.kernels_decode_sweep's
# baseline); 2.59 us a decode step's call on an H100 where the head loop took 26.31
# (bench/results/rollout-h100-flash-shaped-triton-profile-linear-group.json); the settings are not swept yet
INDEXER_CONFIG = dict(BT=64, BN=128, num_warps=4, num_stages=3, heads_BN=64, heads_warps=4, heads_below=16)


@triton.jit(do_not_specialize=["T", "N", "stride_ot", "stride_ob"])
def _indexer_kernel(Q, K, W, KS, KE, OUT,
                    T, N, H,
                    stride_qt, stride_qh, stride_kn, stride_wt, stride_ot,
                    stride_qb, stride_kb, stride_wb, stride_ob,
                    HAS_RANGE: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                    PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)            # the sequence of a batched call (0 for THD)
    Q += pid_b * stride_qb
    K += pid_b * stride_kb
    W += pid_b * stride_wb
    OUT += pid_b * stride_ob
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tmask = offs_t < T
    nmask = offs_n < N
    out_ptr = OUT + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    omask = tmask[:, None] & nmask[None, :]

    run = True
    if HAS_RANGE:
        ks = tl.load(KS + offs_t, mask=tmask, other=0)
        ke = tl.load(KE + offs_t, mask=tmask, other=0)
        lo = tl.min(tl.where(tmask, ks, N), 0)
        hi = tl.max(tl.where(tmask, ke, 0), 0)
        run = (pid_n * BN < hi) & (pid_n * BN + BN > lo)
    if run:
        offs_d = tl.arange(0, D)
        k = tl.load(K + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = tl.zeros([BT, BN], dtype=tl.float32)
        q_base = Q + offs_t.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
        w_base = W + offs_t.to(tl.int64) * stride_wt
        for h in tl.range(0, H, num_stages=NUM_STAGES):
            qh = tl.load(q_base + h * stride_qh, mask=tmask[:, None], other=0.0)
            wh = tl.load(w_base + h, mask=tmask, other=0.0).to(tl.float32)
            s = tl.dot(qh, tl.trans(k), input_precision=PRECISION)
            acc += tl.maximum(s, 0.0) * wh[:, None]
        if HAS_RANGE:
            vis = (offs_n[None, :] >= ks[:, None]) & (offs_n[None, :] < ke[:, None])
            acc = tl.where(vis, acc, float("-inf"))
        tl.store(out_ptr, acc, mask=omask)
    else:
        tl.store(out_ptr, tl.full([BT, BN], float("-inf"), tl.float32), mask=omask)


@triton.jit(do_not_specialize=["T", "N", "stride_ot", "stride_ob"])   # the output's strides are key counts
def _indexer_heads_kernel(Q, K, W, OUT, T, N, H,
                          stride_qt, stride_qh, stride_kn, stride_wt, stride_ot,
                          stride_qb, stride_kb, stride_wb, stride_ob,
                          BH: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
                          PDL: tl.constexpr = False):
    """One query's scores over ``BN`` keys: its ``H`` heads (padded to ``BH``, at least a dot's 16 rows) times the
    keys in one dot, then ReLU, the heads' weights and their sum. Grid: (key blocks, queries, sequences)."""
    pdl.wait_prior(PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_h = tl.arange(0, BH)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    hmask = offs_h < H
    nmask = offs_n < N
    q = tl.load(Q + pid_b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None], other=0.0)
    k = tl.load(K + pid_b * stride_kb + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                mask=nmask[:, None], other=0.0)
    w = tl.load(W + pid_b * stride_wb + t * stride_wt + offs_h, mask=hmask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                   # [BH, BN]: a head a row
    acc = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
    tl.store(OUT + pid_b * stride_ob + t * stride_ot + offs_n, acc, mask=nmask)


def heads_kernel_takes(T: int, has_range: bool, below: int) -> bool:
    """Whether a call of ``T`` queries a sequence runs :func:`_indexer_heads_kernel` (no key ranges, fewer than
    ``below`` queries, ``heads_below`` of the launch settings: the head loop's smallest query tile, a decode step)
    rather than the head loop."""
    return not has_range and T < below


@gpu_ops.traceable
def indexer_scores_thd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                       ks: Optional[torch.Tensor] = None, ke: Optional[torch.Tensor] = None,
                       config: Optional[dict] = None) -> torch.Tensor:
    """``q [T,H,D]``, ``k [N,D]``, ``w [T,H]`` (+ optional ``ks, ke [T]``) -> fp32 scores ``[T, N]``.

    The checks run here, then the ``dsv4_triton::indexer_scores`` custom op (``kernels.gpu_ops``) launches
    :func:`indexer_scores_launch`; a ``config`` (launch settings, bench.py) calls the launcher directly."""
    T, H, D = q.shape
    if k.shape[1] != D or w.shape != (T, H):
        raise ValueError(f"expected q [T,H,D], k [N,D], w [T,H]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(w.shape)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"indexer head dim {D} must be a power of two >= 16")
    if (ks is None) != (ke is None):
        raise ValueError("give both ks and ke, or neither")
    if not gpu_common.interpreting() and not q.is_cuda:
        raise ValueError("the triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU debugging)")
    gpu_common.refuse_grad("triton", q, k, w)
    if config is not None:
        return indexer_scores_launch(q, k, w, ks, ke, config)
    return gpu_ops.TRITON.indexer_scores(q, k, w, ks, ke)


def indexer_scores_launch(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: Optional[torch.Tensor],
                          ke: Optional[torch.Tensor], config: Optional[dict] = None) -> torch.Tensor:
    """The launcher of :func:`indexer_scores_thd` (inputs already checked), and of :func:`indexer_scores`: a
    batch of sequences (``q [B,S,H,D]``, ``k [B,N,D]``, ``w [B,S,H]``, no ranges) is one launch with the batch
    as the grid's third dimension (a decode step of 64 sequences was 64 launches, 2 ms on an H200)."""
    batched = q.dim() == 4
    B = q.shape[0] if batched else 1
    T, H, D = q.shape[-3:]
    N = k.shape[-2]
    cfg = {**INDEXER_CONFIG, **(config or {})}
    dt = torch.promote_types(q.dtype, k.dtype)
    q, k = q.to(dt).contiguous(), k.to(dt).contiguous()
    w = w.contiguous()
    out = torch.empty(*q.shape[:-3], T, N, dtype=torch.float32, device=q.device)
    if T == 0 or N == 0 or B == 0:
        return out
    if batched and ks is not None:
        raise ValueError("indexer_scores_launch: key ranges are for THD inputs, not a batch")
    has_range = ks is not None
    if has_range:
        ks = ks.to(torch.int32).contiguous()
        ke = ke.to(torch.int32).contiguous()
    else:
        ks = ke = torch.empty(1, dtype=torch.int32, device=q.device)
    precision = "ieee" if dt == torch.float32 or dt == torch.float64 else "tf32"
    if dt == torch.float64:
        q, k = q.float(), k.float()
    batch_strides = (q.stride(0), k.stride(0), w.stride(0), out.stride(0)) if batched else (0, 0, 0, 0)
    if heads_kernel_takes(T, has_range, cfg["heads_below"]):
        bn = cfg["heads_BN"]
        _indexer_heads_kernel[(triton.cdiv(N, bn), T, B)](
            q, k, w, out, T, N, H, q.stride(-3), q.stride(-2), k.stride(-2), w.stride(-2), out.stride(-2),
            *batch_strides, BH=max(16, triton.next_power_of_2(H)), BN=bn, D=D, PRECISION=precision,
            num_warps=cfg["heads_warps"], **pdl.launch(q.device))
        return out
    bt = cfg["BT"] if T > 16 else 16                # a few query rows: the smallest dot tile
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(T, bt), B)
    _indexer_kernel[grid](q, k, w, ks, ke, out, T, N, H,
                          q.stride(-3), q.stride(-2), k.stride(-2), w.stride(-2), out.stride(-2), *batch_strides,
                          HAS_RANGE=has_range, BT=bt, BN=cfg["BN"], D=D, PRECISION=precision,
                          NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
    return out


@gpu_ops.traceable
def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.reference.indexer.indexer_scores``: ``q [B,S,H,D]``, ``k [B,N,D]``,
    ``w [B,S,H]`` -> ``[B,S,N]``, computed with fp32 accumulation and returned in fp32: one launch for the batch."""
    B, S, H, D = q.shape
    if k.dim() != 3 or k.shape[0] != B or k.shape[2] != D or tuple(w.shape) != (B, S, H):
        raise ValueError(f"expected q [B,S,H,D], k [B,N,D], w [B,S,H]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(w.shape)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"indexer head dim {D} must be a power of two >= 16")
    if not gpu_common.interpreting() and not q.is_cuda:
        raise ValueError("the triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU debugging)")
    gpu_common.refuse_grad("triton", q, k, w)
    return gpu_ops.TRITON.indexer_scores(q, k, w, None, None)


indexer_topk = gpu_common.local_copy(gpu_common.indexer_topk, __name__)  # the stable top-k, shared by the GPU backends
