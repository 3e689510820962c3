"""Which pipeline stage holds each contract tensor under ``--pp P`` (and ``--vpp V``): the decoder layers a stage
holds, and the stage of a native name.

Why here: the trainer's stages (``engine.pipeline.split_stage``) and the memory estimate of ``dsv4 inspect``
(``core.memory``, which builds no model) must cut the model the same way; this is the one rule both read.

Stage ``s`` of ``P`` holds a contiguous range of the decoder layers, as even as the count allows (the first
``n_layers % P`` stages take one layer more); stage 0 also holds the embedding, the last stage everything after
the decoder layers: the final norm, the hc head, the output layer and the MTP blocks. With ``V`` virtual stages
per rank (megatron-core's interleaved schedule) the layers are cut into ``P x V`` chunks the same way, and chunk
``v`` of stage ``s`` is the ``v x P + s``-th (megatron's order: the model runs through the ranks ``V`` times);
the embedding is on the first chunk of stage 0, the rest on the last chunk of stage ``P - 1``.
"""

from __future__ import annotations

import re

__all__ = ["stage_layers", "chunk_layers", "rank_layers", "stage_of"]

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The global indices of the decoder layers stage ``stage`` of ``pp`` holds: contiguous, as even as possible,
    the first ``n_layers % pp`` stages one more."""
    if n_layers < pp:
        raise ValueError(f"--pp {pp} gives each stage at least one decoder layer, and the model has {n_layers}. "
                         f"Fix: use --pp {n_layers} or fewer.")
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def chunk_layers(n_layers: int, pp: int, stage: int, chunk: int, vp: int = 1) -> range:
    """The decoder layers of model chunk ``chunk`` of stage ``stage`` (``vp`` chunks per stage): the
    ``chunk x pp + stage``-th of ``pp x vp`` contiguous ranges (``vp`` 1: :func:`stage_layers`)."""
    return stage_layers(n_layers, pp * vp, chunk * pp + stage)


def rank_layers(n_layers: int, pp: int, stage: int, vp: int = 1) -> list:
    """Every decoder layer stage ``stage`` holds, over its ``vp`` chunks, in order."""
    return [i for chunk in range(vp) for i in chunk_layers(n_layers, pp, stage, chunk, vp)]


def stage_of(name: str, n_layers: int, pp: int, vp: int = 1) -> int:
    """The stage that holds the native tensor ``name`` (``embedding.*``: 0; ``decoder.layers.N.*``: the stage of
    layer N; everything else, the final norm, hc head, output layer and MTP blocks: the last)."""
    if name.startswith("embedding."):
        return 0
    m = _LAYER.match(name)
    if m is None:
        return pp - 1
    layer, chunks = int(m.group(1)), pp * vp
    base, extra = divmod(n_layers, chunks)
    cut = extra * (base + 1)                 # the layers of the chunks that take one more
    chunk = layer // (base + 1) if layer < cut else extra + (layer - cut) // base
    return chunk % pp
