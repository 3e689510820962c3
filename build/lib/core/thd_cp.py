"""Context-parallel (CP) maps for the packed (THD) stream of DeepSeek-V4 attention. Pure functions.

CP splits the packed stream contiguously: with ``T`` rows and ``cp`` ranks, rank ``r`` holds rows
``[r*T/cp, (r+1)*T/cp)`` (``T % cp == 0``; :mod:`core.packing` pads the stream). The window and
attention KV are all-gathered, so only the compressor needs care: a compressed group (see
:mod:`core.thd`) may straddle a rank boundary.

Rules
-----
* **Ownership:** a group is owned (computed) by the rank that holds its **last** token, the first
  rank on which the group is complete. Its flat index ``g``, owner ``floor(last_token(g) / L)``.
  Owned groups of one rank are a contiguous range of the flat list (last tokens increase with
  ``g``), so the compacted slots keep sequence order.
* **Boundary width** ``compressor_boundary_width(ratio)``: rows a rank receives from the previous
  rank so that every owned group is computable locally. A group owned by a rank starts at most
  ``ratio - 1`` rows before the rank's first row; the overlapping ratio-4 compressor also pools the
  previous group, ``2*ratio - 1`` rows back. Hence 8 for ratio 4 (``2*4``, rounded to whole groups)
  and 128 for ratio 128. The rows come from rank ``r-1`` only, so ``L >= width`` is required
  (``check_cp_config`` raises otherwise); rank 0's boundary is zeros and never read.
* **Compaction:** each rank gathers the input rows of its owned groups from
  ``cat([boundary (width rows), local (L rows)])`` into ``capacity`` fixed slots, ``span`` rows each
  (``ratio`` rows, or ``2*ratio`` for overlap: previous group's rows then own rows; ``-1`` sources
  give zero rows, the compressor must use score ``-inf`` there). ``capacity = max(1, ceil(L/ratio))``
  is the same on every rank, so the all-gather of compressed slots sends equal sizes. It is an
  upper bound: owned groups are disjoint runs of ``ratio`` tokens with last tokens in ``[s, s+L)``,
  so consecutive last tokens differ by >= ratio and at most ``ceil(L/ratio)`` fit (attained when a
  group ends at the rank's first row). Every group lands in exactly one slot of exactly one rank.
* **Rank-major rows:** after all-gathering the slots, group ``g`` is at row
  ``owner*capacity + (g - first_owned[owner])``. ``RankMajorLayout.seq_to_rank`` ``[G]`` and
  ``rank_to_seq`` ``[cp*capacity]`` (``-1`` for empty slots) are inverse permutations on valid rows.
  Index builders in :mod:`core.thd` produce sequence-major (flat) compressed indices; map them with
  ``to_rank_major``.

Public API
----------
* ``CpConfigError(ValueError)``, ``cp_local_range(total_tokens, cp, rank) -> (global_start, local_len)``
  (defined in :mod:`core.thd`, which needs them for ``ThdLayout.for_cp_rank``; re-exported here)
* ``compressor_boundary_width(ratio) -> int`` (8 for ratio 4, ``ratio`` otherwise)
* ``check_cp_config(tokens_per_rank, cp, ratios) -> None`` (parse-time check, raises CpConfigError)
* ``group_owner(groups: CompressedGroups, local_len) -> Tensor [G]``
* ``owned_group_range(groups, global_start, local_len) -> (lo, hi)`` flat range of owned groups
* ``compact_group_capacity(local_len, ratio) -> int``
* ``CompactPlan`` (frozen dataclass) / ``compact_plan(cu_seqlens, ratio, global_start, local_len,
  capacity=None) -> CompactPlan``: ``gather_index [capacity, span]`` (rows of ``[boundary | local]``,
  ``-1`` invalid), ``group_ids [capacity]`` (flat index or ``-1``), ``rope_positions [capacity]``
  (``-1`` for empty slots), ``valid`` mask
* ``CompactRows`` (``torch.autograd.Function``), ``compact_rows(source, gather_index) -> Tensor``
  ``[*gather_index.shape, *source.shape[1:]]``; backward adds each compacted row's gradient to its
  source row only (invalid positions contribute nothing).
* ``compact_compressor_input(local, boundary, plan) -> Tensor [capacity, span, *rest]``
* ``RankMajorLayout`` (frozen dataclass) / ``compressed_rank_layout(cu_seqlens, ratio, local_len, cp,
  capacity=None) -> RankMajorLayout``
* ``to_rank_major(idx, seq_to_rank) -> Tensor`` (``-1`` preserved)
* ``seq_major_from_rank_major(gathered, seq_to_rank) -> Tensor`` (``index_select``; autograd-safe)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from core.thd import (  # CpConfigError and cp_local_range live in core.thd (ThdLayout.for_cp_rank uses them)
    CompressedGroups,
    CpConfigError,
    compressed_groups,
    cp_local_range,
    has_overlap,
    validate_cu_seqlens,
)

__all__ = [
    "CompactPlan",
    "CompactRows",
    "CpConfigError",
    "RankMajorLayout",
    "check_cp_config",
    "compact_compressor_input",
    "compact_group_capacity",
    "compact_plan",
    "compact_rows",
    "compressed_rank_layout",
    "compressor_boundary_width",
    "cp_local_range",
    "group_owner",
    "owned_group_range",
    "seq_major_from_rank_major",
    "to_rank_major",
]


def compressor_boundary_width(ratio: int) -> int:
    """Rows needed from the previous rank so every group whose last token a rank holds is local:
    ``2*ratio`` with the ratio-4 overlap (8), else ``ratio`` (128 for ratio 128)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"compress ratio must be a positive int, got {ratio!r}")
    return 2 * ratio if has_overlap(ratio) else ratio


def check_cp_config(tokens_per_rank: int, cp: int, ratios: Iterable[int]) -> None:
    """Parse-time check: with ``cp > 1`` every rank must hold at least the boundary width of every
    compressed ratio, because the boundary rows come from the immediately previous rank only."""
    if cp < 1:
        raise CpConfigError(f"--cp must be >= 1, got {cp}")
    if tokens_per_rank < 1:
        raise CpConfigError(f"tokens per rank must be >= 1, got {tokens_per_rank}")
    if cp == 1:
        return
    ratios = sorted({int(r) for r in ratios if int(r) > 0})
    if not ratios:
        return
    width, ratio = max((compressor_boundary_width(r), r) for r in ratios)
    if tokens_per_rank < width:
        raise CpConfigError(
            f"context parallelism cp={cp} gives each rank {tokens_per_rank} tokens, fewer than the "
            f"compressor boundary width {width} of ratio {ratio} (rows taken from the previous rank). "
            f"Fix: increase tokens per rank to at least {width} (e.g. --max-tokens-per-rank) or lower --cp."
        )


def group_owner(groups: CompressedGroups, local_len: int) -> Tensor:
    """``[G]`` rank owning each group: the one holding its last token."""
    if local_len < 1:
        raise CpConfigError(f"local_len must be >= 1, got {local_len}")
    return torch.div(groups.last_token, local_len, rounding_mode="floor")


def owned_group_range(groups: CompressedGroups, global_start: int, local_len: int) -> tuple[int, int]:
    """Flat range ``[lo, hi)`` of the groups whose last token is in ``[global_start, global_start + local_len)``."""
    last = groups.last_token.contiguous()
    bounds = torch.tensor([global_start, global_start + local_len], dtype=last.dtype, device=last.device)
    lo, hi = torch.searchsorted(last, bounds).tolist()
    return int(lo), int(hi)


def compact_group_capacity(local_len: int, ratio: int) -> int:
    """Slots per rank: ``max(1, ceil(local_len / ratio))``, an upper bound on the owned groups of any rank."""
    if local_len < 1:
        raise CpConfigError(f"local_len must be >= 1, got {local_len}")
    compressor_boundary_width(ratio)  # validates ratio
    return max(1, -(-local_len // ratio))


@dataclass(frozen=True, eq=False)
class CompactPlan:
    """One rank's compaction of its owned groups into fixed slots.

    ``gather_index [capacity, span]`` addresses rows of ``cat([boundary, local])`` (boundary = the
    previous rank's last ``boundary_width`` rows); ``-1`` = no source (empty slot, or the missing
    previous group of a segment's first group under overlap). ``group_ids`` / ``rope_positions``
    ``[capacity]`` are ``-1`` for empty slots."""

    ratio: int
    overlap: bool
    capacity: int
    boundary_width: int
    global_start: int
    local_len: int
    gather_index: Tensor
    group_ids: Tensor
    rope_positions: Tensor

    @property
    def span(self) -> int:
        return self.gather_index.shape[1]

    @property
    def valid(self) -> Tensor:
        return self.gather_index >= 0

    @property
    def num_groups(self) -> int:
        return int((self.group_ids >= 0).sum())

    def source_global_rows(self) -> Tensor:
        """``gather_index`` as global stream rows (``-1`` kept)."""
        g = self.gather_index + (self.global_start - self.boundary_width)
        return torch.where(self.valid, g, torch.full_like(g, -1))


def compact_plan(cu_seqlens: Tensor, ratio: int, global_start: int, local_len: int,
                 capacity: int | None = None, *, overlap: bool | None = None) -> CompactPlan:
    """Plan the compaction of the groups owned by the rank holding ``[global_start, global_start + local_len)``.

    ``overlap`` defaults to ``has_overlap(ratio)``; with it each slot holds ``2*ratio`` rows."""
    cu = validate_cu_seqlens(cu_seqlens)
    groups = compressed_groups(cu, ratio)
    overlap = has_overlap(ratio) if overlap is None else bool(overlap)
    compressor_boundary_width(ratio)  # validates ratio
    width = 2 * ratio if overlap else ratio  # == compressor_boundary_width(ratio) for the default overlap
    cap = compact_group_capacity(local_len, ratio) if capacity is None else int(capacity)
    if global_start < 0 or global_start + local_len > int(cu[-1]):
        raise CpConfigError(f"rows [{global_start}, {global_start + local_len}) outside the stream [0, {int(cu[-1])})")
    lo, hi = owned_group_range(groups, global_start, local_len)
    n = hi - lo
    if n > cap:
        raise CpConfigError(f"rank owns {n} ratio-{ratio} groups but capacity is {cap}; use compact_group_capacity")
    rows = (groups.overlap_gather_index() if overlap else groups.gather_index())[lo:hi]
    span = rows.shape[1]
    base = global_start - width
    src = torch.where(rows >= 0, rows - base, torch.full_like(rows, -1))
    if n and bool(((rows >= 0) & (src < 0)).any()):  # cannot happen when width is right; guard anyway
        raise CpConfigError(f"an owned ratio-{ratio} group reaches further back than the boundary width {width}")
    gather = torch.full((cap, span), -1, dtype=torch.int64, device=cu.device)
    gather[:n] = src
    ids = torch.full((cap,), -1, dtype=torch.int64, device=cu.device)
    ids[:n] = torch.arange(lo, hi, device=cu.device)
    pos = torch.full((cap,), -1, dtype=torch.int64, device=cu.device)
    pos[:n] = groups.rope_positions[lo:hi]
    return CompactPlan(ratio=ratio, overlap=overlap, capacity=cap, boundary_width=width,
                       global_start=int(global_start), local_len=int(local_len),
                       gather_index=gather, group_ids=ids, rope_positions=pos)


class CompactRows(torch.autograd.Function):
    """``out[i] = source[index[i]]`` where ``index[i] >= 0`` else 0, along dim 0 of ``source``.

    Backward: ``grad_source.index_add_(0, index[valid], grad_out[valid])``, so the gradient of each
    compacted row lands on its source row only; invalid positions never touch row 0."""

    @staticmethod
    def forward(ctx, source: Tensor, index: Tensor) -> Tensor:
        if index.dtype != torch.int64:
            raise TypeError(f"index must be int64, got {index.dtype}")
        flat = index.reshape(-1)
        if flat.numel() and int(flat.max()) >= source.shape[0]:
            raise IndexError(f"gather index {int(flat.max())} out of range for {source.shape[0]} source rows")
        sel = (flat >= 0).nonzero().squeeze(1)
        src_rows = flat.index_select(0, sel)
        rest = tuple(source.shape[1:])
        out = source.new_zeros((flat.numel(),) + rest)
        out.index_copy_(0, sel, source.index_select(0, src_rows))
        ctx.save_for_backward(sel, src_rows)
        ctx.n_source = source.shape[0]
        ctx.index_shape = tuple(index.shape)
        return out.reshape(ctx.index_shape + rest)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        sel, src_rows = ctx.saved_tensors
        rest = tuple(grad_out.shape[len(ctx.index_shape):])
        g = grad_out.reshape((-1,) + rest)
        grad_source = g.new_zeros((ctx.n_source,) + rest)
        grad_source.index_add_(0, src_rows, g.index_select(0, sel))
        return grad_source, None


def compact_rows(source: Tensor, gather_index: Tensor) -> Tensor:
    """Autograd-aware gather of rows of ``source`` (dim 0) by ``gather_index`` (``-1`` = zero row)."""
    return CompactRows.apply(source, gather_index)


def compact_compressor_input(local: Tensor, boundary: Tensor, plan: CompactPlan) -> Tensor:
    """``[capacity, span, *rest]`` compressor input of this rank's owned groups.

    ``local``: this rank's ``[L, *rest]`` rows; ``boundary``: the previous rank's last
    ``plan.boundary_width`` rows (zeros on rank 0). Gradients flow back into both."""
    if local.shape[0] != plan.local_len or boundary.shape[0] != plan.boundary_width:
        raise ValueError(
            f"expected {plan.boundary_width} boundary + {plan.local_len} local rows, "
            f"got {boundary.shape[0]} + {local.shape[0]}"
        )
    return compact_rows(torch.cat([boundary, local], dim=0), plan.gather_index)


@dataclass(frozen=True, eq=False)
class RankMajorLayout:
    """Map between the sequence-major flat compressed list ``[G]`` and the rank-major rows
    ``[cp * capacity]`` of the all-gathered compacted slots."""

    ratio: int
    cp: int
    capacity: int
    local_len: int
    seq_to_rank: Tensor  # [G] rank-major row of each flat group
    rank_to_seq: Tensor  # [cp*capacity] flat group of each row, -1 for empty slots
    owned_lo: Tensor  # [cp] first flat group owned by each rank
    owned_hi: Tensor  # [cp] one past the last

    @property
    def num_rows(self) -> int:
        return self.cp * self.capacity


def compressed_rank_layout(cu_seqlens: Tensor, ratio: int, local_len: int, cp: int,
                           capacity: int | None = None) -> RankMajorLayout:
    """Rank-major placement of every compressed group of the stream (``cu[-1] == cp * local_len``)."""
    cu = validate_cu_seqlens(cu_seqlens)
    if int(cu[-1]) != cp * local_len:
        raise CpConfigError(f"stream has {int(cu[-1])} tokens, expected cp*local_len = {cp}*{local_len}")
    cap = compact_group_capacity(local_len, ratio) if capacity is None else int(capacity)
    groups = compressed_groups(cu, ratio)
    last = groups.last_token.contiguous()
    starts = torch.arange(cp + 1, device=cu.device, dtype=torch.int64) * local_len
    edges = torch.searchsorted(last, starts)
    lo, hi = edges[:-1], edges[1:]
    if bool(((hi - lo) > cap).any()):
        raise CpConfigError(f"a rank owns {int((hi - lo).max())} ratio-{ratio} groups > capacity {cap}")
    flat = torch.arange(groups.num_groups, device=cu.device)
    owner = group_owner(groups, local_len)
    seq_to_rank = owner * cap + (flat - lo[owner])
    rank_to_seq = torch.full((cp * cap,), -1, dtype=torch.int64, device=cu.device)
    rank_to_seq[seq_to_rank] = flat
    return RankMajorLayout(ratio=ratio, cp=cp, capacity=cap, local_len=local_len,
                           seq_to_rank=seq_to_rank, rank_to_seq=rank_to_seq, owned_lo=lo, owned_hi=hi)


def to_rank_major(idx: Tensor, seq_to_rank: Tensor) -> Tensor:
    """Map flat (sequence-major) compressed indices to rank-major rows; ``-1`` stays ``-1``."""
    valid = idx >= 0
    if seq_to_rank.numel() == 0:
        if bool(valid.any()):
            raise IndexError("valid compressed index but the stream has no compressed groups")
        return torch.full_like(idx, -1)
    if bool((idx >= seq_to_rank.numel()).any()):
        raise IndexError(f"compressed index out of range (>= {seq_to_rank.numel()})")
    rows = seq_to_rank[torch.where(valid, idx, torch.zeros_like(idx))]
    return torch.where(valid, rows, torch.full_like(rows, -1))


def seq_major_from_rank_major(gathered: Tensor, seq_to_rank: Tensor) -> Tensor:
    """Rows of the all-gathered rank-major tensor reordered into the flat sequence-major list."""
    return gathered.index_select(0, seq_to_rank)
