"""The rollout engine's decode machinery: a slot cache and its step, replayed from CUDA graphs on a GPU.

A decode step of a small model on a GPU is launch-bound (thousands of small kernels per step: the mHC
Sinkhorn iterations, per-layer cache updates, the MoE). :func:`kernels.reference.slots.static_decode_step`
has static shapes and no host sync, so one ``torch.cuda.CUDAGraph`` per slot-count bucket records it once and
replays it for one CPU launch per step.

:class:`SlotDecoder` owns ``M`` slots (:class:`~kernels.reference.slots.SlotCache`) and static input buffers
(``tokens [M]``, ``active [M]``). A step runs on the first ``b`` slots, ``b`` a bucket: powers of two up to
``M`` (and ``M``) with graphs, every size eagerly; the caller packs the live slots at the front
(:meth:`SlotCache.move`). Graphs are captured when the decoder is built, before any slot holds a sequence:
capture's warm-up runs write into the (empty) slots. The graphs share one memory pool; each graph's outputs
(logits, routes) are read before the next replay, so a later capture reusing an earlier one's temporaries
is harmless. Weight updates copy into the same parameter tensors, so the graphs stay valid across them.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from kernels.reference.decode import DecodeCache
from kernels.reference.slots import SlotCache, static_decode_step

__all__ = ["SlotDecoder", "graph_buckets"]


def graph_buckets(slots: int) -> List[int]:
    """Slot counts a graph is captured for: 1, 2, 4, ... below ``slots``, and ``slots``."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


class SlotDecoder:
    """``M`` slots shaped like ``template``'s rows, and the decode step over the first ``b`` of them."""

    def __init__(self, model, template: DecodeCache, slots: int, *, cuda_graphs: bool):
        self.model = model
        self.cache = SlotCache.like(template, slots)
        dev = self.cache.pos.device
        if cuda_graphs and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine is on {dev} (pass cuda_graphs=False)")
        self.cuda_graphs = cuda_graphs
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.buckets = graph_buckets(slots) if cuda_graphs else list(range(1, slots + 1))
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        if cuda_graphs:
            self._capture_all()

    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def bucket(self, live: int) -> int:
        """The smallest bucket holding ``live`` slots."""
        return next(b for b in self.buckets if b >= live)

    def _eager(self, b: int):
        return static_decode_step(self.model, self.cache.view(b), self.tokens[:b], self.active[:b])

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.cache.pos.device)
        for b in reversed(self.buckets):          # the largest first: later ones fit in its freed blocks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):          # warm-up (lazy initialisation, the hash-table check)
                for _ in range(2):
                    self._eager(b)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                logits, routes = self._eager(b)
            self._graphs[b] = (g, logits, routes)
        self.cache.pos.zero_()                     # warm-up ran with every slot inactive: nothing advanced

    def step(self, b: int, tokens: torch.Tensor, active: torch.Tensor):
        """One decode step on slots ``[0, b)`` (``b`` a bucket): ``tokens [b]`` fed, ``active [b]`` advance.
        Returns ``(logits [b, V], routes [b, n_learned, k])``, valid until the next step."""
        if b not in self.buckets:
            raise ValueError(f"SlotDecoder.step: {b} slots is not a bucket ({self.buckets})")
        self.tokens[:b].copy_(tokens)
        self.active[:b].copy_(active)
        if not self.cuda_graphs:
            return self._eager(b)
        g, logits, routes = self._graphs[b]
        g.replay()
        return logits, routes

    def cache_tensors(self) -> List[torch.Tensor]:
        """Every tensor of the slots' caches (for memory accounting)."""
        out: List[torch.Tensor] = [self.cache.pos, self.tokens, self.active]

        def walk(obj):
            for v in vars(obj).values():
                if isinstance(v, torch.Tensor):
                    out.append(v)
                elif dataclasses.is_dataclass(v):
                    walk(v)

        for lc in self.cache.layers:
            walk(lc)
        return out

    def fits(self, slots: int, max_len: int, cuda_graphs: Optional[bool] = None) -> bool:
        return slots <= self.slots and max_len <= self.max_len and cuda_graphs in (None, self.cuda_graphs)
