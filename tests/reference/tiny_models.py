"""The reference tests' shared model and routing recorder.

:func:`tiny_reference_model`: the ``tiny`` preset in eval mode, weights drawn with seed 0 (std 0.05), and the
attention sinks, the compressors' ``ape`` and the mHC bases set to non-trivial values (seed 1): a fresh
checkpoint has them at zero, where a path that drops one of them would still agree with its oracle.
:class:`RouteRecorder`: the routing seam (``kernels.reference.moe.routing_hook``) that keeps each layer's picks
in call order and changes nothing.
"""

from __future__ import annotations

import torch

from core.config import preset
from kernels.reference.model import DeepseekV4Model, init_weights


def tiny_reference_model(dtype: torch.dtype = torch.float32) -> DeepseekV4Model:
    m = DeepseekV4Model(preset("tiny")).eval()
    init_weights(m, 0, std=0.05)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, t in m.named_parameters():
            if name.endswith(("attn_sink", ".ape", "_base")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return m.to(dtype)


class RouteRecorder:
    """Routing seam: ``layer -> [idx [rows, k], ...]`` in call order; returns the picks unchanged."""

    def __init__(self):
        self.calls = {}

    def __call__(self, layer, idx):
        self.calls.setdefault(layer, []).append(idx.clone())
        return idx
