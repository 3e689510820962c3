"""Routing replay (R3) and the indexer-replay seam.

Routed experts of one sequence are a LongTensor ``[S, n_layers, k]``: row ``t`` holds, for every trunk
layer, the top-k experts the rollout engine picked for the token at position ``t`` when it processed
it. Entries are ``-1`` where nothing is to be replayed: hash layers (``tid2eid`` routing is a pure
function of the token, never replayed), positions the engine never fed (the last token) and padding.
MTP routers are not part of the tensor at all (they are never replayed).

The seam in the model is :func:`kernels.reference.moe.routing_hook`: it is called only for learned
routing trunk layers. :class:`RoutingRecorder` records what a forward picked; :class:`RoutingReplayer`
substitutes the recorded picks (row by row: a row with any ``-1`` keeps this forward's own choice) and
remembers what it actually used, so a test or metric can compare train-side routing with the rollout's.

The indexer seam (:func:`kernels.reference.indexer.indexer_hook`) is off by default:
:class:`IndexerRecorder` / :class:`IndexerReplayer` record and replay the Lightning Indexer's top-k
picks per CSA layer (keyed by the indexer's module path) when ``indexer_replay`` is switched on.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch
from torch import nn


def learned_layers(config) -> List[int]:
    """Trunk layers whose routing is learned (and so recorded / replayed)."""
    return [i for i in range(config.n_layers) if not config.is_hash_layer(i)]


def empty_routing(seq_len: int, config) -> torch.Tensor:
    return torch.full((seq_len, config.n_layers, config.n_activated_experts), -1, dtype=torch.long)


class RoutingRecorder:
    """Hook that records ``layer_id -> idx [B, S, k]`` of one forward over ``[B, S]`` ids."""

    def __init__(self, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len
        self.layers: Dict[int, torch.Tensor] = {}

    def __call__(self, layer_id: int, idx: torch.Tensor) -> torch.Tensor:
        self.layers[layer_id] = idx.detach().reshape(self.batch, self.seq_len, -1).clone()
        return idx

    def as_tensor(self, config) -> torch.Tensor:
        """``[B, S, n_layers, k]`` with -1 for layers that were not recorded (hash layers)."""
        out = torch.full((self.batch, self.seq_len, config.n_layers, config.n_activated_experts), -1,
                         dtype=torch.long)
        for layer, idx in self.layers.items():
            out[:, :, layer] = idx
        return out


class RoutingReplayer:
    """Hook that replays ``routed [B, S, n_layers, k]`` (see the module docstring)."""

    def __init__(self, routed: torch.Tensor):
        if routed.dim() != 4:
            raise ValueError(f"routed experts must be [B, S, n_layers, k], got {tuple(routed.shape)}")
        self.routed = routed
        self.used: Dict[int, torch.Tensor] = {}
        self.replayed_rows = 0

    def __call__(self, layer_id: int, idx: torch.Tensor) -> torch.Tensor:
        B, S, L, k = self.routed.shape
        if layer_id >= L:
            raise ValueError(f"routing replay: layer {layer_id} not in the recorded routing ({L} layers)")
        want = self.routed[:, :, layer_id].reshape(-1, k).to(idx.device, idx.dtype)
        if want.shape != idx.shape:
            raise ValueError(f"routing replay for layer {layer_id}: recorded {tuple(want.shape)} picks but the "
                             f"forward has {tuple(idx.shape)} (batch/sequence mismatch)")
        use = (want >= 0).all(dim=-1, keepdim=True)
        out = torch.where(use, want, idx)
        self.replayed_rows += int(use.sum())
        self.used[layer_id] = out.detach().reshape(B, S, k).clone()
        return out


def routing_context(hook):
    """Install a routing hook (``None`` = no-op context)."""
    if hook is None:
        return contextlib.nullcontext()
    from kernels.reference.moe import routing_hook

    return routing_hook(hook)


def routing_match(used: Dict[int, torch.Tensor], routed: torch.Tensor, valid: Optional[torch.Tensor] = None
                  ) -> float:
    """Fraction of (position, learned layer) rows where ``used`` equals ``routed`` as a set of experts.

    ``valid [B, S]`` restricts the comparison (default: rows whose routed entry is not -1)."""
    hits = total = 0
    for layer, idx in used.items():
        want = routed[:, :, layer]
        idx = idx.to(want.device)                    # the model's device (a GPU) vs the samples' (CPU)
        ok_rows = (want >= 0).all(-1)
        if valid is not None:
            ok_rows &= valid
        same = (idx.sort(-1).values == want.sort(-1).values).all(-1)
        hits += int((same & ok_rows).sum())
        total += int(ok_rows.sum())
    return 1.0 if total == 0 else hits / total


# ------------------------------------------------------------ indexer seam
def _indexer_names(model: nn.Module) -> Dict[int, str]:
    from kernels.reference.indexer import Indexer

    return {id(m): n for n, m in model.named_modules() if isinstance(m, Indexer)}


class IndexerRecorder:
    """Records the indexer's top-k picks ``module path -> [B, S, k]`` of one forward."""

    def __init__(self, model: nn.Module):
        self._names = _indexer_names(model)
        self.picks: Dict[str, torch.Tensor] = {}

    def __call__(self, module, picks: torch.Tensor) -> torch.Tensor:
        self.picks[self._names.get(id(module), str(id(module)))] = picks.detach().clone()
        return picks

    def context(self):
        from kernels.reference.indexer import indexer_hook

        return indexer_hook(self)


class IndexerReplayer:
    """Replays recorded picks (same shapes required); positions whose row has a -1 keep their own picks
    only if the recorded row is entirely -1 (a -1 inside a row is a legitimate "no entry" pick)."""

    def __init__(self, model: nn.Module, picks: Dict[str, torch.Tensor]):
        self._names = _indexer_names(model)
        self.picks = picks
        self.replayed: List[str] = []

    def __call__(self, module, picks: torch.Tensor) -> torch.Tensor:
        name = self._names.get(id(module))
        want = self.picks.get(name) if name is not None else None
        if want is None:
            return picks
        if want.shape != picks.shape:
            raise ValueError(f"indexer replay {name}: recorded {tuple(want.shape)} != {tuple(picks.shape)}")
        self.replayed.append(name)
        keep = (want == -1).all(-1, keepdim=True)
        return torch.where(keep, picks, want.to(picks))

    def context(self):
        from kernels.reference.indexer import indexer_hook

        return indexer_hook(self)
