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

Indexer replay (``indexer_replay=true``) goes through the indexer seam
(:func:`kernels.reference.indexer.indexer_hook`; no hook installed = unchanged behaviour). The picks of one
sequence are ``[S, n_csa, index_topk]`` (format below): the rollout engine records them with
:class:`IndexerPicksRecorder` (prefill, uncached forwards) and as the static decode step's output, and the
trainer replays them with :class:`IndexerPicksReplayer`, which finds each trunk indexer of any model (reference,
miles, megatron) by its module path (``layers.<i>``) and counts how many replayed rows the forward's own top-k
picked alike (``indexer_replay_match``). The THD indexers of the implementations hand the seam segment-local
ids (``engine.thd_attention.replayed_segment_picks``). :class:`IndexerRecorder` / :class:`IndexerReplayer` are
the seam's plain form for the reference model (keyed by module path, picks as the forward gives them).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn


def learned_layers(config) -> List[int]:
    """Trunk layers whose routing is learned (and so recorded / replayed)."""
    return [i for i in range(config.n_layers) if not config.is_hash_layer(i)]


def empty_routing(seq_len: int, config) -> torch.Tensor:
    return torch.full((seq_len, config.n_layers, config.n_activated_experts), -1, dtype=torch.long)


class RoutingRecorder:
    """Hook that records ``layer_id -> idx [B, S, k]`` of one forward over ``[B, S]`` ids."""

    records_only = True        # returns the picks it is given (a grouped prefill may call it after routing)

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
        self._on_device: Optional[torch.Tensor] = None

    def __call__(self, layer_id: int, idx: torch.Tensor) -> torch.Tensor:
        B, S, L, k = self.routed.shape
        if layer_id >= L:
            raise ValueError(f"routing replay: layer {layer_id} not in the recorded routing ({L} layers)")
        if self._on_device is None or self._on_device.device != idx.device:
            # every layer's picks in one copy, not one blocking copy (a stream synchronisation) per layer
            self._on_device = self.routed.to(idx.device, non_blocking=True)
        want = self._on_device[:, :, layer_id].reshape(-1, k).to(idx.dtype)
        if want.shape != idx.shape:
            raise ValueError(f"routing replay for layer {layer_id}: recorded {tuple(want.shape)} picks but the "
                             f"forward has {tuple(idx.shape)} (batch/sequence mismatch)")
        use = (want >= 0).all(dim=-1, keepdim=True)
        out = torch.where(use, want, idx)
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


# ------------------------------------------------ indexer replay (per CSA layer)
# Picks of one sequence are an int32 tensor ``[S, n_csa, index_topk]``: row ``t`` holds, for every trunk CSA
# layer (``csa_layers``, ascending), the compressed entries (block ids within the sequence: entry ``j`` is the
# block ending at position ``4j + 3``, visible to ``t`` when ``j < (t+1) // 4``) the engine's Lightning Indexer picked
# for the query at position ``t``, in the stable top-k's order (ascending ids, ``-1`` padding last); a row is
# all ``-1`` where nothing was recorded (positions never fed, padding) and where nothing is visible yet.
def csa_layers(config) -> List[int]:
    """Trunk layers with a Lightning Indexer (compress ratio 4): the picks' second axis, in this order."""
    return [i for i in range(config.n_layers) if config.compress_ratios[i] == 4]


def empty_indexer_picks(seq_len: int, config) -> torch.Tensor:
    return torch.full((seq_len, len(csa_layers(config)), config.index_topk), -1, dtype=torch.int32)


def indexer_slots(model: nn.Module, config) -> Dict[int, int]:
    """``id(indexer module) -> its CSA slot`` for the trunk's indexers of any model (reference
    ``layers.<i>.attn.indexer``, miles / megatron ``decoder.layers.<i>....indexer``); MTP indexers are not
    replayed (they are not part of the picks)."""
    import re

    slot = {layer: i for i, layer in enumerate(csa_layers(config))}
    out = {}
    for name, mod in model.named_modules():
        parts = name.split(".")
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if parts[-1] == "indexer" and "mtp" not in parts and m and int(m.group(1)) in slot:
            out[id(mod)] = slot[int(m.group(1))]
    return out


def pad_picks(picks: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., k]`` picks -> ``[..., width]`` (``-1`` columns appended; ``k <= width``)."""
    k = picks.shape[-1]
    if k > width:
        raise ValueError(f"indexer picks have {k} columns, more than index_topk {width}")
    return torch.nn.functional.pad(picks, (0, width - k), value=-1) if k < width else picks


class IndexerPicksRecorder:
    """Indexer hook recording one forward's trunk picks; :meth:`as_tensor` -> ``[B, S, n_csa, index_topk]``."""

    def __init__(self, model: nn.Module, config):
        self.config = config
        self._slots = indexer_slots(model, config)
        self.picks: Dict[int, torch.Tensor] = {}

    def __call__(self, module, picks: torch.Tensor) -> torch.Tensor:
        slot = self._slots.get(id(module))
        if slot is not None:
            self.picks[slot] = picks.detach()
        return picks

    def as_tensor(self, batch: int, seq_len: int) -> torch.Tensor:
        out = torch.full((batch, seq_len, len(csa_layers(self.config)), self.config.index_topk), -1,
                         dtype=torch.int32)
        for slot, p in self.picks.items():
            out[:, :, slot] = pad_picks(p, self.config.index_topk).to("cpu", torch.int32)
        return out

    def context(self):
        from kernels.reference.indexer import indexer_hook

        return indexer_hook(self)


class IndexerPicksReplayer:
    """Indexer hook replaying ``picks [B, S, n_csa, K]`` (the engine's, see above) in every trunk CSA layer: a
    row with any recorded pick replaces the forward's own row; an all ``-1`` row keeps the forward's own (its
    own is all ``-1`` too where nothing is visible). Counts ``rows`` replayed and ``same``: rows where the
    forward's own picks were the recorded ones (``match``)."""

    def __init__(self, model: nn.Module, config, picks: torch.Tensor):
        if picks.dim() != 4:
            raise ValueError(f"indexer picks must be [B, S, n_csa, k], got {tuple(picks.shape)}")
        self._slots = indexer_slots(model, config)
        if picks.shape[2] != len(csa_layers(config)):
            raise ValueError(f"indexer replay: {picks.shape[2]} CSA layers recorded, the model has "
                             f"{len(csa_layers(config))}")
        self.picks = picks
        self._on_device: Optional[torch.Tensor] = None
        self.rows = self.same = 0            # device counts once a layer has run: read after the forward
        self.layers: List[int] = []

    def __call__(self, module, own: torch.Tensor) -> torch.Tensor:
        slot = self._slots.get(id(module))
        if slot is None:
            return own
        if self._on_device is None or self._on_device.device != own.device:
            self._on_device = self.picks.to(own.device, non_blocking=True)    # one copy, no stream sync per layer
        want = self._on_device[:, :, slot].to(own.dtype)
        if want.shape[:2] != own.shape[:2]:
            raise ValueError(f"indexer replay: recorded picks of {tuple(want.shape[:2])} positions, the forward "
                             f"has {tuple(own.shape[:2])} (batch/sequence mismatch)")
        k = own.shape[-1]
        if want.shape[-1] > k:     # the forward's rows are min(index_topk, S // 4) wide: the rest must be -1
            if bool((want[..., k:] >= 0).any()):
                raise ValueError(f"indexer replay: recorded picks beyond the forward's {k} columns")
            want = want[..., :k]
        use = (want >= 0).any(-1, keepdim=True)
        self.rows = self.rows + use.sum()
        self.same = self.same + ((want == own).all(-1, keepdim=True) & use).sum()
        self.layers.append(slot)
        return torch.where(use, want, own)

    @classmethod
    def of(cls, model: nn.Module, config, picks: Optional[torch.Tensor]) -> Optional["IndexerPicksReplayer"]:
        return None if picks is None else cls(model, config, picks)

    def result(self, impl: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(same, rows)`` of the forward (0-d tensors on its device: the step's report reads them), which must
        have gone through every trunk CSA layer's seam."""
        if sorted(set(self.layers)) != list(range(self.picks.shape[2])):
            raise NotImplementedError(f"--impl {impl}: its indexer does not call kernels.reference.indexer's "
                                      f"indexer_hook in every CSA layer here, so indexer replay cannot work")
        return self.same, self.rows

    def context(self):
        from kernels.reference.indexer import indexer_hook

        return indexer_hook(self)


def batch_indexer_picks(samples, S: int) -> torch.Tensor:
    """The samples' recorded picks as ``[n, S, n_csa, index_topk]`` (-1 padded) for the trainer's replay; refused
    when the engine recorded none."""
    if any(getattr(s, "indexer_picks", None) is None for s in samples):
        raise RuntimeError("indexer_replay: the rollout engine returned no indexer picks. Fix: use --rollout-engine "
                           "reference (it records them), or drop indexer_replay")
    p0 = samples[0].indexer_picks
    out = torch.full((len(samples), S) + tuple(p0.shape[1:]), -1, dtype=p0.dtype)
    for i, s in enumerate(samples):
        out[i, :s.indexer_picks.shape[0]] = s.indexer_picks
    return out


def indexer_context(hook):
    """Install an indexer hook (``None`` = no-op context)."""
    return contextlib.nullcontext() if hook is None else hook.context()
