"""Which pipeline stage holds each contract tensor under ``--pp P``: the decoder layers a stage holds, and the
stage of a native name.

Why here: the trainer's stages (``engine.pipeline.split_stage``) and the memory estimate of ``dsv4 inspect``
(``core.memory``, which builds no model) must cut the model the same way; this is the one rule both read.

Stage ``s`` of ``P`` holds a contiguous range of the decoder layers, as even as the count allows (the first
``n_layers % P`` stages take one layer more); stage 0 also holds the embedding, the last stage everything after
the decoder layers: the final norm, the hc head, the output layer and the MTP blocks.
"""

from __future__ import annotations

import re

__all__ = ["stage_layers", "stage_of"]

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


def stage_of(name: str, n_layers: int, pp: int) -> int:
    """The stage that holds the native tensor ``name`` (``embedding.*``: 0; ``decoder.layers.N.*``: the stage of
    layer N; everything else, the final norm, hc head, output layer and MTP blocks: the last)."""
    if name.startswith("embedding."):
        return 0
    m = _LAYER.match(name)
    if m is None:
        return pp - 1
    layer = int(m.group(1))
    base, extra = divmod(n_layers, pp)
    cut = extra * (base + 1)                 # the layers of the stages that take one more
    return layer // (base + 1) if layer < cut else extra + (layer - cut) // base
