"""Packed-sequence (THD) layout and index builders for DeepSeek-V4 attention.

Pure functions of ``cu_seqlens``: no model state, no communication. Every builder is vectorized
torch code; outputs live on the device of ``cu_seqlens`` (CPU in tests).

Conventions
-----------
* ``cu_seqlens``: int64 ``[n_seg + 1]``, ``cu_seqlens[0] == 0``, non-decreasing; segment ``b``
  occupies stream rows ``[cu[b], cu[b+1])``. Zero-length segments are allowed (they own no row).
  ``cu_seqlens`` always numbers the *whole* packed stream, also under context parallelism (CP),
  and must cover it: padding is a segment of its own (see :mod:`core.packing`), so pad rows never
  join a real sample's window or compressed groups.
* Row indices are **global stream rows** (under CP: rows of the all-gathered KV). A rank that holds
  rows ``[global_start, global_start + local_len)`` builds indices for its own queries only.
* Position within a segment (``positions``) is ``row - cu[segment]``: RoPE restarts at 0 at every
  segment start, exactly as if each sample ran alone.
* Invalid index entries are ``-1``.

Index sets per query (row ``t``, segment ``b``, local position ``p``), matching the reference
model run on each sample alone (architecture.md §2.2-2.4):

* Window: the ``window`` (=128, incl. the query) keys ``t-window+1 .. t``, clamped to the segment
  start. Column ``j`` holds key ``t - window + 1 + j`` (right-aligned, ``-1`` where that key is
  before the segment start), the same column convention as
  ``kernels.reference.attention.window_indices``.
* Compressed groups (ratio ``m``) are formed **within** each segment: a segment of length ``L``
  yields ``L // m`` groups; group ``c`` covers the segment's tokens ``[c*m, c*m + m - 1]`` and gets
  RoPE position ``c*m`` (its first token's local position). For the overlapping ratio-4
  compressor, entry ``c`` also pools the previous group ``c-1`` of the *same* segment (tokens
  ``[4c-4, 4c+3]``); a segment's first group has no previous group (``-1``: kv 0, score -inf).
  The flat compressed list is segment-major: ``compressed_cu_seqlens`` numbers it.
* Compressed visibility: groups ``c < floor((p+1)/m)`` of the query's own segment (a group is
  visible once complete). HCA (ratio 128) layers attend to all of them (static set, padded with
  ``-1`` to a fixed width); CSA (ratio 4) layers let the indexer pick the top-k inside the
  per-query range ``[ks, ke)`` of the flat compressed list.

Design decision: tails are dropped, not padded
----------------------------------------------
The trailing ``L % m`` tokens of a segment produce **no** compressed entry; those queries see the
tail through the sliding window only (``window >= m`` for every ratio used: 128 >= 4, 128 >= 128).
This is exactly what inference does for a sample of length ``L`` (prefill emits only complete
blocks, ``floor(L/m)`` entries; decode emits an entry only when ``(pos+1) % m == 0``), so the
training index sets equal the inference ones token for token. The alternative, padding every
sample to a multiple of ``m`` (or of 128), would either make the tail a compressed entry built from
pad tokens (a train/inference mismatch for the next tokens generated from it) or require masking
it back out, and it wastes up to ``m - 1`` (127) tokens per sample. Dropping the tail costs
nothing, keeps no per-sample divisibility constraint, and lets packing fill the budget tightly.

Public API
----------
* ``WINDOW = 128``
* ``CpConfigError(ValueError)``; ``cp_local_range(total_tokens, cp, rank) -> (global_start, local_len)``
  (rank ``r`` of ``cp`` holds the contiguous slice ``[r*T/cp, (r+1)*T/cp)``; :mod:`core.thd_cp`
  re-exports both)
* ``validate_cu_seqlens(cu_seqlens) -> Tensor`` (int64, checked)
* ``segment_ids(cu_seqlens, rows) -> Tensor``: segment of each global row.
* ``has_overlap(ratio) -> bool``: True for ratio 4 (the overlapping CSA compressor).
* ``compressed_cu_seqlens(cu_seqlens, ratio) -> Tensor``: ``[0, cumsum(len_b // ratio)]``.
* ``CompressedGroups`` (frozen dataclass) and ``compressed_groups(cu_seqlens, ratio)``: per flat
  group ``segment``, ``index_in_segment``, ``first_token``, ``last_token``, ``rope_positions``,
  ``prev_group`` (-1 at a segment's first group); ``gather_index() -> [G, m]`` token rows;
  ``overlap_gather_index() -> [G, 2m]`` (previous group's rows, -1 if none, then own rows).
* ``ThdLayout(cu_seqlens, global_start=0, local_len=None)`` (frozen dataclass) with
  ``ThdLayout.for_cp_rank(cu_seqlens, cp, rank)``; derived per local row: ``rows`` (global),
  ``segment_ids``, ``positions``, ``segment_starts``, ``segment_ends``; plus ``num_segments``,
  ``total_tokens``, ``max_seqlen``, ``seqlens``; methods forwarding to the builders below.
* ``window_indices(layout, window=WINDOW) -> [T_local, window]`` global key rows.
* ``compressed_visible_indices(layout, ratio, width=None, *, seq_to_rank=None, offset=0)
  -> [T_local, width]``: flat compressed indices (or rank-major rows via ``seq_to_rank``) plus
  ``offset`` (e.g. the number of window-KV rows in a ``[tokens | compressed]`` KV), ``-1`` invalid.
* ``indexer_ranges(layout, ratio) -> (ks, ke)``: int64 ``[T_local]`` each, ``[ks, ke)`` into the
  flat (sequence-major) compressed list.

The context-parallel maps (ownership, compaction, rank-major rows) are in :mod:`core.thd_cp`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "pack_rows",
    "WINDOW",
    "CompressedGroups",
    "CpConfigError",
    "ThdLayout",
    "compressed_cu_seqlens",
    "compressed_groups",
    "compressed_visible_indices",
    "cp_local_range",
    "has_overlap",
    "indexer_ranges",
    "segment_ids",
    "validate_cu_seqlens",
    "window_indices",
]

WINDOW = 128


class CpConfigError(ValueError):
    """An invalid context-parallel configuration (raised at parse time or when building maps)."""


def cp_local_range(total_tokens: int, cp: int, rank: int) -> tuple[int, int]:
    """``(global_start, local_len)`` of ``rank``'s contiguous slice of a stream of ``total_tokens`` rows."""
    if cp < 1 or not 0 <= rank < cp:
        raise CpConfigError(f"need cp >= 1 and 0 <= rank < cp, got cp={cp}, rank={rank}")
    if total_tokens % cp:
        raise CpConfigError(
            f"packed stream of {total_tokens} tokens does not split evenly over cp={cp} ranks; "
            f"pad the stream to a multiple of {cp} (core.packing does this)"
        )
    local = total_tokens // cp
    return rank * local, local


def validate_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Check ``cu_seqlens`` (1-D integer, starts at 0, non-decreasing) and return it as int64."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n_seg + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool or cu_seqlens.is_complex():
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    return cu


def pack_rows(input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, S]`` rows -> one THD stream ``[B*S]`` and its ``cu_seqlens [B+1]`` (int64; one segment per
    row, so a row never sees another; padding rows stay inside their own segment)."""
    B, S = input_ids.shape
    if B < 1:
        raise ValueError(f"pack_rows needs at least one row, got shape {tuple(input_ids.shape)}")
    # valid by construction (starts at 0, steps of S >= 0): not checked, as validate_cu_seqlens would read it
    # back to the host, a synchronisation per micro-batch on a GPU
    cu = torch.arange(B + 1, dtype=torch.int64, device=input_ids.device) * S
    return input_ids.reshape(-1), cu


def segment_ids(cu_seqlens: Tensor, rows: Tensor) -> Tensor:
    """Segment id of each global row: ``b`` with ``cu[b] <= row < cu[b+1]`` (zero-length segments skipped)."""
    # Number of segment ends <= row == index of the segment holding row.
    return torch.searchsorted(cu_seqlens[1:].contiguous(), rows.to(cu_seqlens.dtype), right=True)


def has_overlap(ratio: int) -> bool:
    """Whether compressor entries of this ratio also pool the previous group (only ratio 4, CSA)."""
    return ratio == 4


def _check_ratio(ratio: int) -> int:
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"compress ratio must be a positive int, got {ratio!r}")
    return ratio


def compressed_cu_seqlens(cu_seqlens: Tensor, ratio: int) -> Tensor:
    """``[0, cumsum(len_b // ratio)]``: the segment boundaries of the flat compressed list (tails dropped)."""
    cu = validate_cu_seqlens(cu_seqlens)
    m = _check_ratio(ratio)
    n = (cu[1:] - cu[:-1]) // m
    return torch.cat([cu.new_zeros(1), torch.cumsum(n, 0)])


@dataclass(frozen=True, eq=False)
class CompressedGroups:
    """The flat (segment-major) list of compressed groups of a packed stream for one ratio.

    All tensors are int64 ``[G]`` with ``G = cu_seqlens_compressed[-1]``. Token rows are global."""

    ratio: int
    cu_seqlens_compressed: Tensor
    segment: Tensor
    index_in_segment: Tensor
    first_token: Tensor
    rope_positions: Tensor
    prev_group: Tensor

    @property
    def num_groups(self) -> int:
        return int(self.segment.numel())

    @property
    def last_token(self) -> Tensor:
        return self.first_token + (self.ratio - 1)

    def gather_index(self) -> Tensor:
        """``[G, ratio]`` stream rows of each group's tokens, in order."""
        return self.first_token[:, None] + torch.arange(self.ratio, device=self.first_token.device)

    def overlap_gather_index(self) -> Tensor:
        """``[G, 2*ratio]``: the previous group's rows (``-1`` at a segment's first group), then the own rows.

        Row ``c`` of the overlapping compressor pools exactly these tokens: the first half feeds the
        ``[0:c]`` channel series (scores ``-inf`` where ``-1``), the second half the ``[c:2c]`` one."""
        own = self.gather_index()
        prev = torch.where((self.prev_group >= 0)[:, None], own - self.ratio, torch.full_like(own, -1))
        return torch.cat([prev, own], dim=1)


def compressed_groups(cu_seqlens: Tensor, ratio: int) -> CompressedGroups:
    """Enumerate the compressed groups formed within each segment (``len_b // ratio`` per segment)."""
    cu = validate_cu_seqlens(cu_seqlens)
    m = _check_ratio(ratio)
    cu_c = compressed_cu_seqlens(cu, m)
    flat = torch.arange(int(cu_c[-1]), device=cu.device, dtype=torch.int64)
    seg = segment_ids(cu_c, flat)
    c = flat - cu_c[seg]
    return CompressedGroups(
        ratio=m,
        cu_seqlens_compressed=cu_c,
        segment=seg,
        index_in_segment=c,
        first_token=cu[seg] + c * m,
        rope_positions=c * m,
        prev_group=torch.where(c > 0, flat - 1, torch.full_like(flat, -1)),
    )


@dataclass(frozen=True, eq=False)
class ThdLayout:
    """Layout of one rank's rows of a packed stream.

    ``cu_seqlens`` numbers the whole stream; the rank holds global rows
    ``[global_start, global_start + local_len)`` (``local_len`` defaults to the rest of the stream).
    Derived (read-only) per local row: ``rows`` (global index), ``segment_ids``, ``positions``
    (within the segment; the RoPE position), ``segment_starts``/``segment_ends`` (global rows)."""

    cu_seqlens: Tensor
    global_start: int = 0
    local_len: int | None = None
    rows: Tensor = field(init=False, repr=False)
    segment_ids: Tensor = field(init=False, repr=False)
    positions: Tensor = field(init=False, repr=False)
    segment_starts: Tensor = field(init=False, repr=False)
    segment_ends: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        cu = validate_cu_seqlens(self.cu_seqlens)
        total = int(cu[-1])
        start = int(self.global_start)
        length = total - start if self.local_len is None else int(self.local_len)
        if start < 0 or length < 0 or start + length > total:
            raise ValueError(
                f"local rows [{start}, {start + length}) are outside the packed stream [0, {total}); "
                "cu_seqlens must number the whole (padded) stream, with padding as its own segment"
            )
        rows = torch.arange(start, start + length, device=cu.device, dtype=torch.int64)
        seg = segment_ids(cu, rows)
        starts = cu[seg]
        set_ = object.__setattr__
        set_(self, "cu_seqlens", cu)
        set_(self, "global_start", start)
        set_(self, "local_len", length)
        set_(self, "rows", rows)
        set_(self, "segment_ids", seg)
        set_(self, "positions", rows - starts)
        set_(self, "segment_starts", starts)
        set_(self, "segment_ends", cu[seg + 1])
        set_(self, "_derived", {})  # see _memo; a plain attribute so torch.compile traces the lookups

    @classmethod
    def for_cp_rank(cls, cu_seqlens: Tensor, cp: int, rank: int) -> "ThdLayout":
        """Rank ``rank`` of ``cp`` holds the contiguous slice ``[rank*T/cp, (rank+1)*T/cp)``."""
        cu = validate_cu_seqlens(cu_seqlens)
        start, length = cp_local_range(int(cu[-1]), cp, rank)
        return cls(cu, start, length)

    # Everything derived below is computed once per layout and kept (``_memo``): a layout reused across
    # steps then costs no host synchronisation and no repeated index building. Callers must treat the
    # returned tensors as read-only. Inside code being compiled by torch.compile, tensors are built in the
    # graph instead of kept: a tensor made by a compiled graph belongs to it (with CUDA graphs, the next
    # replay overwrites it), so only eagerly built tensors and host values are cached.
    def _memo(self, key, build, tensor: bool = True):
        memo = self._derived
        if key in memo:
            return memo[key]
        if tensor and torch.compiler.is_compiling():
            return build()
        memo[key] = value = build()
        return value

    # ---------------------------------------------------------------- whole-stream facts
    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def total_tokens(self) -> int:
        return self._memo("total", lambda: int(self.cu_seqlens[-1]), tensor=False)

    @property
    def seqlens(self) -> Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def max_seqlen(self) -> int:
        return self._memo("max_seqlen", lambda: int(self.seqlens.max()), tensor=False)

    def host_cu_seqlens(self) -> list[int]:
        """``cu_seqlens`` as a host list (read once)."""
        return self._memo("host_cu", lambda: self.cu_seqlens.tolist(), tensor=False)

    def host_compressed_cu_seqlens(self, ratio: int) -> list[int]:
        return self._memo(("host_cu_c", ratio), lambda: self.compressed_cu_seqlens(ratio).tolist(), tensor=False)

    # ---------------------------------------------------------------- builders
    def shortened(self) -> tuple[Tensor, "ThdLayout"]:
        """``(keep [T'] int64 rows, layout)``: every row but each segment's last, and the layout of those rows
        (each segment one shorter): the stream of the next MTP depth. Selecting the rows by index gives a boolean
        mask's values and gradients without its host read; kept like the rest, so a reused layout's depth costs
        no host synchronisation (the new layout's checks included)."""
        def build():
            keep = self.positions < (self.segment_ends - self.segment_starts - 1)
            lens = (self.seqlens - 1).clamp(min=0)
            return keep.nonzero().squeeze(1), ThdLayout(torch.cat((lens.new_zeros(1), torch.cumsum(lens, 0))))
        return self._memo("shortened", build)

    def window_indices(self, window: int = WINDOW) -> Tensor:
        return self._memo(("window", window), lambda: window_indices(self, window))

    def compressed_cu_seqlens(self, ratio: int) -> Tensor:
        return self._memo(("cu_c", ratio), lambda: compressed_cu_seqlens(self.cu_seqlens, ratio))

    def compressed_groups(self, ratio: int) -> CompressedGroups:
        return self._memo(("groups", ratio), lambda: compressed_groups(self.cu_seqlens, ratio))

    def compressed_visible_indices(self, ratio: int, width: int | None = None, *,
                                   seq_to_rank: Tensor | None = None, offset: int = 0) -> Tensor:
        if seq_to_rank is not None:
            return compressed_visible_indices(self, ratio, width, seq_to_rank=seq_to_rank, offset=offset)
        return self._memo(("visible", ratio, width, offset),
                          lambda: compressed_visible_indices(self, ratio, width, offset=offset))

    def indexer_ranges(self, ratio: int) -> tuple[Tensor, Tensor]:
        return self._memo(("ranges", ratio), lambda: indexer_ranges(self, ratio))

    def prepare(self, window: int, ratios) -> "ThdLayout":
        """Build, eagerly, everything the attention layers derive for this window and these compress
        ratios, so that compiled blocks (``engine.compile``) only read them. A layout first derived inside
        compiled code gets graph-owned tensors, which are not kept (see ``_memo``) and, under CUDA graphs,
        are overwritten by the next replay of the same graph: models call this before their blocks."""
        self.host_cu_seqlens()
        self.max_seqlen
        self.window_indices(window)
        for ratio in sorted({int(r) for r in ratios if r}):
            self.compressed_groups(ratio)
            self.host_compressed_cu_seqlens(ratio)
            self.compressed_visible_indices(ratio, offset=int(self.local_len))
            if ratio == 4:  # the indexer's layer
                self.compressed_visible_indices(ratio)
                self.indexer_ranges(ratio)
        return self

    def replace(self, **changes) -> "ThdLayout":
        return dataclasses.replace(self, **changes)


def window_indices(layout: ThdLayout, window: int = WINDOW) -> Tensor:
    """``[T_local, window]`` global key rows; column ``j`` = ``t - window + 1 + j`` if that is in the
    query's segment, else ``-1``. The last column is the query itself."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    t = layout.rows[:, None]
    keys = t - (window - 1) + torch.arange(window, device=t.device)
    return torch.where(keys >= layout.segment_starts[:, None], keys, torch.full_like(keys, -1))


def _n_visible(layout: ThdLayout, ratio: int) -> Tensor:
    # (p + 1) // m <= len // m always since p < len: no clamp to the segment's group count needed.
    return (layout.positions + 1) // _check_ratio(ratio)


def compressed_visible_indices(layout: ThdLayout, ratio: int, width: int | None = None, *,
                               seq_to_rank: Tensor | None = None, offset: int = 0) -> Tensor:
    """``[T_local, width]``: column ``c`` holds the flat compressed index of group ``c`` of the query's
    segment if ``c < floor((p+1)/ratio)``, else ``-1``. This is the static HCA (ratio 128) index set.

    ``width`` defaults to the largest per-segment group count (``max_seqlen // ratio``); pass a fixed
    width (e.g. ``max_tokens // ratio``) for static shapes; too small a width raises. With
    ``seq_to_rank`` (from :func:`core.thd_cp.compressed_rank_layout`) the entries are rank-major rows
    of the all-gathered compressed KV instead. ``offset`` is added to every valid entry."""
    cu_c = compressed_cu_seqlens(layout.cu_seqlens, ratio)
    need = int(((layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]) // ratio).max())
    if width is None:
        width = need
    elif width < need:
        raise ValueError(f"width {width} < {need} = the largest segment's number of ratio-{ratio} groups")
    n_vis = _n_visible(layout, ratio)
    c = torch.arange(width, device=layout.rows.device)[None, :]
    idx = cu_c[layout.segment_ids][:, None] + c
    valid = c < n_vis[:, None]
    if seq_to_rank is not None:
        idx = seq_to_rank[torch.where(valid, idx, torch.zeros_like(idx))] if seq_to_rank.numel() else idx
        valid = valid & (idx >= 0)
    return torch.where(valid, idx + offset, torch.full_like(idx, -1))


def indexer_ranges(layout: ThdLayout, ratio: int) -> tuple[Tensor, Tensor]:
    """Per-query ``[ks, ke)`` into the flat (sequence-major) compressed list: the visible groups of the
    query's own segment, ``ks = cu_c[b]``, ``ke = ks + floor((p+1)/ratio)`` (``ke == ks``: none)."""
    cu_c = compressed_cu_seqlens(layout.cu_seqlens, ratio)
    ks = cu_c[layout.segment_ids]
    return ks, ks + _n_visible(layout, ratio)
