"""Tensors in torch.distributed.checkpoint (DCP) folders as per-rank *pieces*: every rank writes the boxes it
holds, any rank reads any box.

Why: a full-size model (V4-Flash, ~280B parameters over 8-16 nodes) cannot be gathered onto one rank to be
saved, and a rank that resumes must not read tensors it does not hold. DCP already stores a tensor as
rectangular chunks (offsets and sizes inside the tensor's global shape, one ``ChunkStorageMetadata`` each)
and reads any box by combining the chunks that overlap it; this module only tells DCP which boxes a rank
holds, through a save planner and a load planner:

* a *piece* is ``(global offsets, tensor)``: a box of a tensor whose global shape is known. A tensor-parallel
  slice is one piece (two for a SwiGLU ``linear_fc1``, whose two halves are split separately), an expert
  held by one expert-parallel rank is one piece at offset 0, a data-parallel range of the distributed
  optimizer's flat state is a few pieces (:func:`flat_range_boxes`);
* :func:`save_pieces` is collective over ``group``: each rank sends DCP its pieces, DCP's coordinator checks
  that the pieces cover every tensor exactly once (after dropping replicas: a piece several ranks hold is
  written by one of them), each rank writes its own ``__<rank>_<n>.distcp`` files, and the coordinator writes
  ``.metadata`` once every rank is done;
* :func:`load_pieces` is per rank (no communication): it reads into the given pieces only the stored chunks
  that overlap them, through the caller's reader (``core.native_checkpoint`` reads ``.metadata`` through an
  allow-list; nothing is unpickled otherwise). A folder written by another layout, or as whole tensors by an
  earlier version, is read the same way: resharding is DCP's overlap arithmetic.

A stored chunk is the unit of reading: a rank reads every chunk that overlaps its box, whole.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

Piece = Tuple[Tuple[int, ...], torch.Tensor]          # (global offsets, tensor of the box's sizes)
Sharded = Tuple[Tuple[int, ...], List[Piece]]         # (global shape, this rank's pieces)
Box = Tuple[Tuple[int, ...], Tuple[int, ...]]         # (offsets, sizes)

__all__ = ["Piece", "Sharded", "flat_range_boxes", "save_pieces", "load_pieces", "stored_chunks"]


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """Boxes, in row-major order, that cover exactly the elements ``[start, end)`` of a tensor of ``shape``
    flattened; each box's elements are consecutive in that flattening (so a flat buffer of the range is the
    boxes' data back to back). At most two boxes per dimension."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out: List[Box] = []

    def rows(row: int, lo: int, hi: int) -> List[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    row = start // inner
    if start % inner:                                   # a partial first row
        stop = min(end, (row + 1) * inner)
        out += rows(row, start - row * inner, stop - row * inner)
        start, row = stop, row + 1
    full = (end - start) // inner
    if full:                                            # whole rows
        out.append(((row,) + (0,) * (len(shape) - 1), (full, *shape[1:])))
        start, row = start + full * inner, row + full
    if start < end:                                     # a partial last row
        out += rows(row, 0, end - start)
    return out


def _check(name: str, shape: Tuple[int, ...], pieces: Sequence[Piece]) -> None:
    for offsets, t in pieces:
        if len(offsets) != len(shape) or t.dim() != len(shape) or any(
                o < 0 or o + s > g for o, s, g in zip(offsets, t.shape, shape)):
            raise ValueError(f"{name}: piece at {tuple(offsets)} of shape {tuple(t.shape)} is not inside {shape}")


class _PieceSavePlanner:
    """DCP's default save planner, fed with pieces instead of a state dict (built lazily: torch imports)."""

    @staticmethod
    def make(tensors: Mapping[str, Sharded]):
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

        class Planner(DefaultSavePlanner):
            def __init__(self):
                super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
                self._data: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
                self._items = []
                for name, (shape, pieces) in tensors.items():
                    _check(name, tuple(shape), pieces)
                    for offsets, t in pieces:
                        t = t.detach()
                        off = torch.Size(offsets)
                        self._data[(name, tuple(offsets))] = t
                        self._items.append(WriteItem(
                            index=MetadataIndex(name, off), type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                        properties=TensorProperties.create_from_tensor(t),
                                                        size=torch.Size(shape))))

            def create_local_plan(self):
                self.plan = SavePlan(list(self._items))
                return self.plan

            def lookup_object(self, index):
                return self._data[(index.fqn, tuple(index.offset))]

        return Planner()


def save_pieces(path, tensors: Mapping[str, Sharded], *, group=None, distributed: bool = True) -> None:
    """Write ``tensors`` (name -> (global shape, this rank's pieces)) into the DCP folder ``path`` (it exists;
    every rank of ``group`` sees the same folder). Collective over ``group`` when ``distributed`` (the default
    process group when ``group`` is None); ``distributed=False``: this process alone writes every piece."""
    import torch.distributed.checkpoint as dcp

    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
        dcp.save({}, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
                 planner=_PieceSavePlanner.make(tensors), process_group=group, no_dist=not distributed)


def stored_chunks(md, name: str) -> List[Box]:
    """The chunks DCP metadata ``md`` records for ``name``: ``[(offsets, sizes)]``."""
    return [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[name].chunks]


def load_pieces(reader, md, wanted: Mapping[str, Sequence[Piece]]) -> None:
    """Fill each piece of ``wanted`` (stored name -> pieces) from the folder ``reader`` (a DCP storage reader
    whose metadata is ``md``, already read safely by the caller), reading only the stored chunks that overlap
    the pieces. Raises ``ValueError`` when a tensor's stored chunks do not cover its shape (the box would stay
    unread)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    for name, pieces in wanted.items():
        item = md.state_dict_metadata[name]
        shape = tuple(item.size)
        _check(name, shape, pieces)
        if sum(math.prod(c.sizes) for c in item.chunks) != math.prod(shape):   # DCP's save forbids overlaps
            raise ValueError(f"{name}: the stored chunks do not cover its shape {shape}")

    class Planner(DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for name, pieces in wanted.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in pieces]
                items += create_read_items_for_chunk_list(name, md.state_dict_metadata[name], chunks)
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return wanted[index.fqn][index.index][1]

    if not wanted:
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
        dcp.load({}, storage_reader=reader, planner=Planner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
