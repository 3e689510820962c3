"""Triton: one decode-step input projected by up to eight weights in one launch (``linear_group``; its torch
contract is ``kernels.reference.linear_group.linear_group``).

Why: at a few tokens the eager decode step's small projections are latency, not bytes: on an H100 at one
sequence, a layer's ``wq_a``, ``wkv`` and its compressors' ``wkv`` / ``wgate`` ran as 14 cuBLAS GEMMs a
Flash-shaped step at about 5 us each, plus 19 split-K reductions (103 us together for about 80 MB;
``bench/results/rollout-h100-flash-shaped-triton-eager-hc-post-pre.json``). Here the weights' row blocks
are one grid: program ``p`` finds its weight by the blocks before it (``E0 <= ... <= E7``, fixed at compile
time) and computes ``x [M, K] @ W[rows]^T`` for every token, ``BK`` columns a step, accumulating in fp32, then
stores in its output's dtype (fp32, or the input's). Up to the rows :func:`token_settings` takes (64); more go to
one cuBLAS GEMM a weight (the torch contract), whose tiles serve many rows. No gradient (a decode step).
``bench.kernels_decode_sweep`` times it beside the GEMMs it replaces.

:func:`grouped_projection` runs the same row blocks (:func:`_rows`) for the attention's grouped ``wo_a``: one input,
weight and output per group, each group's a fixed distance after the one before, so any number of groups is one
grid (``linear_group`` takes at most :data:`MAX_WEIGHTS` weights, and V4-Pro has 16 groups).
"""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import mhc, mhc_checks, pdl
from kernels.triton.tickets import counters, last_ticket, release

__all__ = ["linear_group", "linear_group_launch", "grouped_projection", "linear_post", "LINEAR_GROUP_CONFIG",
           "MANY_TOKENS_CONFIG", "MAX_WEIGHTS", "FEW_BLOCKS", "FEW_BLOCKS_SPLIT", "shares", "token_settings"]

MAX_WEIGHTS = 8
# BN weight rows and BK columns a step per program; SPLIT: shares of K a row block's programs take (1: one program
# a block; more: partials summed by the block's last program, for groups of few blocks, which leave SMs idle; None:
# by the group's blocks, below);
# max_tokens: the most rows the kernel takes (more: cuBLAS).
# BK 256 and 4 stages (from 128 and 3): with the weights read from HBM, as in a decode step, a Flash CSA layer's
# launch took 15.37 against 17.9 us and a window layer's 10.72 against 14.8 at one token on an H100
# (python -m bench.kernels_decode_sweep --only linear_group, four weight copies a graph;
# bench/results/kernels-decode-sweep-h100-linear-group-l2-cold.json)
# SPLIT None: FEW_BLOCKS_SPLIT shares where a group has fewer than FEW_BLOCKS row blocks, else 1. A window layer's
# wq_a and wkv (48 blocks on an H100's 132 SMs) took 8.74 us at SPLIT 2 against 11.3 at one token (8.63 against
# 10.7 at 16), where a CSA layer's group (130 blocks) and the query's (1,280) were fastest at 1
# (bench/results/kernels-decode-sweep-h100-projections.json, L2-cold)
# prefetch_lines: with PDL, 128-byte lines of each of a program's weight rows it asks L2 for before it waits on the
# kernel before it (pdl.wait_prior_after_prefetch): 8 lines, 512 bf16 columns, the first two BK steps; untimed. At
# 16 lines the ptxas of CUDA 13.0 (torch 2.11+cu130's, which triton uses once Inductor has compiled in the process)
# spilled 12 bytes of registers at one program a block; at 8 neither it nor triton's own spills
LINEAR_GROUP_CONFIG = dict(BN=32, BK=256, warps=4, stages=4, SPLIT=None, max_tokens=16, prefetch_lines=8)
FEW_BLOCKS, FEW_BLOCKS_SPLIT = 64, 2
# Above LINEAR_GROUP_CONFIG's max_tokens and up to this max_tokens (a GRPO step's 64 sequences), the same kernels
# with these keys in its place, where cuBLAS ran a GEMM a weight. On one H100 (2026-12-07, python -m
# bench.kernels_decode_sweep --only many_tokens, bench/results/kernels-decode-sweep-h100-many-tokens-warps.json)
# they took a Flash CSA layer's attention-input group, its wq_b with the indexer's, wo_b and wo_a in 113 us
# together against cuBLAS's 154.7 at 64 tokens, and the Flash-shaped step 3.54 ms against 3.62 at 64 sequences,
# 3.42 against 3.49 at 32, back to back (bench/results/rollout-h100-flash-shaped-triton-many-8warps-64.json,
# bench/results/rollout-h100-flash-shaped-triton-many-8warps-16.json). 8 warps, not the 4 that time 5% faster:
# at 64 rows ptxas for sm_90 spills 4 warps' registers (1,124 bytes in the group kernel), 8 warps' none
MANY_TOKENS_CONFIG = dict(BN=32, BK=128, stages=4, warps=8, SPLIT=1, max_tokens=64)


def _row_settings(M: int, config: Optional[dict] = None) -> dict:
    """The settings of ``M`` rows whatever their ``max_tokens``: :data:`LINEAR_GROUP_CONFIG` up to its
    ``max_tokens``, above it :data:`MANY_TOKENS_CONFIG`'s keys in its place; ``config``'s keys override either's."""
    cfg = {**LINEAR_GROUP_CONFIG, **(config or {})}
    return cfg if M <= cfg["max_tokens"] else {**LINEAR_GROUP_CONFIG, **MANY_TOKENS_CONFIG, **(config or {})}


def token_settings(M: int, config: Optional[dict] = None) -> Optional[dict]:
    """The launch settings for ``M`` rows: :data:`LINEAR_GROUP_CONFIG` up to its ``max_tokens``, above it
    :data:`MANY_TOKENS_CONFIG`'s keys in its place up to that one's ``max_tokens``, and None above both (the
    contract: cuBLAS); ``config``'s keys override either's (a sweep's setting)."""
    cfg = _row_settings(M, config)
    return cfg if M <= cfg["max_tokens"] else None


@triton.jit
def _share_product(X, W, M, N, K, stride_xm, stride_wn, block, s, SPLIT: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """``X @ W[block rows]^T`` over share ``s`` of ``K`` (``K / SPLIT`` columns, whole ``BK`` steps), all ``M`` rows
    of ``X``, fp32 accumulation -> ``[BM, BN]``: the product of :func:`_rows` and of :func:`_linear_post_kernel`."""
    m = tl.arange(0, BM)
    n = block * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    mmask, nmask = m < M, n < N
    x_ptr = X + m[:, None] * stride_xm + k[None, :]
    w_ptr = W + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    ks = K // SPLIT                                      # a whole number of BK steps (the launcher's choice)
    for k0 in tl.range(s * ks, s * ks + ks, BK, num_stages=STAGES):
        x = tl.load(x_ptr + k0, mask=mmask[:, None], other=0.0)
        w = tl.load(w_ptr + k0, mask=nmask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _share_total(acc, PART, TICKETS, block, s, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Share ``s``'s partial ``acc [BM, BN]`` of row block ``block`` written to ``PART``, then a ticket ->
    ``(last, tot)``: in the block's last program to take one, the partials summed in order (the same sums on every
    call) and the counter set back to 0; elsewhere ``tot`` is zeros, unused. The split reduction of :func:`_rows`
    and :func:`_linear_post_kernel`."""
    tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    tl.store(PART + (block * SPLIT + s).to(tl.int64) * (BM * BN) + tile, acc)
    last = last_ticket(TICKETS + block, SPLIT)
    tot = tl.zeros([BM, BN], dtype=tl.float32)
    if last:
        for i in range(SPLIT):
            tot += tl.load(PART + (block * SPLIT + i).to(tl.int64) * (BM * BN) + tile, cache_modifier=".cg")
        release(TICKETS + block)
    return last, tot


@triton.jit
def _rows(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, block, gblock, s, PART, TICKETS,
          SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """``Y[:, block rows] = X @ W[block rows]^T`` for all ``M`` rows, fp32 accumulation; with ``SPLIT`` > 1 this
    program's share ``s`` of ``K``, its partial written to ``PART`` and summed, in order, by the last program of the
    group's row block ``gblock`` to take a ticket."""
    m = tl.arange(0, BM)
    n = block * BN + tl.arange(0, BN)
    mmask, nmask = m < M, n < N
    acc = _share_product(X, W, M, N, K, stride_xm, stride_wn, block, s, SPLIT, BM, BN, BK, STAGES)
    out = Y + m[:, None] * stride_ym + n[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=omask)
    else:
        last, tot = _share_total(acc, PART, TICKETS, gblock, s, SPLIT, BM, BN)
        if last:
            tl.store(out, tot.to(Y.dtype.element_ty), mask=omask)


@triton.jit
def _weight_lines(W, N, K, stride_wn, block, s, SPLIT: tl.constexpr, BN: tl.constexpr, LINES: tl.constexpr):
    """Pointers ``[BN, LINES]`` to the first ``LINES`` 128-byte lines (64 bf16 / fp16 columns) of each weight row of
    the program's row block ``block`` in its share ``s`` of ``K``: rows past ``N`` repeat the last, columns past the
    share its last (a prefetch of an address twice costs nothing)."""
    n = tl.minimum(block * BN + tl.arange(0, BN), N - 1)
    ks = K // SPLIT
    c = s * ks + tl.minimum(tl.arange(0, LINES) * 64, ks - 1)
    return W + n.to(tl.int64)[:, None] * stride_wn + c[None, :]


@triton.jit
def _group_lines(p, s, K, W0, N0, SW0, W1, N1, SW1, W2, N2, SW2, W3, N3, SW3, W4, N4, SW4, W5, N5, SW5, W6, N6, SW6,
                 W7, N7, SW7, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                 E4: tl.constexpr, E5: tl.constexpr, E6: tl.constexpr, G: tl.constexpr, SPLIT: tl.constexpr,
                 BN: tl.constexpr, LINES: tl.constexpr):
    """:func:`_weight_lines` of the weight whose row block the group's row block ``p`` is (as the kernel's
    dispatch)."""
    lines = _weight_lines(W0, N0, K, SW0, p, s, SPLIT, BN, LINES)
    if G > 1:
        if (p >= E0) & (p < E1):
            lines = _weight_lines(W1, N1, K, SW1, p - E0, s, SPLIT, BN, LINES)
    if G > 2:
        if (p >= E1) & (p < E2):
            lines = _weight_lines(W2, N2, K, SW2, p - E1, s, SPLIT, BN, LINES)
    if G > 3:
        if (p >= E2) & (p < E3):
            lines = _weight_lines(W3, N3, K, SW3, p - E2, s, SPLIT, BN, LINES)
    if G > 4:
        if (p >= E3) & (p < E4):
            lines = _weight_lines(W4, N4, K, SW4, p - E3, s, SPLIT, BN, LINES)
    if G > 5:
        if (p >= E4) & (p < E5):
            lines = _weight_lines(W5, N5, K, SW5, p - E4, s, SPLIT, BN, LINES)
    if G > 6:
        if (p >= E5) & (p < E6):
            lines = _weight_lines(W6, N6, K, SW6, p - E5, s, SPLIT, BN, LINES)
    if G > 7:
        if p >= E6:
            lines = _weight_lines(W7, N7, K, SW7, p - E6, s, SPLIT, BN, LINES)
    return lines


@triton.jit
def _linear_group_kernel(X, M, K, stride_xm, PART, TICKETS,
                         W0, Y0, N0, SW0, SY0, W1, Y1, N1, SW1, SY1, W2, Y2, N2, SW2, SY2, W3, Y3, N3, SW3, SY3,
                         W4, Y4, N4, SW4, SY4, W5, Y5, N5, SW5, SY5, W6, Y6, N6, SW6, SY6, W7, Y7, N7, SW7, SY7,
                         E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                         E4: tl.constexpr, E5: tl.constexpr, E6: tl.constexpr, E7: tl.constexpr,
                         G: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, STAGES: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr = False,
                         PREFETCH: tl.constexpr = False):
    """Program ``p``: share ``p % SPLIT`` of ``K`` of the group's row block ``q = p // SPLIT``, which is row block
    ``q - E(i-1)`` of weight ``i``, where ``E(i-1) <= q < Ei`` (``Ei``: the row blocks of weights ``0..i``; ``G``
    weights, the rest's arguments unused). ``PREFETCH``: the first ``LINES`` lines of its weight rows asked of L2
    before it waits on the kernel before it."""
    pdl.wait_prior_after_prefetch(PDL, PREFETCH, _group_lines(
        tl.program_id(0) // SPLIT, tl.program_id(0) % SPLIT, K, W0, N0, SW0, W1, N1, SW1, W2, N2, SW2, W3, N3, SW3,
        W4, N4, SW4, W5, N5, SW5, W6, N6, SW6, W7, N7, SW7, E0, E1, E2, E3, E4, E5, E6, G, SPLIT, BN, LINES))
    s = tl.program_id(0) % SPLIT
    p = tl.program_id(0) // SPLIT
    if p < E0:
        _rows(X, W0, Y0, M, N0, K, stride_xm, SW0, SY0, p, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 1:
        if (p >= E0) & (p < E1):
            _rows(X, W1, Y1, M, N1, K, stride_xm, SW1, SY1, p - E0, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 2:
        if (p >= E1) & (p < E2):
            _rows(X, W2, Y2, M, N2, K, stride_xm, SW2, SY2, p - E1, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 3:
        if (p >= E2) & (p < E3):
            _rows(X, W3, Y3, M, N3, K, stride_xm, SW3, SY3, p - E2, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 4:
        if (p >= E3) & (p < E4):
            _rows(X, W4, Y4, M, N4, K, stride_xm, SW4, SY4, p - E3, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 5:
        if (p >= E4) & (p < E5):
            _rows(X, W5, Y5, M, N5, K, stride_xm, SW5, SY5, p - E4, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 6:
        if (p >= E5) & (p < E6):
            _rows(X, W6, Y6, M, N6, K, stride_xm, SW6, SY6, p - E5, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)
    if G > 7:
        if (p >= E6) & (p < E7):
            _rows(X, W7, Y7, M, N7, K, stride_xm, SW7, SY7, p - E6, p, s, PART, TICKETS, SPLIT, BM, BN, BK, STAGES)


def _check(x: torch.Tensor, weights: Sequence[torch.Tensor], fp32: Sequence[bool]) -> None:
    """The inputs the kernel takes, anything else refused with the reason (a ``ValueError``)."""
    if not 1 <= len(weights) <= MAX_WEIGHTS or len(fp32) != len(weights):
        raise ValueError(f"triton linear_group: 1 to {MAX_WEIGHTS} weights, one fp32 flag each; got {len(weights)} "
                         f"weights and {len(fp32)} flags")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"triton linear_group: a bf16 or fp16 input, got {x.dtype}")
    K = x.shape[-1]
    if K % 16:
        raise ValueError(f"triton linear_group: the input width {K} is not a multiple of 16 (a dot's depth)")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype:
            raise ValueError(f"triton linear_group: weights [N, {K}] in the input's dtype {x.dtype}; got "
                             f"{tuple(w.shape)} {w.dtype}")
    if not gpu_common.interpreting() and not x.is_cuda:
        raise ValueError("the triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU debugging)")
    gpu_common.refuse_grad("triton", x, *weights)


def shares(blocks: int, config: Optional[dict] = None) -> int:
    """The shares of ``K`` a group of ``blocks`` row blocks takes: ``config``'s ``SPLIT``, or where it is None
    :data:`FEW_BLOCKS_SPLIT` below :data:`FEW_BLOCKS` blocks (SMs left idle by one program a block) and 1 above."""
    split = {**LINEAR_GROUP_CONFIG, **(config or {})}["SPLIT"]
    if split is None:
        split = FEW_BLOCKS_SPLIT if blocks < FEW_BLOCKS else 1
    return max(1, int(split))


def _depth(K: int, BK: int) -> int:
    """``BK`` of the launch: at most the settings', the largest power of two dividing ``K`` (whole steps over it)."""
    bk = min(BK, triton.next_power_of_2(K))
    while K % bk:
        bk //= 2
    return bk


def _whole_shares(split: int, K: int, bk: int) -> int:
    """``split`` shares of ``K``, fewer where they would not be whole ``bk`` steps each."""
    while split > 1 and (K // bk) % split:
        split -= 1
    return split


def _partials(blocks: int, split: int, bm: int, bn: int, device, unused: torch.Tensor):
    """``(PART, TICKETS)`` of ``blocks`` row blocks in ``split`` shares: fp32 partials and a ticket counter a
    block, or ``unused`` twice at one share (the kernel reads neither)."""
    if split == 1:
        return unused, unused
    return torch.empty(blocks * split * bm * bn, dtype=torch.float32, device=device), counters(device, blocks)


def linear_group_launch(x: torch.Tensor, weights: Sequence[torch.Tensor], fp32: Sequence[bool],
                        config: Optional[dict] = None) -> List[torch.Tensor]:
    """The launcher of :func:`linear_group` (inputs checked): ``x [M, K]`` -> one output a weight, at the settings
    :func:`linear_group` takes for ``M`` rows (``config``'s keys over them), whatever their ``max_tokens``."""
    M, K = x.shape
    cfg = _row_settings(M, config)
    outs = [torch.empty(M, w.shape[0], dtype=torch.float32 if f else x.dtype, device=x.device)
            for w, f in zip(weights, fp32)]
    if M == 0:
        return outs
    bn, bk = cfg["BN"], _depth(K, cfg["BK"])
    ends = list(accumulate(triton.cdiv(w.shape[0], bn) for w in weights))
    split = _whole_shares(shares(ends[-1], cfg), K, bk)
    # rows of any stride (a weight may be a slice of a wider tensor), each row's K columns contiguous
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = [w if w.stride(1) == 1 else w.contiguous() for w in weights]
    pad = MAX_WEIGHTS - len(weights)
    args = []
    for w, y in zip(weights, outs):
        args += [w, y, w.shape[0], w.stride(0), y.stride(0)]
    args += [x, x, 0, 0, 0] * pad                    # unused (G)
    ends += [ends[-1]] * pad
    blocks = ends[len(weights) - 1]
    bm = max(16, triton.next_power_of_2(M))
    part, tickets = _partials(blocks, split, bm, bn, x.device, x)
    _linear_group_kernel[(blocks * split,)](
        x, M, K, x.stride(0), part, tickets, *args, *ends, G=len(weights), SPLIT=split, BM=bm, BN=bn, BK=bk,
        STAGES=cfg["stages"], LINES=cfg["prefetch_lines"], num_warps=cfg["warps"], **pdl.launch(x.device, prefetch=True))
    return outs


@triton.jit
def _grouped_kernel(X, W, Y, M, N, K, stride_xm, stride_ym, BLOCKS, PART, TICKETS, SPLIT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, LINES: tl.constexpr,
                    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """Program ``p``: share ``p % SPLIT`` of ``K`` of row block ``b`` of group ``g`` (``p // SPLIT = g BLOCKS + b``):
    ``Y[:, g, block rows] = X[:, g, :] @ W[g, block rows]^T``, every group's input, weight and output ``K``, ``N K``
    and ``N`` elements after the one before. ``PREFETCH``: as :func:`_linear_group_kernel`."""
    pdl.wait_prior_after_prefetch(PDL, PREFETCH, _weight_lines(
        W + ((tl.program_id(0) // SPLIT) // BLOCKS).to(tl.int64) * N * K, N, K, K,
        (tl.program_id(0) // SPLIT) % BLOCKS, tl.program_id(0) % SPLIT, SPLIT, BN, LINES))
    s = tl.program_id(0) % SPLIT
    p = tl.program_id(0) // SPLIT
    g = p // BLOCKS
    _rows(X + g * K, W + g.to(tl.int64) * N * K, Y + g * N, M, N, K, stride_xm, K, stride_ym, p - g * BLOCKS, p, s,
          PART, TICKETS, SPLIT, BM, BN, BK, STAGES)


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor], fp32: Sequence[bool],
                 config: Optional[dict] = None) -> List[torch.Tensor]:
    """Same contract as ``kernels.reference.linear_group.linear_group``: ``x [..., K]`` and weights ``[N_i, K]`` ->
    ``[x @ W_i^T]`` (``[..., N_i]``, fp32 where ``fp32[i]``, else ``x``'s dtype), one launch for the rows of ``x``
    that :func:`token_settings` takes; more rows run the contract (a cuBLAS GEMM a weight)."""
    _check(x, weights, fp32)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    cfg = token_settings(x2.shape[0], config)
    if cfg is None:
        from kernels.reference.linear_group import linear_group as torch_contract

        return torch_contract(x, weights, fp32)
    return [y.view(*lead, y.shape[-1]) for y in linear_group_launch(x2, weights, fp32, cfg)]


def grouped_projection(o: torch.Tensor, w: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """Same contract as ``kernels.reference.layers.grouped_projection`` (forward): ``o [..., G, d]`` and ``w [G, R,
    d]`` in ``o``'s dtype -> ``[..., G, R]``, row ``g`` of each token ``o[..., g, :] @ w[g]^T``: the attention's
    grouped ``wo_a`` in one launch for the tokens :func:`token_settings` takes (more: the contract's batched GEMM),
    any number of groups. Why: at one sequence cuBLAS's batched GEMM read a Flash-shaped layer's ``wo_a`` (64 MiB) in 18.7 us on
    an H200, 74.65 us of the 1.2431 ms step, about 75% of the 4.8 TB/s (``bench/results/rollout-h200-flash-shaped-
    triton-profile-linear-group-head.json``), where ``linear_group``'s row blocks read the head at 92% of an H100's
    (``bench/results/kernels-decode-sweep-h100-projections.json``); here the groups' row blocks are one grid of that
    kernel's programs."""
    if o.dim() < 2 or w.dim() != 3 or o.shape[-2:] != (w.shape[0], w.shape[2]) or w.dtype != o.dtype:
        raise ValueError(f"triton grouped_projection: o [..., G, d] and w [G, R, d] of one dtype; got o "
                         f"{tuple(o.shape)} {o.dtype}, w {tuple(w.shape)} {w.dtype}")
    G, R, d = w.shape
    _check(o.reshape(-1, d), [w[0]], [False])
    lead = o.shape[:-2]
    x = o.reshape(-1, G, d)
    M = x.shape[0]
    cfg = token_settings(M, config)
    if cfg is None:
        from kernels.reference.layers import grouped_projection as torch_contract

        return torch_contract(o, w)
    x = x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous()
    w = w.contiguous()
    y = torch.empty(M, G, R, dtype=o.dtype, device=o.device)
    if M == 0 or G == 0 or R == 0:
        return y.view(*lead, G, R)
    bn, bk = cfg["BN"], _depth(d, cfg["BK"])
    per_group = triton.cdiv(R, bn)
    split = _whole_shares(shares(G * per_group, cfg), d, bk)
    bm = max(16, triton.next_power_of_2(M))
    part, tickets = _partials(G * per_group, split, bm, bn, x.device, x)
    _grouped_kernel[(G * per_group * split,)](x, w, y, M, R, d, x.stride(0), y.stride(0), per_group, part, tickets,
                                              SPLIT=split, BM=bm, BN=bn, BK=bk, STAGES=cfg["stages"],
                                              LINES=cfg["prefetch_lines"], num_warps=cfg["warps"],
                                              **pdl.launch(x.device, prefetch=True))
    return y.view(*lead, G, R)


@triton.jit
def _linear_post_kernel(U, W, X, POST, COMB, OUT, PART, TICKETS, M, N, K, stride_um, stride_wn, n,
                        SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        STAGES: tl.constexpr, NP: tl.constexpr, NS: tl.constexpr, LINES: tl.constexpr,
                        PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """Program ``p``: share ``p % SPLIT`` of ``K`` of row block ``b = p // SPLIT`` of ``W [N, K]`` (``N``: the
    streams' width): columns ``[b BN, (b+1) BN)`` of ``U @ W^T`` for every row (:func:`_share_product`, partials
    summed in order by the block's last program, :func:`_share_total`), rounded to ``U``'s dtype as
    ``linear_group`` stores them, then the mHC post of those columns in every stream of ``X [M, n, N]``
    (``kernels.triton.mhc.post_tile``) into ``OUT``. ``PREFETCH``: as :func:`_linear_group_kernel`."""
    pdl.wait_prior_after_prefetch(PDL, PREFETCH, _weight_lines(W, N, K, stride_wn, tl.program_id(0) // SPLIT,
                                                               tl.program_id(0) % SPLIT, SPLIT, BN, LINES))
    s = tl.program_id(0) % SPLIT
    b = tl.program_id(0) // SPLIT
    m = tl.arange(0, BM)
    cols = b * BN + tl.arange(0, BN)
    acc = _share_product(U, W, M, N, K, stride_um, stride_wn, b, s, SPLIT, BM, BN, BK, STAGES)
    if SPLIT == 1:
        f = acc.to(U.dtype.element_ty).to(tl.float32)
        mhc.post_tile(f, X, POST, COMB, OUT, m.to(tl.int64), m < M, cols, cols < N, n, N, NP, NS)
    else:
        last, tot = _share_total(acc, PART, TICKETS, b, s, SPLIT, BM, BN)
        if last:
            f = tot.to(U.dtype.element_ty).to(tl.float32)
            mhc.post_tile(f, X, POST, COMB, OUT, m.to(tl.int64), m < M, cols, cols < N, n, N, NP, NS)


def linear_post(u: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                config: Optional[dict] = None) -> torch.Tensor:
    """``kernels.reference.slots.linear_post``: the attention's output projection ``u @ weight^T`` (``u [..., K]``,
    ``weight [d, K]`` in ``u``'s dtype: ``wo_b``), then the site's mHC post ``hc_post(f, x, post, comb)`` (``x
    [..., n, d]`` in ``u``'s dtype with ``u``'s leading shape, ``post``/``comb`` fp32) -> ``[..., n, d]``: the bits of
    this backend's ``linear_group`` then its ``hc_post``, in one launch at the tokens :func:`token_settings` takes
    (each program posts the columns it projected, into every stream), above them the two (cuBLAS's GEMM, as
    ``linear_group`` runs there, then ``kernels.triton.mhc``'s post).

    Why: the eager decode step ran the attention's mHC post as a launch of its own after ``wo_b``: on an H100 the
    Flash-shaped step at one sequence ran 8 ``_post_fwd_kernel`` launches (the attention's 4 and the MoE's
    ``moe_combine_post``) in 18.59 us, each waiting on the one before
    (``bench/results/rollout-h100-flash-shaped-triton-split-64x32.json``). Decode only (no backward). Anything else
    is refused with the reason."""
    op = "linear_post"
    try:
        mhc_checks.check_hc_post(x[..., 0, :], x, post, comb)
    except ValueError as e:
        raise gpu_common.op_refusal(op, str(e)) from None
    n, d = x.shape[-2:]
    K = u.shape[-1] if u.dim() else 0
    if u.shape[:-1] != x.shape[:-2] or weight.dim() != 2 or weight.shape != (d, K) or x.dtype != u.dtype:
        raise gpu_common.op_refusal(op, f"u {tuple(u.shape)} {u.dtype}, weight {tuple(weight.shape)}, x "
                                        f"{tuple(x.shape)} {x.dtype} (needs u [..., K], weight [{d}, K] and x "
                                        f"[..., n, {d}] with u's leading shape and dtype)")
    if any(t.requires_grad for t in (x, post, comb)):
        raise gpu_common.op_refusal(op, "an input that requires a gradient (the op is the decode step's and has no "
                                        "backward)")
    T = x[..., 0, 0].numel()
    u2 = u.reshape(T, K)
    try:
        _check(u2, [weight], [False])
    except ValueError as e:
        raise gpu_common.op_refusal(op, str(e)) from None
    cfg = token_settings(T, config)
    x3, p2, c2 = x.reshape(T, n, d).contiguous(), post.reshape(T, n).contiguous(), comb.reshape(T, n, n).contiguous()
    if cfg is None:                            # linear_group's GEMM above its token limit, then the post kernel
        return mhc.hc_post_fwd(F.linear(u2, weight), x3, p2, c2).view(x.shape)
    out = torch.empty_like(x3)
    if T == 0:
        return out.view(x.shape)
    u2 = u2 if u2.stride(1) == 1 else u2.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    bn, bk = cfg["BN"], _depth(K, cfg["BK"])
    blocks = triton.cdiv(d, bn)
    split = _whole_shares(shares(blocks, cfg), K, bk)              # linear_group's choice for this one weight
    bm = max(16, triton.next_power_of_2(T))
    part, tickets = _partials(blocks, split, bm, bn, u2.device, u2)
    _linear_post_kernel[(blocks * split,)](u2, weight, x3, p2, c2, out, part, tickets, T, d, K, u2.stride(0),
                                           weight.stride(0), n, SPLIT=split, BM=bm, BN=bn, BK=bk,
                                           STAGES=cfg["stages"], NP=mhc_checks.padded(n), NS=n,
                                           LINES=cfg["prefetch_lines"], num_warps=cfg["warps"],
                                           **pdl.launch(u2.device, prefetch=True))
    return out.view(x.shape)
