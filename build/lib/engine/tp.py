"""Tensor-parallel sharding metadata and helpers.

Every TP-sharded tensor carries megatron's attributes (``tensor_model_parallel=True``,
``partition_dim``, ``partition_stride=1``) plus ``dsv4_tp_chunks``: the full tensor is
``chunks`` equal blocks along ``partition_dim`` (2 for a SwiGLU ``linear_fc1`` = cat(gate, up)),
and rank ``r`` holds the ``r``-th slice *of each block*, concatenated. Replicated tensors
have no ``tensor_model_parallel`` attribute (or it is False).

``mark_keep_in_fp32`` flags tensors that stay fp32 when a module is cast (see
``engine.layers.KeepFP32Module``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["mark_tp", "tp_spec", "shard_tensor", "gather_tensor", "full_shape", "tp_pieces", "mark_keep_in_fp32",
           "keeps_fp32"]


def mark_tp(t: torch.Tensor, dim: int, chunks: int = 1) -> torch.Tensor:
    t.tensor_model_parallel = True
    t.partition_dim = dim
    t.partition_stride = 1
    t.dsv4_tp_chunks = chunks
    return t


def tp_spec(t: torch.Tensor) -> Optional[tuple]:
    """``(dim, chunks)`` for a TP-sharded tensor, None for a replicated one."""
    if not getattr(t, "tensor_model_parallel", False):
        return None
    return int(t.partition_dim), int(getattr(t, "dsv4_tp_chunks", 1))


def shard_tensor(full: torch.Tensor, spec: Optional[tuple], rank: int, world: int) -> torch.Tensor:
    """This rank's part of ``full`` (``spec`` from :func:`tp_spec`; None -> ``full``)."""
    if spec is None or world == 1:
        return full
    dim, chunks = spec
    blocks = torch.chunk(full, chunks, dim=dim)
    parts = []
    for b in blocks:
        size = b.shape[dim]
        if size % world:
            raise ValueError(f"dim {dim} block of size {size} does not split over {world} TP ranks")
        parts.append(b.narrow(dim, rank * (size // world), size // world))
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def gather_tensor(local: torch.Tensor, spec: Optional[tuple], group=None) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over the TP group (all-gather; every rank gets ``full``)."""
    import torch.distributed as dist

    if spec is None or group is None or dist.get_world_size(group) == 1:
        return local
    world = dist.get_world_size(group)
    dim, chunks = spec
    bufs = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(bufs, local.contiguous(), group=group)
    per_rank = [torch.chunk(b, chunks, dim=dim) for b in bufs]
    blocks = [torch.cat([per_rank[r][c] for r in range(world)], dim=dim) for c in range(chunks)]
    return torch.cat(blocks, dim=dim) if chunks > 1 else blocks[0]


def full_shape(local_shape, spec: Optional[tuple], world: int) -> tuple:
    """The full tensor's shape of a rank's ``local_shape`` (``spec`` from :func:`tp_spec`)."""
    shape = list(local_shape)
    if spec is not None and world > 1:
        shape[spec[0]] *= world
    return tuple(shape)


def tp_pieces(flat: torch.Tensor, local_shape, start: int, spec: Optional[tuple], rank: int, world: int) -> list:
    """Where a rank's data lies in the FULL tensor, as checkpoint pieces ``[(full offsets, view of flat)]``.

    ``flat``: the elements ``[start, start + flat.numel())`` of this rank's tensor of ``local_shape``
    flattened (the whole tensor: ``start`` 0; the distributed optimizer's data-parallel range otherwise).
    The range is cut into boxes (``core.dcp_shards.flat_range_boxes``), and a box crossing a block of a
    ``chunks > 1`` tensor (rank ``r`` holds the ``r``-th slice of each block) into one piece per block: each
    piece is a box of the full tensor. The views share ``flat``'s memory, so reading into them fills it."""
    from core.dcp_shards import flat_range_boxes

    local_shape = tuple(local_shape)
    out = []
    pos = start
    for offsets, sizes in flat_range_boxes(local_shape, start, start + flat.numel()):
        n = 1
        for s in sizes:
            n *= s
        box = flat[pos - start:pos - start + n].view(sizes)
        pos += n
        if spec is None or world == 1:
            out.append((tuple(offsets), box))
            continue
        dim, chunks = spec
        b = local_shape[dim] // chunks                      # this rank's rows of one block
        lo, hi = offsets[dim], offsets[dim] + sizes[dim]
        for c in range(lo // b, (hi - 1) // b + 1):
            a, z = max(lo, c * b), min(hi, (c + 1) * b)
            full_off = list(offsets)
            full_off[dim] = c * b * world + rank * b + (a - c * b)
            out.append((tuple(full_off), box.narrow(dim, a - lo, z - a)))
    return out


def mark_keep_in_fp32(t: torch.Tensor) -> torch.Tensor:
    t._keep_fp32 = True
    return t


def keeps_fp32(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_keep_fp32", False))
