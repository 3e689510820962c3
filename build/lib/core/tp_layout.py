"""Which dimension tensor parallelism splits each contract tensor along, and the DCP chunks a one-process
writer (``dsv4 convert``) stores such a tensor as, so that a tensor-parallel rank reads only its slice.

Why: DCP reads a stored chunk whole (``core.dcp_shards``), so a native checkpoint holding each tensor as one
chunk makes every tensor-parallel rank read every tensor it slices in full: at ``--tp 8`` each rank reads
8x its share of the embedding, the output layer and the experts. Stored as equal chunks along the split
dimension, cut at every boundary the tensor-parallel sizes 2, 4 and 8 cut at, a rank's slice is a union of
whole chunks: it reads exactly its share. The folder stays a plain DCP checkpoint: any DCP reader (a
one-rank load, megatron-core's, another layout's) combines the chunks like any sharded save.

The split of each tensor is the ``miles`` layout (``engine.tp.mark_tp`` and megatron-core's parallel
linears in ``backends/miles`` and ``engine/moe.py``; the ``megatron`` implementation runs at tensor
parallel 1): ``tests/impl_miles/test_native_tp_chunks.py`` holds this table to the ``engine.tp.tp_spec`` of
every tensor of a model built at ``--tp 2``. A tensor this table gets wrong still loads (DCP's overlap
arithmetic reads whatever chunks cover a slice), only less economically.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

from core.weight_contract import canonical_native_name

__all__ = ["MAX_TP", "TP_SPLITS", "tp_split", "tp_chunk_boxes"]

#: The largest tensor-parallel size a converted checkpoint is cut for (one node's GPUs); a larger one still
#: loads, each rank reading the chunk its slice lies in.
MAX_TP = 8

#: ``(native-name suffix regex, split dim, blocks)``; ``blocks`` > 1: the tensor is that many equal blocks
#: along the dim, each split over the ranks separately (``linear_fc1`` = cat(gate, up)), as ``engine.tp``.
TP_SPLITS: Tuple[Tuple[str, int, int], ...] = (
    (r"embedding\.word_embeddings\.weight", 0, 1),            # VocabParallelEmbedding: vocab rows
    (r"output_layer\.weight", 0, 1),                          # ColumnParallelLinear: vocab rows
    (r"self_attention\.linear_q_up_proj\.weight", 0, 1),      # heads
    (r"self_attention\.linear_o_group_proj", 0, 1),           # output groups
    (r"self_attention\.linear_proj\.weight", 1, 1),           # RowParallelLinear: its input
    (r"self_attention\.core_attention\.attn_sink", 0, 1),     # heads
    (r"mlp\.experts\.linear_fc1\.weight\d+", 0, 2),           # each expert's ffn dim, gate and up halves
    (r"mlp\.experts\.linear_fc2\.weight\d+", 1, 1),
    (r"mlp\.shared_experts\.linear_fc1\.weight", 0, 2),
    (r"mlp\.shared_experts\.linear_fc2\.weight", 1, 1),
)
_RX = [(re.compile(r"(?:^|\.)" + pattern + r"\Z"), dim, blocks) for pattern, dim, blocks in TP_SPLITS]


def tp_split(native_name: str) -> Optional[Tuple[int, int]]:
    """``(dim, blocks)`` of a tensor tensor parallelism splits (the form of ``engine.tp.tp_spec``), None for
    a replicated one. Megatron-Bridge's ``local_experts`` names are read as their contract names."""
    name = canonical_native_name(native_name)
    for rx, dim, blocks in _RX:
        if rx.search(name):
            return dim, blocks
    return None


def _parts(block: int) -> int:
    """Equal parts a block of ``block`` rows is cut into: the largest tensor-parallel size up to
    :data:`MAX_TP` (a power of two) that divides it, so every size it allows cuts on a part boundary."""
    k = MAX_TP
    while k > 1 and block % k:
        k //= 2
    return k


def tp_chunk_boxes(native_name: str, shape: Sequence[int]) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """The chunks ``[(offsets, sizes)]`` to store a tensor of ``shape`` as: one whole chunk for a replicated
    tensor (or one whose split dim does not divide into its blocks); for a split one, every block cut into
    equal parts along the split dim, so any tensor-parallel size up to :data:`MAX_TP` that divides the block
    reads whole chunks only."""
    shape = tuple(int(s) for s in shape)
    whole = [((0,) * len(shape), shape)]
    split = tp_split(native_name)
    if split is None:
        return whole
    dim, blocks = split
    if dim >= len(shape) or shape[dim] % blocks:
        return whole
    n = blocks * _parts(shape[dim] // blocks)
    if n == 1:
        return whole
    step = shape[dim] // n
    out = []
    for i in range(n):
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[dim], sizes[dim] = i * step, step
        out.append((tuple(offsets), tuple(sizes)))
    return out
