"""Packed-sequence (THD) attention pieces and context parallelism (CP), shared by both implementations.

Everything index-related comes from :mod:`core.thd` / :mod:`core.thd_cp` (pure builders); this module
adds the tensors and the communication:

* :class:`ThdContext`: one forward's packed layout (``cu_seqlens`` of the whole stream, this rank's
  contiguous slice ``[global_start, global_start + local_len)``), the CP group, and per-ratio caches
  (compaction plan, rank-major map). BSHD + CP uses the same machinery with ``cu_seqlens = [0, S]``
  and the batch as a trailing dimension (the contiguous all-gather design: every rank holds the same
  slice of every sample).
* :func:`all_gather_cp` (autograd: backward all-reduces and keeps this rank's slice) and
  :func:`left_boundary` (the previous rank's last ``compressor_boundary_width(ratio)`` rows;
  zeros on rank 0; backward hands the gradient back to the previous rank). Both use collectives
  that gloo supports (all_gather / all_reduce), so CPU tests run them.
* :func:`compressed_kv`: compressor on compacted fixed-capacity slots (``core.thd_cp.compact_plan``),
  all-gathered rank-major (``[B, cp * capacity, c]``); the same path for ``cp == 1`` (no
  communication, the plan then covers the whole stream).
* :func:`indexer_topk` / :func:`segment_topk`: the indexer's stable top-k
  (``kernels.reference.topk.stable_topk``: ties -> lowest entry id, ids ascending) per segment on the
  segment's own score block: the same picks as the sample alone, at a segment's cost, not the stream's.
* :func:`sparse_attention_indices`: ``[T_local, W + K]`` rows of ``cat(kv_all_tokens, compressed)``.

Shapes are batch-first: ``x [B, L, C]`` with ``B == 1`` for a packed stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from core.thd import ThdLayout, compressed_visible_indices, indexer_ranges, validate_cu_seqlens, window_indices
from core.thd_cp import (
    CpConfigError,
    compact_compressor_input,
    compact_plan,
    compressed_rank_layout,
    compressor_boundary_width,
    cp_local_range,
    to_rank_major,
)
from kernels.reference.layers import compute_dtype
from kernels.reference.rope import apply_rope, rope_cos_sin
from kernels.reference.topk import stable_topk

__all__ = [
    "ThdContext",
    "all_gather_cp",
    "left_boundary",
    "compress_slots",
    "compressed_kv",
    "indexer_topk",
    "segment_topk",
    "replayed_segment_picks",
    "cp_group_info",
    "gather_sequence_cp",
]


def cp_group_info() -> tuple[int, int, Any]:
    """``(cp, cp_rank, group)`` of this rank's layout (``engine.layout``; ``(1, 0, None)`` without context
    parallelism)."""
    from .layout import current

    layout = current()
    if layout.cp == 1:
        return 1, 0, None
    return layout.cp, layout.cp_rank, layout.group("cp")


@dataclass(eq=False)
class ThdContext:
    """One forward's packed layout on this CP rank.

    ``cu_seqlens`` numbers the whole (padded) stream; the rank holds the contiguous slice
    ``layout.rows``. Build with :meth:`build`; plans and maps are cached per ratio."""

    layout: ThdLayout
    cp: int = 1
    cp_rank: int = 0
    group: Any = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens: Tensor, *, local_len: Optional[int] = None, cp: Optional[int] = None,
              cp_rank: Optional[int] = None, group: Any = None) -> "ThdContext":
        """Context for this rank. ``cp``/``cp_rank``/``group`` default to megatron's CP group.
        ``local_len`` (the rows this rank was given) is checked against the contiguous split."""
        if cp is None:
            cp, cp_rank, group = cp_group_info()
        cp_rank = int(cp_rank or 0)
        cu = validate_cu_seqlens(cu_seqlens)
        start, length = cp_local_range(int(cu[-1]), cp, cp_rank)
        if local_len is not None and int(local_len) != length:
            raise CpConfigError(
                f"rank {cp_rank} of cp={cp} was given {local_len} rows but cu_seqlens numbers a stream of "
                f"{int(cu[-1])} tokens ({length} per rank); pass this rank's contiguous slice of the packed stream"
            )
        return cls(ThdLayout(cu, start, length), cp, cp_rank, group)

    @classmethod
    def bshd(cls, seq_len_local: int) -> "ThdContext":
        """BSHD + CP (all-gather design): each sample is one segment of ``cp * seq_len_local`` tokens."""
        cp, rank, group = cp_group_info()
        cu = torch.tensor([0, cp * seq_len_local], dtype=torch.int64)
        return cls.build(cu, local_len=seq_len_local, cp=cp, cp_rank=rank, group=group)

    # --------------------------------------------------------------------------------------- facts
    @property
    def cu_seqlens(self) -> Tensor:
        return self.layout.cu_seqlens

    @property
    def total_tokens(self) -> int:
        return self.layout.total_tokens

    @property
    def local_len(self) -> int:
        return int(self.layout.local_len)

    def to(self, device) -> "ThdContext":
        if self.layout.cu_seqlens.device == torch.device(device):
            return self
        lay = ThdLayout(self.layout.cu_seqlens.to(device), self.layout.global_start, self.layout.local_len)
        return ThdContext(lay, self.cp, self.cp_rank, self.group)

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def check_boundary(self, ratio: int) -> None:
        width = compressor_boundary_width(ratio)
        if self.cp > 1 and self.local_len < width:
            raise CpConfigError(
                f"context parallelism cp={self.cp} gives each rank {self.local_len} tokens, fewer than the compressor "
                f"boundary width {width} of ratio {ratio}. Fix: pack at least {width} tokens per rank or lower --cp."
            )

    def plan(self, ratio: int):
        """``core.thd_cp.CompactPlan`` of the groups this rank owns (last token local)."""
        def make():
            self.check_boundary(ratio)
            return compact_plan(self.cu_seqlens, ratio, self.layout.global_start, self.local_len)
        return self._cached(("plan", ratio), make)

    def seq_to_rank(self, ratio: int) -> Tensor:
        """``[G]`` rank-major row of every flat (sequence-major) compressed group."""
        def make():
            cap = self.plan(ratio).capacity
            return compressed_rank_layout(self.cu_seqlens, ratio, self.local_len, self.cp, capacity=cap).seq_to_rank
        return self._cached(("s2r", ratio), make)

    def window_indices(self, window: int) -> Tensor:
        return self._cached(("win", window), lambda: window_indices(self.layout, window))

    def positions(self) -> Tensor:
        return self.layout.positions


# ------------------------------------------------------------------------------------- communication
class _AllGatherCP(torch.autograd.Function):
    """Concatenate every CP rank's ``[n, ...]`` along dim 0; backward sums the gradient over ranks and
    keeps this rank's ``n`` rows."""

    @staticmethod
    def forward(ctx, t: Tensor, group, cp: int, rank: int) -> Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(cp)]
        torch.distributed.all_gather(parts, t, group=group)
        ctx.group, ctx.rank, ctx.n = group, rank, t.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g.narrow(0, ctx.rank * ctx.n, ctx.n), None, None, None


def all_gather_cp(t: Tensor, ctx: ThdContext, dim: int = 0) -> Tensor:
    """All-gather ``t`` over the CP ranks along ``dim`` (rank order, i.e. stream order); autograd-safe."""
    if ctx.cp == 1:
        return t
    moved = t.movedim(dim, 0)
    out = _AllGatherCP.apply(moved, ctx.group, ctx.cp, ctx.cp_rank)
    return out.movedim(0, dim)


class _LeftBoundary(torch.autograd.Function):
    """The previous rank's last ``width`` rows (zeros on rank 0). Backward returns the gradient of
    those rows to the rank that owns them (the gradient this rank's tail received from rank + 1)."""

    @staticmethod
    def forward(ctx, x: Tensor, width: int, group, cp: int, rank: int) -> Tensor:
        tail = x[x.shape[0] - width:].contiguous()
        parts = [torch.empty_like(tail) for _ in range(cp)]
        torch.distributed.all_gather(parts, tail, group=group)
        ctx.group, ctx.cp, ctx.rank, ctx.width, ctx.n = group, cp, rank, width, x.shape[0]
        return parts[rank - 1] if rank > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous()
        parts = [torch.empty_like(g) for _ in range(ctx.cp)]
        torch.distributed.all_gather(parts, g, group=ctx.group)
        grad = g.new_zeros((ctx.n,) + tuple(g.shape[1:]))
        if ctx.rank + 1 < ctx.cp:
            grad[ctx.n - ctx.width:] = parts[ctx.rank + 1]
        return grad, None, None, None, None


def left_boundary(x: Tensor, width: int, ctx: ThdContext) -> Tensor:
    """``x [L, ...]`` (sequence first) -> the previous rank's last ``width`` rows ``[width, ...]``."""
    if ctx.cp == 1:
        return x.new_zeros((width,) + tuple(x.shape[1:]))
    if x.shape[0] < width:
        raise CpConfigError(f"rank holds {x.shape[0]} rows, fewer than the boundary width {width}")
    return _LeftBoundary.apply(x, width, ctx.group, ctx.cp, ctx.cp_rank)


def gather_sequence_cp(t: Tensor, ctx: ThdContext, dim: int = 0) -> Tensor:
    """No-autograd all-gather (results, token ids)."""
    if ctx.cp == 1:
        return t
    with torch.no_grad():
        return _AllGatherCP.apply(t.movedim(dim, 0), ctx.group, ctx.cp, ctx.cp_rank).movedim(0, dim)


# --------------------------------------------------------------------------------------- compressor
def compress_slots(comp, xc: Tensor, plan, inv_freq: Tensor, hadamard: Callable[[Tensor], Tensor]) -> Tensor:
    """Compressor math on pre-grouped slots.

    ``comp`` has ``linear_wkv``/``linear_wgate`` (``.weight [coff*c, C]``), ``ape [m, coff*c]``, ``norm``,
    ``ratio``, ``head_dim``, ``overlap``, ``rotate``. ``xc [cap, span, B, C]`` rows from
    :func:`core.thd_cp.compact_compressor_input`; ``span = 2m`` with the overlap (previous group's rows,
    then the own rows). Returns ``[B, cap, c]``; empty slots are zero."""
    m, c = comp.ratio, comp.head_dim
    cap, span, B, _ = xc.shape
    ct = compute_dtype(xc)
    xf = xc.to(ct)
    a = F.linear(xf, comp.linear_wkv.weight.to(ct))                  # [cap, span, B, coff*c]
    z = F.linear(xf, comp.linear_wgate.weight.to(ct))
    ape = comp.ape.to(ct)
    if comp.overlap:
        a = torch.cat((a[:, :m, :, :c], a[:, m:, :, c:]), dim=1)       # [cap, 2m, B, c]
        z = torch.cat((z[:, :m, :, :c] + ape[None, :, None, :c], z[:, m:, :, c:] + ape[None, :, None, c:]), dim=1)
    else:
        z = z + ape[None, :, None, :]
    valid = plan.valid.to(xc.device)                                   # [cap, span]
    slot_ok = valid.any(dim=1)                                         # [cap]
    z = z.masked_fill(~valid[:, :, None, None], float("-inf"))
    z = torch.where(slot_ok[:, None, None, None], z, torch.zeros((), dtype=z.dtype, device=z.device))
    out = (torch.softmax(z, dim=1) * a).sum(dim=1)                    # [cap, B, c]
    out = comp.norm(out.to(xc.dtype)).transpose(0, 1)                 # [B, cap, c]
    cos, sin = rope_cos_sin(inv_freq.to(xc.device), plan.rope_positions.clamp(min=0).to(xc.device))
    out = apply_rope(out, cos, sin)
    if comp.rotate:
        out = hadamard(out)
    return out * slot_ok.to(out.dtype)[None, :, None]


def compressed_kv(comps, x: Tensor, ctx: ThdContext, ratio: int, inv_freq: Tensor,
                  hadamard: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """Compressed entries of every compressor in ``comps`` (same ratio, same input ``x [B, L, C]``),
    each all-gathered rank-major: ``[B, cp * capacity, c]``. Flat group ``g`` is row
    ``ctx.seq_to_rank(ratio)[g]``. The boundary exchange and compaction are shared by the list."""
    plan = ctx.plan(ratio)
    xs = x.transpose(0, 1)                                             # [L, B, C]
    boundary = left_boundary(xs, plan.boundary_width, ctx)
    xc = compact_compressor_input(xs, boundary, plan)                 # [cap, span, B, C]
    return [all_gather_cp(compress_slots(comp, xc, plan, inv_freq, hadamard), ctx, dim=1) for comp in comps]


def hca_indices(ctx: ThdContext, ratio: int, offset: int) -> Tensor:
    """Static index set of a ratio-``ratio`` layer: every complete group of the query's own segment,
    as rows of ``cat(tokens, rank-major compressed)`` (``offset`` = number of token rows)."""
    return compressed_visible_indices(ctx.layout, ratio, seq_to_rank=ctx.seq_to_rank(ratio), offset=offset)


# ------------------------------------------------------------------------------------------ indexer
def indexer_visible_mask(ctx: ThdContext, n_groups: int, device=None) -> Tensor:
    """``[L, G]``: flat group ``j`` is visible to the local query (its segment, complete)."""
    ks, ke = indexer_ranges(ctx.layout, 4)
    j = torch.arange(n_groups, device=device)[None, :]
    return (j >= ks.to(device)[:, None]) & (j < ke.to(device)[:, None])


def indexer_topk(scores: Tensor, ctx: ThdContext, topk: int, ratio: int = 4) -> Tensor:
    """:func:`segment_topk` on this rank's layout."""
    return segment_topk(scores, ctx.layout, topk, ratio)


def segment_topk(scores: Tensor, layout: ThdLayout, topk: int, ratio: int = 4) -> Tensor:
    """``scores [B, L, G]`` (this rank's ``L`` query rows; ``-inf`` where invisible) -> flat group ids
    ``[B, L, min(topk, max_seqlen // ratio)]``, each row's picks in ascending id order, ``-1`` padding last.

    :func:`~kernels.reference.topk.stable_topk` runs per segment on the segment's own ``[L_b, L_b // ratio]``
    block: the rule is shift-invariant, so these are the picks of the sample run alone, and the work
    scales with the segments, not with the packed stream's ``G``."""
    B, L, _ = scores.shape
    width = min(topk, layout.max_seqlen // ratio)
    out = torch.full((B, L, width), -1, dtype=torch.long, device=scores.device)
    if width == 0 or L == 0:
        return out
    s = scores.detach()
    cu = layout.host_cu_seqlens()
    cu_c = layout.host_compressed_cu_seqlens(ratio)
    g0 = layout.global_start
    for b in range(layout.num_segments):
        r0, r1 = max(cu[b] - g0, 0), min(cu[b + 1] - g0, L)
        c0, c1 = cu_c[b], cu_c[b + 1]
        if r1 <= r0 or c1 == c0:
            continue
        top = stable_topk(s[:, r0:r1, c0:c1], topk)
        out[:, r0:r1, :top.shape[-1]] = torch.where(top >= 0, top + c0, top)
    return out


def replayed_segment_picks(indexer, picks: Tensor, layout: ThdLayout, ratio: int = 4) -> Tensor:
    """The indexer-replay seam (:func:`kernels.reference.indexer.indexer_hook`) for the flat per-segment picks
    ``[B, L, k]`` of :func:`segment_topk` (each segment's compressed start added): the hook sees segment-local
    ids (the blocks of the query's own sequence, as the reference forward of that sequence alone numbers them)
    and its answer is made flat again. No hook installed: ``picks`` unchanged."""
    from kernels.reference.indexer import current_indexer_hook

    hook = current_indexer_hook()
    if hook is None:
        return picks
    L = picks.shape[1]
    cu, cu_c, g0 = layout.host_cu_seqlens(), layout.host_compressed_cu_seqlens(ratio), layout.global_start
    off = torch.zeros(L, dtype=picks.dtype)
    for b in range(layout.num_segments):
        r0, r1 = max(cu[b] - g0, 0), min(cu[b + 1] - g0, L)
        if r1 > r0:
            off[r0:r1] = cu_c[b]
    off = off.to(picks.device)[None, :, None]
    out = hook(indexer, torch.where(picks >= 0, picks - off, picks))
    return torch.where(out >= 0, out + off, out)


def picks_to_rows(picks: Tensor, ctx: ThdContext, ratio: int, offset: int) -> Tensor:
    """Flat (sequence-major) compressed ids -> rows of ``cat(tokens, rank-major compressed)``."""
    rows = to_rank_major(picks, ctx.seq_to_rank(ratio))
    return torch.where(rows >= 0, rows + offset, rows)
