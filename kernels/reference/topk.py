"""The Lightning Indexer's stable top-k: one fixed, length-independent rule for every implementation.

``torch.topk`` picks the k largest scores, but which of several exactly tied entries at the k-th
place it returns depends on the row's length and the device's algorithm. Indexer scores tie often
(an entry scores exactly 0 when every head's ReLU is off; with the tiny preset's 4 heads that is
common), so a query could pick a different entry in a full forward, in the forward of a prefix, and
in the KV-cached decode step (rows of ``max_len // 4`` entries). :func:`stable_topk` fixes the rule:

* the k largest scores, ties broken by the lowest entry index;
* ``-inf`` scores (invisible entries) are never picked: fewer than k finite scores leave ``-1``;
* the picks come in a canonical order: ascending entry index, then the ``-1`` padding. The order
  also fixes the order in which sparse attention sums the picked entries.

Appending entries to a row (more tokens after the query: ``-inf`` for it) therefore never changes its
picks, and every caller (reference forward and decode, the GPU backends, both megatron-core
implementations, packed THD and CP) gets the same ids.

Cost: no sort of the row. One ``topk`` finds the k-th largest value ``thr``; every entry above ``thr``
is taken, plus the lowest-index entries equal to ``thr`` (a cumulative count) up to k; a second
``topk`` (smallest k of a distinct integer key) lists the taken ids in ascending order. Rows are
processed in chunks so the row-sized temporaries stay bounded. No host synchronisation (CUDA-graph
safe). Scores must not hold NaN.
"""

from __future__ import annotations

import torch

__all__ = ["stable_topk", "decode_topk", "window_rows", "attention_rows"]

# Row chunks hold at most this many scores, so the int64 temporaries stay near 64 MiB each.
CHUNK_ELEMENTS = 1 << 23


def _stable_topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`stable_topk` of 2-D ``scores [R, N]`` with ``0 < k <= N``."""
    N = scores.shape[-1]
    thr = scores.topk(k, dim=-1).values[:, -1:]                  # k-th largest value (tie-independent)
    finite = scores > float("-inf")
    above = (scores > thr) & finite
    tied = (scores == thr) & finite
    need = k - above.sum(dim=-1, keepdim=True)                   # how many tied entries to take
    take = above | (tied & (tied.cumsum(dim=-1) <= need))        # the lowest-index ties
    j = torch.arange(N, device=scores.device)
    key = torch.where(take, j, N)                                # distinct for taken entries, N for the rest
    ids = key.topk(k, dim=-1, largest=False, sorted=True).values  # taken ids ascending, then N padding
    return torch.where(ids < N, ids, -1)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [..., N]`` -> int64 entry ids ``[..., min(k, N)]``: the ``min(k, N)`` largest finite scores
    of each row, ties broken by the lowest index, in ascending index order, ``-1`` padding at the end
    where fewer than that are finite."""
    N = scores.shape[-1]
    k = min(int(k), N)
    lead = scores.shape[:-1]
    if k <= 0:
        return torch.empty(*lead, 0, dtype=torch.long, device=scores.device)
    rows = scores.detach().reshape(-1, N)
    step = max(1, CHUNK_ELEMENTS // N)
    if rows.shape[0] <= step:
        out = _stable_topk_rows(rows, k)
    else:
        out = torch.cat([_stable_topk_rows(rows[r:r + step], k) for r in range(0, rows.shape[0], step)])
    return out.reshape(*lead, k)


def decode_topk(scores: torch.Tensor, pos: torch.Tensor, ratio: int, k: int, window: int = 0) -> torch.Tensor:
    """The ``decode_topk`` op's torch contract (the GPU backends' one-launch version: ``kernels/triton/topk.py``):
    a decode step's indexer picks from ``scores [B, N]``, each row over the entries its position ``pos [B]`` has
    completed (ids below ``(pos + 1) // ratio``; the rest scored ``-inf``), by :func:`stable_topk` -> ``[B,
    min(k, N)]``. With ``window``: the attention's rows ``[B, window + min(k, N)]``, the ring rows the position has
    written (``s < min(pos + 1, window)``, else ``-1``) and then the picks offset past the ring (``-1`` kept)."""
    N = scores.shape[-1]
    pos = pos.to(scores.device)
    limit = ((pos + 1) // ratio)[:, None]
    ids = stable_topk(scores.masked_fill(torch.arange(N, device=scores.device)[None, :] >= limit, float("-inf")), k)
    if not window:
        return ids
    return torch.cat((window_rows(window, pos), torch.where(ids >= 0, ids + window, ids)), dim=-1)


def window_rows(W: int, pos: torch.Tensor) -> torch.Tensor:
    """A decode step's window: the ring rows each row's query sees at positions ``pos [B]``, ``[B, W]`` (``-1``:
    not written yet); the decode step's (``kernels.reference.decode``) and :func:`decode_topk`'s."""
    s = torch.arange(W, device=pos.device)[None, :]
    return torch.where(s < (pos[:, None] + 1).clamp(max=W), s, -1)


def attention_rows(pos: torch.Tensor, window: int, ratio: int = 0, entries: int = 0) -> torch.Tensor:
    """A decode step's attention rows at positions ``pos [B]`` int64 -> ``[B, window + entries]`` int64: the ring
    rows each position has written (:func:`window_rows`), then, with ``ratio``, the ``entries`` compressed entries
    after the ring in id order, each where the position has completed it (``j < (pos + 1) // ratio``: ``window +
    j``, else ``-1``): a window layer's rows (``entries`` 0) and an HCA layer's, which attends to every entry. The
    eager decode step's (``kernels.reference.decode``), and the contract of the GPU backends' one-launch op."""
    rows = window_rows(window, pos)
    if not entries:
        return rows
    j = torch.arange(entries, device=pos.device)[None, :]
    return torch.cat((rows, torch.where(j < ((pos + 1) // ratio)[:, None], j + window, -1)), dim=-1)
