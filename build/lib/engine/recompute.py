"""Activation recomputation (the training setting ``recompute``): trade compute for activation memory.

* ``full``: every transformer block (``decoder.layers.N``, ``mtp.layers.K``) keeps only its inputs; its
  activations are recomputed in the backward pass (``torch.utils.checkpoint``, non-reentrant).
* ``selective``: only each block's attention (``self_attention``: the compressors, the indexer and the sparse
  attention, the bulk of a DeepSeek-V4 block's activations per token) is recomputed; the MoE keeps its own.
* ``none``: nothing is recomputed.

Routing: the recomputed pass must route every token to the experts the first pass chose (a replayed routing,
or one a later recompute would break a tie differently for), so a checkpointed block records each routing
decision of its first pass and replays it when it is recomputed (through the routing seam,
``kernels.reference.moe.routing_hook``); an outer hook (routing replay, the recorder) sees the first pass only.
Collectives inside a block (tensor, context, expert parallel) run again in the recompute, on every rank alike.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.reference.moe import current_routing_hook, routing_hook

from .compile import block_modules

MODES = ("none", "selective", "full")

__all__ = ["MODES", "apply_recompute"]


def apply_recompute(model: nn.Module, mode: str) -> list:
    """Checkpoint ``model``'s blocks (``full``) or their attention (``selective``) in place; returns the
    modules wrapped (an empty list for ``none``)."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return []
    blocks = block_modules(model)
    targets = blocks if mode == "full" else [_attention(b) for b in blocks]
    for module in targets:
        _checkpoint_forward(module)
    return targets


def _attention(block: nn.Module) -> nn.Module:
    """A trunk block's attention, or an MTP block's (inside its ``mtp_model_layer``)."""
    inner = getattr(block, "mtp_model_layer", block)
    return inner.self_attention


def _checkpoint_forward(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():           # inference: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        outer = current_routing_hook()
        chosen = {}
        passes = []

        def first(layer_id, idx):
            out = idx if outer is None else outer(layer_id, idx)
            chosen[layer_id] = out
            return out

        def again(layer_id, idx):
            return chosen[layer_id]

        def run(*a, **k):
            hook = again if passes else first
            passes.append(hook)
            with routing_hook(hook):
                return forward(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
