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

``compile``: the step's device work (:func:`~kernels.reference.slots.static_step_body`) runs as TorchInductor
code (``torch.compile``, default mode) region by region: the embedding, one layer, the head
(:func:`compiled_decode_step`). A compiled layer serves every layer of the same structure, and the slot
count is symbolic from the first compile (one slot is specialized), so the compiles are two per layer kind
and region, whatever the depth and the number of buckets. Inductor fuses the
thousands of small element-wise kernels of a step (mHC and its Sinkhorn iterations, norms, RoPE, the
compressors' pooling, casts) into a few Triton kernels. The host-side checks
(:func:`~kernels.reference.slots.static_step_checks`) run eagerly before it. With CUDA graphs the decoder
records its own graph around the compiled code (not Inductor's ``reduce-overhead`` mode), so a step is still
one replay; a bucket's first warm-up call compiles it (when no earlier compile serves it), before the capture. Without graphs the compiled code
runs every step, the buckets are the powers of two (not every slot count), and each is
compiled when the decoder is built (one call on the empty slots). The GPU backends' kernels are custom ops
(``kernels.gpu_ops``), nodes of the compiled graph; an op the caller's table leaves eager
(:func:`engine.compile.opaque_kernel_ops`) is a graph break, and ``fullgraph`` then has to be False.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from kernels.gpu_common import dependent_launch_count, dependent_launches
from kernels.reference.decode import DecodeCache
from kernels.reference.slots import (SlotCache, StepRegions, decode_embed, decode_head, decode_layer,
                                    static_decode_step, static_step_body, static_step_checks)

__all__ = ["SlotDecoder", "graph_buckets", "compiled_decode_step"]

# dynamo compiles each region (decode_layer: once per layer kind) for one slot and for more, per configuration
# (model config, op table, dtype), and keeps every variant in one cache; past this many it would stop
# compiling (fullgraph: raise), so leave room
_RECOMPILE_LIMIT = 64


def graph_buckets(slots: int) -> List[int]:
    """Slot counts a graph is captured for: 1, 2, 4, ... below ``slots``, and ``slots``."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def _tensors_of(obj) -> Iterator[torch.Tensor]:
    """The tensors of ``obj``: itself, or every tensor field of a cache dataclass (recursively)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for v in vars(obj).values():
            yield from _tensors_of(v)


def _slot_dims_dynamic(obj) -> None:
    """Mark dimension 0 (the slot count) of every tensor in ``obj`` dynamic, so that the first compile serves
    every bucket of two or more slots."""
    for t in _tensors_of(obj):
        if t.dim() and t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _region(fn, compile_kwargs):
    """``fn`` compiled by ``torch.compile(**compile_kwargs)``, its tensor arguments' slot dimension marked
    dynamic before each call."""
    compiled = torch.compile(fn, **compile_kwargs)

    def call(*args):
        for a in args:
            _slot_dims_dynamic(a)
        return compiled(*args)

    return call


def compiled_decode_step(backend: str = "inductor", fullgraph: bool = True):
    """:func:`~kernels.reference.slots.static_decode_step` with its device work compiled by ``torch.compile``
    (``backend``; tests pass ``"aot_eager"`` to trace without generating code). ``fullgraph``: refuse graph
    breaks (False when a kernel backend's ops are left eager inside).

    Compiled by region (:class:`~kernels.reference.slots.StepRegions`): the embedding, one layer
    (:func:`~kernels.reference.slots.decode_layer`), the head. Dynamo guards a compiled layer on its
    structure (attention kind, hash or learned routing, the MoE path), not on which layer it is, so layers
    alike share one compile: a model's distinct layer kinds are compiled, not its depth (V4-Flash: 43
    layers, a handful of kinds). The slot count is dynamic from the first compile (automatic dynamic shapes
    off, so no other size turns symbolic because two kinds differ), and one slot is specialized: two
    compiles per region for any number of buckets.

    Inductor rounds each intermediate to the dtype the eager step rounds it to (``emulate_precision_casts``)
    instead of keeping fused bf16 chains in fp32: the compiled step then differs from the eager one (and the
    training forward) by summation order, not by where it rounds; the casts are register work."""
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    options = {"emulate_precision_casts": True} if backend == "inductor" else None
    kwargs = dict(backend=backend, dynamic=None, fullgraph=fullgraph, options=options)
    regions = StepRegions(embed=_region(decode_embed, kwargs), layer=_region(decode_layer, kwargs),
                          head=_region(decode_head, kwargs))

    def step(model, cache: SlotCache, tokens: torch.Tensor, active: torch.Tensor, indexer_picks: bool = False):
        paths = static_step_checks(model, tokens)
        # never fall back to eager quietly; no size but the slot count turns symbolic
        with dynamo_config.patch(fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False):
            return static_step_body(model, cache, tokens, active, paths, indexer_picks, regions)

    return step


def _is_prefix(t: torch.Tensor, buf: torch.Tensor, b: int) -> bool:
    """Whether ``t`` is ``buf[:b]`` itself (the same memory, shape and dtype)."""
    return (t.data_ptr() == buf.data_ptr() and t.shape == (b,) and t.dtype == buf.dtype and t.device == buf.device
            and t.stride() == buf.stride())


class SlotDecoder:
    """``M`` slots shaped like ``template``'s rows, and the decode step over the first ``b`` of them.

    ``compile``: None (eager), or the ``torch.compile`` backend of the step (``"inductor"``; module
    docstring); ``fullgraph``: passed to ``torch.compile``. ``indexer_picks``: the step also returns the CSA
    layers' indexer top-k (indexer replay's recording; an output of the graph like the routes)."""

    def __init__(self, model, template: DecodeCache, slots: int, *, cuda_graphs: bool,
                 compile: Optional[str] = None, fullgraph: bool = True, indexer_picks: bool = False):
        self.model = model
        self.indexer_picks = bool(indexer_picks)
        self.cache = SlotCache.like(template, slots)
        dev = self.cache.pos.device
        if cuda_graphs and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine is on {dev} (pass cuda_graphs=False)")
        self.cuda_graphs, self.compile = cuda_graphs, compile
        self._step_fn = compiled_decode_step(compile, fullgraph) if compile else static_decode_step
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.buckets = graph_buckets(slots) if cuda_graphs or compile else list(range(1, slots + 1))
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, Tuple[torch.Tensor, ...]]] = {}
        if cuda_graphs:
            self._capture_all()
        elif compile:
            self._compile_all()

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
        """The step on the first ``b`` slots, run now (compiled code included; not a graph replay), its triton
        kernels launched dependent on the ones before where the GPU allows (``kernels.gpu_common.
        dependent_launches``; a capture keeps that)."""
        asked = dependent_launch_count()
        with torch.no_grad(), dependent_launches():
            try:
                return self._step_fn(self.model, self.cache.view(b), self.tokens[:b], self.active[:b],
                                     indexer_picks=self.indexer_picks)
            except RuntimeError as err:
                if isinstance(err, torch.OutOfMemoryError) or dependent_launch_count() == asked:
                    raise
                raise RuntimeError(f"the decode step failed with its triton kernels launched dependent on the ones "
                                   f"before (programmatic dependent launch, kernels/triton/pdl.py): {err}; "
                                   f"DSV4_PDL=0 (the default) launches them as before") from err

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.cache.pos.device)
        for b in reversed(self.buckets):          # the largest first: later ones fit in its freed blocks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):          # warm-up (lazy initialisation, the hash-table check, compiling)
                for _ in range(2):
                    self._eager(b)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                outputs = self._eager(b)
            self._graphs[b] = (g, outputs)
        self.cache.pos.zero_()                     # warm-up ran with every slot inactive: nothing advanced

    def _compile_all(self) -> None:
        """Compile every bucket's step now (one call each, every slot inactive), not in a timed decode."""
        for b in self.buckets:
            self._eager(b)
        self.cache.pos.zero_()

    def step(self, b: int, tokens: torch.Tensor, active: torch.Tensor):
        """One decode step on slots ``[0, b)`` (``b`` a bucket): ``tokens [b]`` fed, ``active [b]`` advance. A
        caller that keeps them in the decoder's own buffers (``tokens[:b]``, ``active[:b]``: the engine writes each
        draw there) spares the step two copies, two launches of their own outside its graph.
        Returns ``(logits [b, V], routes [b, n_learned, k])`` (and the indexer picks ``[b, n_csa, index_topk]``
        with ``indexer_picks``), valid until the next step."""
        if b not in self.buckets:
            raise ValueError(f"SlotDecoder.step: {b} slots is not a bucket ({self.buckets})")
        for buf, given in ((self.tokens, tokens), (self.active, active)):
            if not _is_prefix(given, buf, b):      # the caller keeps them in place (the engine does): no copy
                buf[:b].copy_(given)
        if not self.cuda_graphs:
            return self._eager(b)
        g, outputs = self._graphs[b]
        g.replay()
        return outputs

    def cache_tensors(self) -> List[torch.Tensor]:
        """Every tensor of the slots' caches (for memory accounting)."""
        return [self.cache.pos, self.tokens, self.active] + [t for lc in self.cache.layers for t in _tensors_of(lc)]

    def fits(self, slots: int, max_len: int, cuda_graphs: Optional[bool] = None,
             indexer_picks: Optional[bool] = None) -> bool:
        return (slots <= self.slots and max_len <= self.max_len and cuda_graphs in (None, self.cuda_graphs)
                and indexer_picks in (None, self.indexer_picks))
