"""Triton grouped GEMM of the routed experts for few rows per expert (a decode step): ``y[rows of e] = x[rows of
e] @ w[e]^T`` for every expert ``e``, its rows ``offs[e-1]:offs[e]`` of ``x`` (sorted by expert).

Why: a decode step of 64 sequences routes 384 (token, expert) pairs over the Flash-shaped model's 32 experts,
about 12 rows each, and reads nearly every expert's weights: the step is a weight-streaming problem. torch's
``_grouped_mm`` (CUTLASS, tiles of many rows) took 2.24 ms for the 8 grouped GEMMs of a step against 1.34 ms for
reading those weights at 4.8 TB/s (``bench/results/rollout-h200-flash-shaped-b64-batched-indexer.json``); at one
sequence a step it runs 32 groups of which 26 are empty. Here a program owns ``BM`` rows of one expert and
``BN`` output columns (:func:`_row_block`: an expert of more rows is several programs, side by side): it reads
that block of the expert's weights once (:func:`launch_settings`: one row block for an expert of average load and
most others), accumulates in fp32 and writes ``y`` in ``x``'s dtype; an expert without rows reads nothing. The
same exact products as ``_grouped_mm``'s, summed in another order (within one rounding of the output dtype).
Triton's CPU interpreter multiplies bf16 tiles wrongly (Triton 3.6), so there the tiles go to fp32 first
(``F32``; tf32 holds every bf16 and fp16 value, the products stay exact); on a GPU they go to the tensor cores as
they are.

Only the rollout engine's decode step calls it (``kernels.reference.slots``), through the triton op table's
extra op ``experts_grouped_mm``: no gradient (inputs that require one are refused). The eager step also puts its
pairs in expert order here (:func:`expert_order`, the extra op ``expert_order``), and runs the same kernel
reading the pairs' tokens and writing the pairs' rows through that order (:func:`experts_gather_mm`,
:func:`experts_scatter_mm`: the gather and the scatter were a copy each), computes the activation between the
two in the second one's operand load at a few rows an expert (:func:`experts_swiglu_scatter_mm`: one launch where
there were two, the same bits) and sums each token's pairs with its shared expert's output in one launch (:func:`moe_combine`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.triton import pdl
from kernels.triton.swiglu import swiglu_tile, weighted_swiglu_launch
from kernels.triton.tickets import counters, last_ticket, release

__all__ = ["expert_order", "expert_order_launch", "experts_grouped_mm", "experts_grouped_mm_launch",
           "experts_gather_mm", "experts_scatter_mm", "experts_swiglu_scatter_mm", "moe_combine", "pairs_sum",
           "launch_settings", "fuses_activation", "routed_blocks"]

# Launch settings: rows x output columns x reduction per step of one program, pipeline stages, warps; one set for
# few rows an expert (a decode step of one sequence: tl.dot's smallest row step), one for many (64 and 256
# sequences of the Flash-shaped model: every expert's rows in one step), chosen by launch_settings. Swept on an
# H200 (python -m bench.kernels_experts_sweep, bench/results/kernels-experts-sweep-h200-rows.json); the wide
# settings' three stages on an H100 (--wide: 385.0 against 401.9 us for the gate and up GEMM at 256 sequences,
# 362.7 against 371.7 at 64, equal outputs; BN 256 no faster; bench/results/kernels-experts-sweep-h100-wide.json).
# SPLIT: shares of K a block's programs take (partials summed, in order, by the block's last program), at most
# FEW_ROWS rows FEW_ROWS_SPLIT of them: at one Flash-shaped sequence the seven experts with rows are 448 programs of
# four stages a GEMM, one and a half waves of the SMs (bench/results/kernels-experts-sweep-h100-one-sequence.json:
# no setting without a split beat 81.1 us for the gate and up GEMMs). FEW_ROWS_SPLIT stays 1 until
# python -m bench.kernels_experts_sweep --sequences 1 --split times the shares on a GPU (with shares, 4 warps spill
# 380 to 476 bytes of registers in ptxas for sm_90, 8 warps none to 32: the sweep times both)
# TIGHT_GRID: the grid's routed row blocks bounded by the experts that can have rows (routed_blocks)
EXPERTS_CONFIG = dict(BM=16, BN=64, BK=128, STAGES=4, WARPS=4, SPLIT=1, TIGHT_GRID=True)
WIDE_CONFIG = dict(BM=64, BN=128, BK=64, STAGES=3, WARPS=8, SPLIT=1,   # at 4 warps ptxas spills 780 bytes of registers
                   TIGHT_GRID=True)
WIDE_FROM = gpu_common.EXPERTS_WIDE_FROM      # mean rows an expert above which WIDE_CONFIG runs (experts_wide)
FEW_ROWS, FEW_ROWS_SPLIT = 16, 1


def launch_settings(rows: int, experts: int) -> dict:
    """The launch settings for ``rows`` (token, expert) pairs over ``experts``: :data:`EXPERTS_CONFIG` up to
    :data:`WIDE_FROM` rows an expert on average, :data:`WIDE_CONFIG` above. Why: a program reads its block of an
    expert's weights once per ``BM`` rows, and with 16-row steps the decode step of 256 Flash-shaped sequences
    (1,536 pairs over 32 experts, 48 rows each) read every expert three times, 5.65 ms of an 8.83 ms step
    (``bench/results/rollout-h200-flash-shaped-triton-eager-b256.json``). In the sweep the wide settings took
    402.1 against 447.0 us for the two GEMMs at 64 sequences (the hot experts' ~20 rows took two 16-row steps)
    and 436.2 against 1,389.2 us at 256 (three steps), with equal outputs, where at one sequence the narrow ones
    are 4% faster (97.8 against 101.7 us). From the shapes alone: a CUDA graph replays one launch whatever the
    routing, and the decode step's shapes are the slot bucket's. At most :data:`FEW_ROWS` rows (one or two
    sequences) a block's programs split ``K`` in :data:`FEW_ROWS_SPLIT` shares."""
    if gpu_common.experts_wide(rows, experts):
        return dict(WIDE_CONFIG)
    return dict(EXPERTS_CONFIG, SPLIT=FEW_ROWS_SPLIT if rows <= FEW_ROWS else 1)


def routed_blocks(rows: int, experts: int, config: dict) -> int:
    """The grid's row blocks for ``rows`` routed (token, expert) pairs over ``experts`` at ``config``'s ``BM``: at
    most ``m + (rows - m) // BM`` blocks have rows, ``m = min(experts, rows)`` (an expert of ``c`` rows has
    ``cdiv(c, BM) = 1 + (c - 1) // BM`` of them, so ``n`` experts with rows at most ``n + (rows - n) // BM``,
    which grows with ``n``, and at most ``m`` experts have rows). Why this bound, not ``experts + cdiv(rows, BM)``
    (``TIGHT_GRID`` off, for the sweep's A/B): at one Flash-shaped sequence (6 pairs over 32 experts) the looser
    one made 27 of every 34 programs of a column block start without rows, each holding a slot of an SM while it
    starts and ends, interleaved with the busy ones; this one makes none. From the shapes alone, as a CUDA graph
    needs."""
    bm = config["BM"]
    if not config.get("TIGHT_GRID", True):
        return experts + triton.cdiv(rows, bm)
    m = min(experts, rows)
    return m + (rows - m) // bm


@triton.jit
def _experts_kernel(X, W, OFFS, Y, ORDER, WS, N, K, TOPK, NE, RR, SH, RB, PART, TICKETS, RW, limit, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, F32: tl.constexpr,
                    GATHER: tl.constexpr = False, SCATTER: tl.constexpr = False, SHARED: tl.constexpr = False,
                    SPLIT: tl.constexpr = 1, SWIGLU: tl.constexpr = False, HAS_LIMIT: tl.constexpr = False,
                    PDL: tl.constexpr = False, EP: tl.constexpr = 32):
    """Program ``(g, j, s)``: columns ``[j BN, (j+1) BN)`` of row block ``g``: ``BM`` rows of one expert
    (:func:`_row_block`; the first ``RB`` blocks are the routed experts', in expert order, those past their last
    block have no rows). ``GATHER``: row ``r`` reads ``X`` row ``ORDER[r] // TOPK`` (the token of the
    pair); ``SCATTER``: it writes ``Y`` row ``ORDER[r]`` (the pair's own row). ``SHARED``: blocks after the
    routed ones, the shared expert ``WS`` on ``SH`` rows after the ``RR`` routed ones, ``BM`` rows a program:
    row ``RR + t`` is token ``t``'s, read from ``X`` row ``t`` (``GATHER``) and written to its own row. ``SPLIT``
    > 1: the program takes share ``s`` of ``K``, writes its rows' partials to ``PART`` ``[rows, SPLIT, N]`` and
    takes a ticket of the block ``(g, j)``; the last program of the block to take one sums the shares in order
    and stores. ``SWIGLU``: ``X`` is ``[gate | up]`` (row stride ``2 K``) and row ``r``'s A tile is its weighted
    SwiGLU at weight ``RW[r]`` and ``limit`` (``HAS_LIMIT``), cast to ``X``'s dtype (:func:`_rows_product`)."""
    pdl.wait_prior(PDL)
    g = tl.program_id(0)
    e, start, end = _row_block(OFFS, g, NE, BM, EP)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N
    wrow = W + e.to(tl.int64) * N * K + cols.to(tl.int64)[:, None] * K
    if SHARED:                                            # the routed experts' RB row blocks (_row_block), then these
        if g >= RB:
            start = RR + (g - RB) * BM
            end = tl.minimum(start + BM, RR + SH)
            wrow = WS + cols.to(tl.int64)[:, None] * K
    if SPLIT == 1:
        for m0 in range(start, end, BM):
            rows = m0 + tl.arange(0, BM)
            rmask = rows < end
            acc = _rows_product(X, wrow, ORDER, rows, rmask, cmask, 0, K, K, TOPK, RR, RW, limit, BM, BN, BK, STAGES,
                                F32, GATHER, SHARED, SWIGLU, HAS_LIMIT)
            _store_rows(Y, ORDER, rows, rmask, cols, cmask, acc, N, RR, SCATTER, SHARED)
    elif end > start:                                     # an expert without rows: no partial, no ticket
        s = tl.program_id(2)
        ks = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK          # whole BK steps a share (the last ones may be short)
        for m0 in range(start, end, BM):
            rows = m0 + tl.arange(0, BM)
            rmask = rows < end
            acc = _rows_product(X, wrow, ORDER, rows, rmask, cmask, s * ks, s * ks + ks, K, TOPK, RR, RW, limit, BM,
                                BN, BK, STAGES, F32, GATHER, SHARED, SWIGLU, HAS_LIMIT)
            tl.store(PART + (rows.to(tl.int64)[:, None] * SPLIT + s) * N + cols[None, :], acc,
                     mask=rmask[:, None] & cmask[None, :])
        block = g * tl.num_programs(1) + tl.program_id(1)
        if last_ticket(TICKETS + block, SPLIT):
            for m0 in range(start, end, BM):
                rows = m0 + tl.arange(0, BM)
                rmask = rows < end
                part = PART + (rows.to(tl.int64)[:, None] * SPLIT) * N + cols[None, :]
                tot = tl.zeros([BM, BN], dtype=tl.float32)
                for i in range(SPLIT):                    # in order: the same sums on every call
                    tot += tl.load(part + i * N, mask=rmask[:, None] & cmask[None, :], other=0.0,
                                   cache_modifier=".cg")
                _store_rows(Y, ORDER, rows, rmask, cols, cmask, tot, N, RR, SCATTER, SHARED)
            release(TICKETS + block)


@triton.jit
def _row_block(OFFS, g, NE, BM: tl.constexpr, EP: tl.constexpr):
    """``(expert, start, end)`` of routed row block ``g``: the experts' rows (expert ``e``'s ``OFFS[e-1]:OFFS[e]``)
    cut in blocks of ``BM``, numbered in expert order. A block past the last has no rows (``start == end``).
    Why blocks, not one program an expert: routing in a trained model is skewed, and a program that looped over a
    hot expert's row steps one after another finished long after the others, which read their weights once
    (routed rows ``R`` make at most ``m + (R - m) // BM`` blocks, ``m = min(NE, R)``, :func:`routed_blocks`: a
    grid fixed by the shapes, as a CUDA graph needs). Each program counts the blocks of the ``NE`` experts
    (``EP``, a power of two, at least ``NE``): one vector load of the end rows, from L2."""
    ids = tl.arange(0, EP)
    ends = tl.load(OFFS + ids, mask=ids < NE, other=0)
    starts = tl.load(OFFS + ids - 1, mask=(ids > 0) & (ids < NE), other=0)
    blocks = (ends - starts + BM - 1) // BM
    upto = tl.cumsum(blocks, axis=0)                       # blocks of experts 0..e
    e = tl.sum((upto <= g).to(tl.int32), axis=0)           # the expert whose blocks hold g (NE: past the last)
    mine = ids == e
    first = tl.sum(tl.where(mine, upto - blocks, 0), axis=0)
    start = tl.sum(tl.where(mine, starts, 0), axis=0) + (g - first) * BM
    end = tl.minimum(start + BM, tl.sum(tl.where(mine, ends, 0), axis=0))
    return e, start, tl.maximum(end, start)


@triton.jit
def _rows_product(X, wrow, ORDER, rows, rmask, cmask, k_from, k_to, K, TOPK, RR, RW, limit, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, F32: tl.constexpr, GATHER: tl.constexpr,
                  SHARED: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """``[BM, BN]`` fp32: rows ``rows`` of ``X`` (through ``ORDER`` with ``GATHER``) times the weight rows at ``wrow``
    over columns ``[k_from, k_to)`` of ``K``. ``SWIGLU``: row ``r`` of the A operand is ``swiglu_tile`` of ``X``'s
    gate and up halves at ``RW[r]``, cast to ``X``'s dtype: the bits ``_swiglu_fwd_kernel`` stores."""
    src = rows.to(tl.int64)
    if GATHER:
        src = tl.load(ORDER + rows, mask=rmask & (rows < RR), other=0) // TOPK
        if SHARED:
            src = tl.where(rows >= RR, rows.to(tl.int64) - RR, src)
    xrow = X + src[:, None] * (2 * K if SWIGLU else K)
    if SWIGLU:                   # the rows' routing weights (the shared expert's rows: ones), read once
        rw = tl.load(RW + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(k_from, k_to, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        if SWIGLU:
            x = _swiglu_rows(xrow, k, rmask[:, None] & kmask[None, :], K, rw, limit, HAS_LIMIT)
            x = x.to(X.dtype.element_ty)
        else:
            x = tl.load(xrow + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(wrow + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        if F32:                  # the interpreter: tf32 holds every bf16 / fp16 value, the products are exact
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
    return acc


@triton.jit
def _swiglu_rows(xrow, k, mask, K, rw, limit, HAS_LIMIT: tl.constexpr):
    """fp32 ``swiglu_tile`` of the rows at ``xrow``: their gate columns ``k`` and up columns ``K + k`` (masked: 0,
    whose SwiGLU is 0 at any weight), weights ``rw [rows, 1]``. The up tile's offsets are one ``[1, BK]`` vector
    added to the rows' pointers: a second ``[BM, BK]`` tensor of pointers made ptxas spill at the narrow settings
    (4 bytes, 128 registers, compiled as the runtime specializes the decode step's aligned shapes)."""
    g0 = tl.load(xrow + k[None, :], mask=mask, other=0.0).to(tl.float32)
    u0 = tl.load(xrow + (K + k)[None, :], mask=mask, other=0.0).to(tl.float32)
    return swiglu_tile(g0, u0, rw, limit, HAS_LIMIT)


@triton.jit
def _store_rows(Y, ORDER, rows, rmask, cols, cmask, acc, N, RR, SCATTER: tl.constexpr, SHARED: tl.constexpr):
    """``acc`` into ``Y``'s rows (through ``ORDER`` with ``SCATTER``) in ``Y``'s dtype."""
    dst = rows.to(tl.int64)
    if SCATTER:                  # read after the loop: live across it, the indices spilled (WIDE_CONFIG)
        dst = tl.load(ORDER + rows, mask=rmask & (rows < RR), other=0)
        if SHARED:
            dst = tl.where(rows >= RR, rows.to(tl.int64), dst)
    tl.store(Y + dst[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def experts_grouped_mm_launch(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config=None, order=None,
                              topk: int = 0, scatter: bool = False, shared=None, weights=None,
                              limit: float = 0.0) -> torch.Tensor:
    """The kernel on checked, contiguous inputs: ``x [R, K]``, ``w [E, N, K]``, ``offs [E]`` int32 -> ``[R, N]``;
    ``config`` overrides keys of :func:`launch_settings` (the sweep's). With ``order [R]`` int64 (the pairs in
    expert order) and ``topk``: ``x`` is the tokens ``[R / topk, K]``, row ``r`` read from ``order[r] // topk``;
    with ``order`` and ``scatter``: row ``r`` written to ``order[r]``. ``shared [N, K]`` (with ``order``): the
    shared expert on every token as well, its rows after the routed ones (``[R + T, N]``; with ``scatter``
    ``x`` holds them too). ``weights`` (fp32, one a row of ``x``): ``x`` is ``[gate | up]`` ``[rows, 2K]`` and
    the GEMM reads its weighted SwiGLU at ``limit`` (clamped where ``limit > 0``), cast to ``x``'s dtype."""
    K = x.shape[1] // (2 if weights is not None else 1)
    R = order.shape[0] if order is not None else x.shape[0]
    E, N, _ = w.shape
    T = 0 if shared is None else (x.shape[0] if topk > 0 else x.shape[0] - R)
    c = {**launch_settings(R + T, E + (shared is not None)), **(config or {})}
    y = torch.empty(R + T, N, dtype=x.dtype, device=x.device)
    split = max(1, int(c.get("SPLIT", 1)))
    routed = routed_blocks(R, E, c)
    groups = routed + (0 if shared is None else max(1, triton.cdiv(T, c["BM"])))    # the shared expert's
    blocks = groups * triton.cdiv(N, c["BN"])
    if split > 1:
        part = torch.empty(R + T, split, N, dtype=torch.float32, device=x.device)
        tickets = counters(x.device, blocks)
    else:
        part = tickets = offs                        # unused (SPLIT 1)
    if (R or T) and E:
        _experts_kernel[(groups, triton.cdiv(N, c["BN"]), split)](
            x, w, offs, y, offs if order is None else order, w if shared is None else shared, N, K, max(topk, 1), E,
            R, T, routed, part, tickets, offs if weights is None else weights, float(limit), BM=c["BM"], BN=c["BN"],
            BK=c["BK"], STAGES=c["STAGES"], F32=gpu_common.interpreting(), GATHER=topk > 0, SCATTER=bool(scatter),
            SHARED=shared is not None, SPLIT=split, SWIGLU=weights is not None, HAS_LIMIT=limit > 0,
            EP=max(triton.next_power_of_2(E), 2), num_warps=c["WARPS"], **pdl.launch(x.device))
    return y


def _check_pairs(op: str, x, w, offs, order, rows: int, halves: int = 1):
    """The checks of the pair GEMMs (:func:`experts_gather_mm`, :func:`experts_scatter_mm`,
    :func:`experts_swiglu_scatter_mm`: ``halves`` 2, ``x`` the gate and up halves of ``K`` columns each)."""
    for t, name in ((x, "x"), (w, "w")):
        gpu_common.check_op_input(op, t, name, dtypes=(torch.bfloat16, torch.float16))
    if (x.dim() != 2 or w.dim() != 3 or halves * w.shape[2] != x.shape[1] or w.dtype != x.dtype
            or order.dim() != 1 or order.dtype != torch.int64 or order.shape[0] != rows):
        width = "2K" if halves == 2 else "K"
        raise gpu_common.op_refusal(op, f"x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, order "
                                        f"{tuple(order.shape)} {order.dtype} (needs x [rows, {width}], w [E, N, K] "
                                        f"of one dtype and int64 order [{rows}])")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or offs.dtype != torch.int32:
        raise gpu_common.op_refusal(op, f"offs {tuple(offs.shape)} {offs.dtype} (needs [E] int32 end rows)")
    if x.requires_grad or w.requires_grad:
        raise gpu_common.op_refusal(op, "inputs that require a gradient (the kernel has no backward: decode only)")


def _check_shared(op: str, shared, w) -> None:
    if shared is not None and (shared.shape != w.shape[1:] or shared.dtype != w.dtype):
        raise gpu_common.op_refusal(op, f"shared expert {tuple(shared.shape)} {shared.dtype} (needs one expert's "
                                        f"{tuple(w.shape[1:])} {w.dtype})")


def experts_gather_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor,
                      topk: int, shared=None) -> torch.Tensor:
    """``experts_grouped_mm(x[order // topk], w, offs)`` without the gather's copy: ``x [T, K]`` the tokens,
    ``order [T * topk]`` int64 their (token, expert) pairs in expert order (``expert_order``'s) -> ``[T * topk,
    N]`` in expert order; with ``shared [N, K]`` (the shared expert) also ``x @ shared^T``, rows ``T * topk + t``
    (``[T * topk + T, N]``). The eager decode step's first expert GEMM (``kernels.reference.slots``: the table's
    extra op ``experts_gather_mm``); its torch contract is ``kernels.reference.slots.gather_grouped_mm``."""
    _check_pairs("experts_gather_mm", x, w, offs, order, x.shape[0] * topk if x.dim() == 2 else -1)
    _check_shared("experts_gather_mm", shared, w)
    return experts_grouped_mm_launch(x.contiguous(), w.contiguous(), offs.contiguous(), order=order.contiguous(),
                                     topk=int(topk), shared=None if shared is None else shared.contiguous())


def experts_scatter_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor,
                       shared=None) -> torch.Tensor:
    """``experts_grouped_mm(x, w, offs)`` with row ``r`` written to row ``order[r]``: ``x [R, K]`` rows in expert
    order -> ``[R, N]`` in the pairs' own order (token-major), without the scatter's copy; with ``shared [N, K]``
    ``x`` holds ``T`` rows more (``[R + T, K]``, the shared expert's), which go through it to rows ``R + t``. The
    eager decode step's second expert GEMM (the table's extra op ``experts_scatter_mm``); its torch contract is
    ``kernels.reference.slots.scatter_grouped_mm``."""
    rows = x.shape[0] if x.dim() == 2 else -1
    _check_pairs("experts_scatter_mm", x, w, offs, order, rows if shared is None else order.shape[0])
    _check_shared("experts_scatter_mm", shared, w)
    if shared is not None and rows < order.shape[0]:
        raise gpu_common.op_refusal("experts_scatter_mm", f"x {tuple(x.shape)} for {order.shape[0]} pairs and a "
                                                          f"shared expert (needs the pairs' rows, then the tokens')")
    return experts_grouped_mm_launch(x.contiguous(), w.contiguous(), offs.contiguous(), order=order.contiguous(),
                                     scatter=True, shared=None if shared is None else shared.contiguous())


def experts_swiglu_scatter_mm(h: torch.Tensor, weights: torch.Tensor, limit: float, w: torch.Tensor,
                              offs: torch.Tensor, order: torch.Tensor, shared=None) -> torch.Tensor:
    """``experts_scatter_mm(weighted_swiglu(h, weights, limit, h.dtype), w, offs, order, shared)`` in one launch,
    the same bits: the GEMM computes each A tile from ``h = [gate | up]`` ``[R (+ T), 2K]`` (the first GEMM's
    output, ``experts_gather_mm``'s) and the rows' fp32 routing weights ``weights [R (+ T)]`` (``expert_order``'s,
    the shared expert's ones after the pairs') with the activation kernel's own jit math
    (``kernels.triton.swiglu.swiglu_tile``), casts it to ``h``'s dtype as that kernel stores it, and multiplies.
    Why: on an H200 the separate activation took 12.4 us of a Flash-shaped 4-layer step at 1 sequence, 21.2 at 64
    and 29.6 at 256, four launches a step, plus the gap between launches
    (``bench/results/rollout-h200-flash-shaped-triton-profile-linear-group-head.json``), and its ``[rows, K]``
    output went to memory and back. The cost: each of an expert's ``N / BN`` column blocks computes its rows'
    activation again (32 times at 256 Flash-shaped sequences, 64 at one) and reads ``h`` (twice ``a``) from L2.
    At a few rows an expert the weight stream hides that; at many it does not: on an H100 the Flash-shaped step
    took 1.63 ms with the one launch and 1.64 without at one sequence, but 5.81 with and 5.08 without at 256
    (``bench/results/rollout-h100-flash-shaped-triton-ablate-fusions.json``). So the one launch runs where
    :func:`launch_settings` picks the few-rows settings (:data:`WIDE_FROM` rows an expert or fewer, on average),
    and above it the activation's own kernel (``kernels.triton.swiglu``) and then :func:`experts_scatter_mm`'s
    GEMM, the same bits, chosen by the shapes alone (a CUDA graph holds one plan). The eager decode step's second
    expert GEMM where the table has this op (``kernels.reference.slots._grouped``: the table's extra op
    ``experts_swiglu_scatter_mm``); its torch contract is ``kernels.reference.slots.swiglu_scatter_grouped_mm``.
    Decode only (no gradient); anything else is refused with the reason."""
    op = "experts_swiglu_scatter_mm"
    rows = h.shape[0] if h.dim() == 2 else -1
    _check_pairs(op, h, w, offs, order, rows if shared is None else order.shape[0], halves=2)
    _check_shared(op, shared, w)
    if shared is not None and rows < order.shape[0]:
        raise gpu_common.op_refusal(op, f"h {tuple(h.shape)} for {order.shape[0]} pairs and a shared expert (needs "
                                        f"the pairs' rows, then the tokens')")
    gpu_common.check_op_input(op, weights, "weights", dtypes=(torch.float32,))
    if weights.shape != (rows,) or weights.requires_grad:
        raise gpu_common.op_refusal(op, f"weights {tuple(weights.shape)} {weights.dtype}"
                                        f"{' that require a gradient' if weights.requires_grad else ''} (needs fp32 "
                                        f"[{rows}], one a row of h, no gradient: decode only)")
    h, w, offs, order, weights = h.contiguous(), w.contiguous(), offs.contiguous(), order.contiguous(), \
        weights.contiguous()
    shared = None if shared is None else shared.contiguous()
    if fuses_activation(rows, w.shape[0] + (shared is not None)):
        return experts_grouped_mm_launch(h, w, offs, order=order, scatter=True, shared=shared, weights=weights,
                                         limit=float(limit))
    a = weighted_swiglu_launch(h, weights, float(limit), h.dtype)
    return experts_grouped_mm_launch(a, w, offs, order=order, scatter=True, shared=shared)


def fuses_activation(rows: int, experts: int) -> bool:
    """Whether :func:`experts_swiglu_scatter_mm` computes the activation in its GEMM's operand load for ``rows``
    rows over ``experts`` (the shared expert counted): where :func:`launch_settings` picks the few-rows settings."""
    return not gpu_common.experts_wide(rows, experts)


# ------------------------------------------------------------------ the pairs' sum with the shared expert
@triton.jit
def pairs_sum(PAIRS, SHARED, t64, cols, mask, D, TOPK: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """``[BT, BD]`` fp32: tokens ``t64``' ``TOPK`` pairs' rows over columns ``cols`` summed one after another, plus
    their shared expert's row (``mask [BT, BD]``): the MoE's output before its one rounding. Shared by
    :func:`_combine_kernel` and ``kernels.triton.mhc``'s post of the pairs (``moe_combine_post``), so both sum in
    one order."""
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(PAIRS + (t64[:, None] * TOPK + j) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return acc + tl.load(SHARED + t64[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _combine_kernel(PAIRS, SHARED, Y, D, TOPK: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(t, j)``: columns ``[j BD, (j+1) BD)`` of token ``t``: its ``TOPK`` pairs' rows summed in fp32
    one after another, plus the shared expert's row, cast once (:func:`pairs_sum`)."""
    pdl.wait_prior(PDL)
    t = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (cols < D)[None, :]
    acc = pairs_sum(PAIRS, SHARED, t, cols, mask, D, TOPK, 1, BD)
    tl.store(Y + t[:, None] * D + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)


COMBINE_COLUMNS = 1024         # columns a program of the pairs' sum adds (Flash's 4,096: four programs a token)


def moe_combine(pairs: torch.Tensor, shared: torch.Tensor, topk: int) -> torch.Tensor:
    """``(pairs.view(T, topk, D).float().sum(1) + shared.float()).to(shared.dtype)``: a token's routed experts'
    outputs (``pairs [T * topk, D]`` token-major, ``experts_scatter_mm``'s) and its shared expert's (``shared
    [T, D]``) in one launch, where torch's is a cast, a sum, a cast, an add and a cast. The eager decode step's
    MoE output (the table's extra op ``moe_combine``); its torch contract is ``kernels.reference.slots.
    combine_pairs``. Anything else is refused with the reason."""
    op = "moe_combine"
    for t, name in ((pairs, "pairs"), (shared, "shared")):
        gpu_common.check_op_input(op, t, name)
    if pairs.dim() != 2 or shared.dim() != 2 or topk < 1 or pairs.shape != (shared.shape[0] * topk, shared.shape[1]):
        raise gpu_common.op_refusal(op, f"pairs {tuple(pairs.shape)} with shared {tuple(shared.shape)} and top-{topk} "
                                        f"(needs pairs [T * topk, D], shared [T, D])")
    T, D = shared.shape
    y = torch.empty_like(shared)
    if T:
        _combine_kernel[(T, triton.cdiv(D, COMBINE_COLUMNS))](pairs.contiguous(), shared.contiguous(), y, D,
                                                           TOPK=int(topk), BD=min(COMBINE_COLUMNS,
                                                                                  triton.next_power_of_2(D)),
                                                           num_warps=4, **pdl.launch(pairs.device))
    return y


@gpu_ops.traceable
def experts_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w.transpose(1, 2), offs=offs)`` for rows sorted by expert: ``x [R, K]`` and
    ``w [E, N, K]`` (bf16 or fp16, one dtype; CUDA), ``offs [E]`` each expert's end row (int32, non-decreasing,
    the last ``R``) -> ``[R, N]`` in ``x``'s dtype. Anything else is refused with the reason."""
    op = "experts_grouped_mm"
    for t, name in ((x, "x"), (w, "w")):
        gpu_common.check_op_input(op, t, name, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or w.dtype != x.dtype:
        raise gpu_common.op_refusal(op, f"x {tuple(x.shape)} {x.dtype} with w {tuple(w.shape)} {w.dtype} (needs "
                                        f"x [R, K] and w [E, N, K] of one dtype)")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or offs.dtype != torch.int32:
        raise gpu_common.op_refusal(op, f"offs {tuple(offs.shape)} {offs.dtype} (needs [E] int32 end rows)")
    if x.requires_grad or w.requires_grad:
        raise gpu_common.op_refusal(op, "inputs that require a gradient (the kernel has no backward: decode only)")
    return gpu_ops.TRITON.experts_grouped_mm(x.contiguous(), w.contiguous(), offs.contiguous())


# ------------------------------------------------------------------ the pairs' expert order
ORDER_ROWS = 1024              # pairs a loop step of the ordering kernel reads (1-D: ids, compares, a running sum)
MAX_ORDER_EXPERTS = 1024       # experts at most (one program each; the tests' largest, 4x V4-Flash's)


@triton.jit
def _order_kernel(FLAT, ORDER, ENDS, WIN, WOUT, R, TAIL, BR: tl.constexpr, WEIGHTS: tl.constexpr = False,
                  PDL: tl.constexpr = False):
    """Program ``e``: count the pairs of experts below ``e`` (its first row) and its own (its end row), then place
    each of its pairs after its earlier ones (the stable sort's position), ``BR`` pairs a step. ``WEIGHTS``: each
    pair's weight ``WIN`` goes to the same place of ``WOUT``, and program 0 writes ``TAIL`` ones after them."""
    pdl.wait_prior(PDL)
    e = tl.program_id(0)
    below = tl.zeros([BR], dtype=tl.int32)
    mine = tl.zeros([BR], dtype=tl.int32)
    for r0 in range(0, R, BR):
        rows = r0 + tl.arange(0, BR)
        ids = tl.load(FLAT + rows, mask=rows < R, other=-1)
        below += ((ids < e) & (rows < R)).to(tl.int32)
        mine += (ids == e).to(tl.int32)
    seen = tl.sum(below, axis=0)
    tl.store(ENDS + e, seen + tl.sum(mine, axis=0))
    for r0 in range(0, R, BR):
        rows = r0 + tl.arange(0, BR)
        hit = (tl.load(FLAT + rows, mask=rows < R, other=-1) == e).to(tl.int32)
        run = tl.cumsum(hit, axis=0)
        tl.store(ORDER + seen + run - 1, rows.to(tl.int64), mask=hit > 0)
        if WEIGHTS:
            tl.store(WOUT + seen + run - 1, tl.load(WIN + rows, mask=hit > 0, other=0.0), mask=hit > 0)
        seen += tl.sum(hit, axis=0)
    if WEIGHTS:
        if e == 0:
            for t0 in range(0, TAIL, BR):
                t = t0 + tl.arange(0, BR)
                tl.store(WOUT + R + t, tl.full([BR], 1.0, tl.float32), mask=t < TAIL)


def expert_order_launch(flat: torch.Tensor, n_experts: int, weights=None, tail: int = 0):
    """The kernel on checked inputs: ``flat [R]`` int64 expert ids in ``[0, n_experts)`` -> ``(order [R] int64,
    ends [n_experts] int32)``; with ``weights [R]`` fp32 also the weights in that order and ``tail`` ones
    (``[R + tail]``)."""
    R = flat.shape[0]
    order = torch.empty(R, dtype=torch.long, device=flat.device)
    ends = torch.empty(n_experts, dtype=torch.int32, device=flat.device)
    wout = None if weights is None else torch.empty(R + tail, dtype=torch.float32, device=flat.device)
    _order_kernel[(n_experts,)](flat, order, ends, ends if weights is None else weights, ends if wout is None else wout,
                                R, int(tail), BR=ORDER_ROWS, WEIGHTS=weights is not None, num_warps=4,
                                **pdl.launch(flat.device))
    return (order, ends) if weights is None else (order, ends, wout)


def expert_order(flat: torch.Tensor, n_experts: int, weights=None, tail: int = 0):
    """:func:`kernels.reference.slots.expert_order` in one launch: ``(order, ends)`` of the (token, expert) pairs'
    expert ids ``flat [R]`` (int64, CUDA): ``order`` the stable sort by expert (each expert's pairs in their own
    order), ``ends [n_experts]`` int32 each expert's end row in it. The same integers. Why: the decode step's
    eager MoE counted its pairs in about fifteen small kernels a layer (comparisons, casts, three sums, two
    running sums, an index copy), each a launch of its own in the step's CUDA graph; here one program an expert
    reads the ids twice (from L2: 12 KB at 256 Flash-shaped sequences). A first version, one program for all
    experts with a ``[64 pairs, experts]`` one-hot tile a step, took 31 us at 256 sequences
    (``bench/results/rollout-h200-flash-shaped-triton-eager-route-order.json``): its steps ran one after
    another. Ids outside ``[0, n_experts)`` are not checked (a host sync): the routing makes them. With ``weights
    [R]`` fp32 (the pairs' routing weights) also those weights in that order followed by ``tail`` ones (the shared
    expert's rows): a third output ``[R + tail]``, where torch took a gather and a concatenation. Anything else is
    refused with the reason."""
    op = "expert_order"
    if not flat.is_cuda and not gpu_common.interpreting():
        raise gpu_common.op_refusal(op, f"ids on {flat.device}, the kernel runs on CUDA tensors (or "
                                        f"TRITON_INTERPRET=1 for CPU debugging)")
    if flat.dtype != torch.int64 or flat.dim() != 1 or not 1 <= n_experts <= MAX_ORDER_EXPERTS:
        raise gpu_common.op_refusal(op, f"ids {tuple(flat.shape)} {flat.dtype} over {n_experts} experts (needs int64 "
                                        f"ids [R] over 1 to {MAX_ORDER_EXPERTS} experts)")
    if weights is not None and (weights.shape != flat.shape or weights.dtype != torch.float32 or tail < 0):
        raise gpu_common.op_refusal(op, f"weights {tuple(weights.shape)} {weights.dtype} with tail {tail} (needs "
                                        f"fp32 weights [{flat.shape[0]}], tail >= 0)")
    return expert_order_launch(flat.contiguous(), n_experts, None if weights is None else weights.contiguous(),
                               int(tail))
