"""Triton: the decode step's indexer top-k in one launch (``decode_topk``; its torch contract is
``kernels.reference.topk.decode_topk``): the stable top-k of each row's scores over the entries its position has
completed.

Why: the eager decode step masked a CSA layer's indexer scores past each row's completed blocks (a floor division,
a range, a comparison, a fill) and took the stable top-k (``kernels.reference.topk.stable_topk``: the k-th largest
value, comparisons with it, two running sums, a second top-k over the taken ids, about fifteen kernels), about
nineteen launches a CSA layer (V4-Flash has 21 of them) for a few KB of scores.

One program a row, in passes over its ``N`` scores: each score becomes an unsigned key in the order of the floats
(the sign bit flipped for positives, every bit for negatives); an entry counts where it is finite and below the
row's limit ``(pos + 1) // ratio``. Where at most ``k`` count, all of them are taken; else 32 counting passes find
the ``k``-th largest key bit by bit (the largest key with at least ``k`` keys at or above it), and a last pass
takes the keys above it and, in id order, the first ``k`` minus that many equal to it, writing each taken id at
its rank: the same ids as the torch contract, ascending, ``-1`` after the last. With a ``window`` it writes the
attention's whole row of ids: the ring rows the position has written (``s < min(pos + 1, window)``, else ``-1``),
then the picks offset past the ring, where torch took a comparison, an add, a select and a concatenation more.

``attention_rows`` (torch contract ``kernels.reference.topk.attention_rows``) writes a window or HCA layer's rows
the same way in one launch: the ring rows written, then every entry the position has completed, where torch's
range, comparisons, clamp, selects and concatenation were five launches a step for the window layers and seven
more for the HCA layers'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import pdl

__all__ = ["decode_topk", "decode_topk_launch", "attention_rows", "BLOCK"]

BLOCK = 1024               # scores a loop step of a row's program reads


@triton.jit
def _keys(SCORES, row, ids, N, limit):
    """The unsigned keys of scores ``ids`` of ``row`` (in the floats' order) and whether each counts."""
    s = tl.load(SCORES + row * N + ids, mask=ids < N, other=float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648                       # all bits for a negative float, the sign bit else
    key = (bits ^ flip).to(tl.uint32, bitcast=True)
    return key, (ids < limit) & (s > float("-inf"))


@triton.jit(do_not_specialize=["N", "K", "ratio", "W"])
def _decode_topk_kernel(SCORES, POS, OUT, N, K, ratio, W, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(POS + row)
    limit = tl.minimum((p + 1) // ratio, N)
    lane = tl.arange(0, BLOCK)
    OUT += row * (W + K)                                    # the row's window rows (W), then its picks (K)
    for w0 in range(0, W, BLOCK):                           # the ring rows written so far: s < min(pos + 1, W)
        s = w0 + lane
        tl.store(OUT + s, tl.where(s < tl.minimum(p + 1, W), s, -1).to(tl.int64), mask=s < W)
    OUT += W
    valid = 0
    for n0 in range(0, N, BLOCK):
        _, ok = _keys(SCORES, row, n0 + lane, N, limit)
        valid += tl.sum(ok.to(tl.int32), axis=0)
    thr = tl.full([], 0, tl.uint32)                         # the k-th largest key, bit by bit from the top
    if valid > K:
        for b in tl.static_range(31, -1, -1):
            cand = thr | (tl.full([], 1, tl.uint32) << b)
            count = 0
            for n0 in range(0, N, BLOCK):
                key, ok = _keys(SCORES, row, n0 + lane, N, limit)
                count += tl.sum((ok & (key >= cand)).to(tl.int32), axis=0)
            thr = tl.where(count >= K, cand, thr)
    above = 0
    for n0 in range(0, N, BLOCK):
        key, ok = _keys(SCORES, row, n0 + lane, N, limit)
        above += tl.sum((ok & (key > thr)).to(tl.int32), axis=0)
    need = K - above                                        # how many ties (equal to thr) to take, lowest ids first
    taken = 0
    ties = 0
    for n0 in range(0, N, BLOCK):
        ids = n0 + lane
        key, ok = _keys(SCORES, row, ids, N, limit)
        tie = (ok & (key == thr)).to(tl.int32)
        take = ok & ((valid <= K) | (key > thr) | ((tie > 0) & (ties + tl.cumsum(tie, axis=0) <= need)))
        rank = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(OUT + rank, (ids + W).to(tl.int64), mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(tie, axis=0)
    for k0 in range(0, K, BLOCK):                           # -1 after the last taken id
        ks = k0 + lane
        tl.store(OUT + ks, tl.full([BLOCK], -1, tl.int64), mask=(ks >= taken) & (ks < K))


def decode_topk_launch(scores: torch.Tensor, pos: torch.Tensor, ratio: int, k: int, window: int = 0) -> torch.Tensor:
    """The kernel on checked inputs: ``scores [B, N]`` fp32 contiguous, ``pos [B]`` int64 -> ``[B, window +
    min(k, N)]``."""
    B, N = scores.shape
    K = min(int(k), N)
    out = torch.empty(B, window + K, dtype=torch.long, device=scores.device)
    if B and (K or window):
        _decode_topk_kernel[(B,)](scores, pos, out, N, K, int(ratio), int(window),
                                  BLOCK=min(BLOCK, triton.next_power_of_2(max(N, K, window, 1))), num_warps=4,
                                  **pdl.launch(scores.device))
    return out


def decode_topk(scores: torch.Tensor, pos: torch.Tensor, ratio: int, k: int, window: int = 0) -> torch.Tensor:
    """:func:`kernels.reference.topk.decode_topk` in one launch (module docstring): ``scores [B, N]`` fp32 (CUDA),
    the rows' positions ``pos [B]`` int64, the compression ``ratio`` and ``k`` -> int64 ids ``[B, min(k, N)]``, the
    same ids; with ``window`` the attention's rows ``[B, window + min(k, N)]`` (the ring rows written so far, then
    the picks after the ring). Anything else is refused with the reason."""
    op = "decode_topk"
    gpu_common.check_op_input(op, scores, "scores", dtypes=(torch.float32,))
    if (scores.dim() != 2 or pos.shape != (scores.shape[0],) or pos.dtype != torch.int64 or ratio < 1 or k < 0
            or window < 0):
        raise gpu_common.op_refusal(op, f"scores {tuple(scores.shape)}, pos {tuple(pos.shape)} {pos.dtype}, ratio "
                                        f"{ratio}, k {k}, window {window} (needs scores [B, N], int64 pos [B], "
                                        f"ratio >= 1, k >= 0, window >= 0)")
    return decode_topk_launch(scores.contiguous(), pos.contiguous(), ratio, k, int(window))


@triton.jit(do_not_specialize=["W", "N", "ratio"])
def _attention_rows_kernel(POS, OUT, W, N, ratio, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``b``: row ``b``'s ring rows written (``s < min(pos + 1, W)``, else -1), then entries ``j <
    (pos + 1) // ratio`` as ``W + j`` (else -1)."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(POS + row)
    lane = tl.arange(0, BLOCK)
    OUT += row * (W + N)
    for w0 in range(0, W, BLOCK):
        s = w0 + lane
        tl.store(OUT + s, tl.where(s < tl.minimum(p + 1, W), s, -1).to(tl.int64), mask=s < W)
    done = (p + 1) // tl.maximum(ratio, 1)
    for n0 in range(0, N, BLOCK):
        j = n0 + lane
        tl.store(OUT + W + j, tl.where(j < done, j + W, -1).to(tl.int64), mask=j < N)


def attention_rows(pos: torch.Tensor, window: int, ratio: int = 0, entries: int = 0) -> torch.Tensor:
    """:func:`kernels.reference.topk.attention_rows` in one launch: positions ``pos [B]`` int64 (CUDA), the ring's
    ``window`` and, with ``ratio`` >= 1, the ``entries`` after it -> int64 ``[B, window + entries]``, the same ids.
    Anything else is refused with the reason."""
    op = "attention_rows"
    if not pos.is_cuda and not gpu_common.interpreting():
        raise gpu_common.op_refusal(op, f"pos is on {pos.device}, the kernel runs on CUDA tensors (or "
                                        f"TRITON_INTERPRET=1 for CPU debugging)")
    if pos.dim() != 1 or pos.dtype != torch.int64 or window < 0 or entries < 0 or (entries and ratio < 1):
        raise gpu_common.op_refusal(op, f"pos {tuple(pos.shape)} {pos.dtype}, window {window}, ratio {ratio}, "
                                        f"entries {entries} (needs int64 pos [B], window >= 0, entries >= 0 and "
                                        f"ratio >= 1 with entries)")
    B, W, N = pos.shape[0], int(window), int(entries)
    out = torch.empty(B, W + N, dtype=torch.long, device=pos.device)
    if B and W + N:
        _attention_rows_kernel[(B,)](pos.contiguous(), out, W, N, int(ratio),
                                     BLOCK=min(BLOCK, triton.next_power_of_2(max(W, N, 1))), num_warps=4,
                                     **pdl.launch(pos.device))
    return out
