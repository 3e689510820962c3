"""Rollout engines: the protocol, published-weight decoding, sampling, and the built-in reference engine.

A rollout engine (the fifth plugin axis, ``dsv4_rollout_engines``; records in
:mod:`rollout.plugin`) generates samples and takes weight updates:

* ``generate(prompts, params, *, n, seed) -> [[Sample] * n for each prompt]``;
* ``begin_update(version)`` / ``load_bucket([(official name, published tensor)])`` / ``finish_update()``;
* ``held_weights() -> {official name: tensor}`` - what it computes with (for the weight checker), or
  ``None`` when it cannot show them (a remote server);
* ``shutdown()``.

:class:`ReferenceEngine` generates with the reference model built from the EXPORTED, official-named (HF)
weights it was sent - never from the trainer's module - so every step exercises the real weight sync path
(export -> optional FP8 / NVFP4 publishing -> decode + load here -> weight checker). It runs on the device,
in the dtype and with the kernel op table it is given (the assembly passes the run's: a GPU target's device,
bf16 there, the ``--kernel-backend``'s ops): prefill calls the table's ops, the decode step calls them where
they take a one-token step's inputs and the reference ops where they refuse them, a choice made once per
engine and recorded in ``decode_ops`` / ``decode_refusals`` (:mod:`rollout.engine_ops`).

:class:`TrainModuleEngine` (``true_on_policy`` with miles / megatron) is the exception: it draws from
the trainer's own module and takes no weight sync.

Generation (``kv_cache=True``, the default) runs the prompts x ``n`` samples through ``max_slots`` cache
slots (default: all at once; :mod:`rollout.slot_decoder`): waiting samples are admitted into free slots by
:func:`kernels.reference.decode.prefill` (each distinct prompt once, right-padded), then
:func:`kernels.reference.slots.static_decode_step` feeds one token per live slot per step (static shapes,
replayed from a CUDA graph per slot bucket on CUDA); a finished sample frees its slot for the next waiting
one (continuous batching; a stop token is seen a step late, so that no step waits for the one before), and live
slots are packed into the smallest bucket; with ``compile`` the step's
device work is TorchInductor code (up to three compiles for all buckets; :mod:`rollout.slot_decoder`). ``kv_cache=False`` is
the former engine, kept as the oracle and the benchmark's baseline: one prompt's ``n`` samples at a time, the
whole prefix re-run for every new token. Both sample with :func:`sample_tokens` from the same per-sample streams,
so they draw the same tokens.

Sampling (on the model's device): temperature, then top-k (``top_k > 0``) and top-p truncation of the
tempered distribution, then inverse-CDF sampling with one uniform per step from the sample's own
``torch.Generator`` (seeded by :func:`sample_seed` from the call's ``seed``, the prompt's index and the
sample's index; the uniforms are drawn on the CPU, so a sample does not depend on the device, on the other
samples in the batch or on when they stop). The log-probability of a sampled token is taken under
``softmax(logits / temperature)`` (the full distribution, not the truncated one), which is what the trainer
recomputes. Routed experts of the learned-routing layers are recorded per token when the token is first
fed (the prompt at prefill, each response token at the decode step that feeds it); with ``record_indexer`` so are
the Lightning Indexer's top-k picks of every trunk CSA layer (``Sample.indexer_picks``, for indexer replay): the
prefill's through the indexer seam, the decode step's as an output of the static step (CUDA-graph safe).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from core import weight_contract as wc
from kernels.reference.sampling import CDF_BLOCK, draw_index, stop_hits, tempered

from .phase_clock import PhaseClock
from .replay import (IndexerPicksRecorder, RoutingRecorder, empty_indexer_picks, empty_routing, indexer_context,
                     learned_layers, routing_context)

log = logging.getLogger("dsv4")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: Tuple[int, ...] = (1,)
    top_k: int = 0                          # 0 = no top-k truncation

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy decoding is not supported by the sampler)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0 (0 = off)")


@dataclass
class Sample:
    prompt_ids: List[int]
    response_ids: List[int]                 # includes the stop token when finish_reason == "stop"
    logprobs: torch.Tensor                  # [len(response_ids)] fp32, rollout-side
    finish_reason: str = "length"           # "stop" | "length"
    routed_experts: Optional[torch.Tensor] = None  # [len(prompt)+len(response)-1, n_layers, k], -1 = none
    extra: Dict = field(default_factory=dict)
    # record_indexer: [len(prompt)+len(response)-1, n_csa_layers, index_topk] int32 (rollout.replay), -1 = none
    indexer_picks: Optional[torch.Tensor] = None


# ------------------------------------------------------- published weights
def published_in_fp32(name: str) -> bool:
    """Whether the official tensor ``name`` is published (and held by an engine) in fp32 whatever the run's
    dtype: the weight contract's fp32-kept tensors and the router bias."""
    return wc.keeps_fp32(name) or name.endswith("gate.bias")


def decode_published(named: Iterable[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None
                     ) -> Dict[str, torch.Tensor]:
    """Published tensors (:func:`converters.publish.publish_bucket`) -> logical official tensors.

    FP8: ``x.weight`` (e4m3) + ``x.scale``; NVFP4: ``x.weight`` (uint8) + ``x.weight_scale`` +
    ``x.weight_scale_2``; anything else passes through. ``dtype`` is the dtype dequantised weights get
    (default fp32)."""
    from converters.fp8_quantizer import dequantize_fp8_blocks
    from converters.nvfp4 import nvfp4_dequantize

    items = dict(named)
    out: Dict[str, torch.Tensor] = {}
    used = set()
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for n, t in items.items():
        if n in used:
            continue
        base = n[: -len(".weight")] if n.endswith(".weight") else None
        if base is not None and n + "_scale" in items and n + "_scale_2" in items and t.dtype == torch.uint8:
            out[n] = nvfp4_dequantize(t, items[n + "_scale"], items[n + "_scale_2"], dtype=dtype or torch.float32)
            used.update((n + "_scale", n + "_scale_2"))
        elif base is not None and base + ".scale" in items and t.dtype == fp8:
            out[n] = dequantize_fp8_blocks(t, items[base + ".scale"], dtype=dtype or torch.float32)
            used.add(base + ".scale")
        else:
            out[n] = t
        used.add(n)
    return out


# ----------------------------------------------------------------- sampling
def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of prompt ``prompt_index`` in a ``generate(..., seed=seed)`` call."""
    return (int(seed) * 1_000_003 + prompt_index * 9973 + sample_index * 7919 + 1) % (2 ** 63)


def sample_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """``[len(seeds), steps]`` float64 uniforms in [0, 1): row ``i`` is the stream of a CPU
    ``torch.Generator`` seeded with ``seeds[i]`` (column ``t`` draws the token of step ``t``)."""
    out = torch.empty(len(seeds), steps, dtype=torch.float64)
    for i, s in enumerate(seeds):
        out[i] = torch.rand(steps, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)
    return out


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, params: SamplingParams, draw=None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]``, uniforms ``u [N]`` -> (token ids [N], their log-probs under softmax(logits/T) [N]),
    on ``logits``' device.

    The kept tokens (top-k, then the smallest prefix of the sorted distribution whose mass reaches top_p;
    the top token always) are laid out in order (by probability when truncating, else by id) and the
    token whose cumulative-probability interval holds ``u * kept mass`` is chosen (float64 sums), from the
    :func:`~kernels.reference.sampling.tempered` logits. ``draw``: a kernel backend's
    ``draw_tokens`` (``rollout.engine_ops.sampler_choice``), which draws by the same rule without writing the
    distribution, for calls at top-p 1 without top-k."""
    if draw is not None and params.top_p == 1.0 and not params.top_k:
        return draw(logits.float(), u.to(logits.device, torch.float64), params.temperature, CDF_BLOCK)
    return sample_from_logprobs(torch.log_softmax(tempered(logits, params.temperature), dim=-1), u, params)


def sample_from_logprobs(logp: torch.Tensor, u: torch.Tensor, params: SamplingParams
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` from the tempered log-probs ``logp [N, V]`` themselves (the ``true_on_policy``
    engine passes the trainer's op's output)."""
    probs = logp.exp()
    order = None
    if params.top_p < 1.0 or params.top_k:
        probs, order = probs.sort(dim=-1, descending=True)
        keep = (probs.cumsum(-1) - probs) < params.top_p
        if params.top_k:
            keep[:, params.top_k:] = False
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    choice = draw_index(probs, u)[:, None]
    tok = (choice if order is None else order.gather(-1, choice)).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


# true_on_policy: the dtypes the lockstep engine is built for per device type (docs/rollout.md#true-on-policy);
# fp32 on a GPU is not tested (the rule true-on-policy refuses it)
ON_POLICY_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}


def _kv_bytes_table(config, elem: int):
    """``positions -> kernels.reference.decode.kv_read_bytes(config, positions, elem)``, each count computed once
    (a decode step adds one for every live row, on the host while the GPU runs the step)."""
    import functools

    from kernels.reference.decode import kv_read_bytes

    return functools.lru_cache(maxsize=None)(lambda positions: kv_read_bytes(config, positions, elem))


class RolloutEngineBase:
    name = "base"

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int, seed: int,
                 first_prompt: int = 0) -> List[List[Sample]]:
        """``first_prompt``: the index of ``prompts[0]`` among the step's prompts (a data-parallel rank
        generates its share; seeds follow the index in the step, so every layout samples the same)."""
        raise NotImplementedError

    def begin_update(self, version: int) -> None:
        raise NotImplementedError

    def load_bucket(self, bucket: List[Tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def finish_update(self) -> None:
        raise NotImplementedError

    def held_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        return None

    def release_memory(self) -> None:
        """Colocated mode (``colocate``): give the device memory back while the trainer computes; the next
        ``begin_update`` takes it again and the update that follows sends every tensor."""
        raise NotImplementedError(f"the {self.name} rollout engine cannot release its memory: train without colocate")

    def resume_memory(self) -> None:
        raise NotImplementedError(f"the {self.name} rollout engine cannot release its memory: train without colocate")

    def shutdown(self) -> None:
        pass


class ReferenceEngine(RolloutEngineBase):
    """Generates with :class:`kernels.reference.model.DeepseekV4Model` from exported weights, on ``device`` in
    ``dtype``; ``kv_cache=False`` re-runs the prefix for every token (the former engine; module docstring).

    ``max_slots``: how many samples decode at once (None: every sample of a call); more wait and take the
    slot of the next one to finish. ``cuda_graphs``: replay the decode step from CUDA graphs (None: on a CUDA
    device; True elsewhere is refused). ``compile``: run the decode step's device work as ``torch.compile`` code
    (None / False: eager; True: Inductor; a string: that ``torch.compile`` backend, e.g. ``"aot_eager"`` in
    tests), each slot bucket compiled when the slots are built (before the graphs are captured); a kernel
    backend's op that ``torch.compile`` cannot trace stays eager inside it
    (:func:`engine.compile.opaque_kernel_ops`; the GPU backends' ops are traced custom ops). ``prefill_batch``: at
    most this many prompts per prefill forward (None: every admitted prompt in one; the reference prefill holds
    ``[rows, length, keys, head_dim]`` gathers).

    ``ops``: the kernel op table to compute with (``core.kernel_ops.OpTable``; None: the reference ops, backend
    ``none``). Prefill (and the uncached engine) calls it as is; the decode step calls ``decode_table``: the
    same ops, except the reference op for each op that refuses a one-token step's inputs
    (:func:`rollout.engine_ops.decode_choices`). ``prefill_ops`` / ``decode_ops``: ``{op: backend}`` for the
    ops a generate call runs; ``decode_refusals``: ``{op: why the run's kernel does not serve decode}``;
    ``sample_ops``: ``{"draw_tokens": backend}`` where the sampler takes the table's kernel (top-p 1 calls), and
    ``"draw_record"`` where a decode step's draw also writes the engine's records of it in that launch."""

    name = "reference"

    def __init__(self, config, *, dtype: torch.dtype = torch.float32, record_routing: bool = True,
                 device="cpu", kv_cache: bool = True, max_slots: Optional[int] = None,
                 cuda_graphs: Optional[bool] = None, prefill_batch: Optional[int] = None, ops=None,
                 true_on_policy: bool = False, compile=None, record_indexer: bool = False):
        from kernels.reference import backend as reference
        from kernels.reference.model import DeepseekV4Model

        from .engine_ops import decode_choices, engine_ops, record_choice, sampler_choice

        self.config, self.dtype, self.record_routing = config, dtype, record_routing
        self.record_indexer = bool(record_indexer)   # indexer replay: Sample.indexer_picks (module docstring)
        self.device, self.kv_cache = torch.device(device), kv_cache
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, the engine is on {self.device} "
                             "(leave cuda_graphs unset or pass False)")
        for name, v in (("max_slots", max_slots), ("prefill_batch", prefill_batch)):
            if v is not None and (isinstance(v, bool) or int(v) < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None (no limit), got {v!r}")
        self.max_slots, self.prefill_batch = max_slots, prefill_batch
        if true_on_policy:
            why = [w for bad, w in (
                (kv_cache, "kv_cache=True (the cached decode step computes other op shapes)"),
                (bool(compile), "compile (the compiled decode step rounds differently)"),
                (self.device.type not in ON_POLICY_DTYPES, f"device {self.device} (not built there)"),
                (self.device.type in ON_POLICY_DTYPES and dtype not in ON_POLICY_DTYPES[self.device.type],
                 f"dtype {dtype} on {self.device.type} (not built there)"),
                (ops is not None and any(b != "none" for b in ops.provider.values()), "kernel ops other than the "
                 "reference ops")) if bad]
            if why:
                raise ValueError("true_on_policy=True is exact only for the uncached engine with the reference ops, "
                                 "in fp32 or bf16 on the CPU, in bf16 on a CUDA device; got " + "; ".join(why))
        self.true_on_policy = bool(true_on_policy)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.ops = ops if ops is not None else reference.ops()
        self.compile = _compile_backend(compile, kv_cache)
        self.prefill_ops = {n: self.ops.provider[n] for n in engine_ops(config)}
        self.decode_table, self.decode_ops, self.decode_refusals = decode_choices(
            self.ops, reference.ops(), config, dtype, self.device, compiled=bool(self.compile), cached=kv_cache)
        for name, why in self.decode_refusals.items():
            log.warning("rollout engine: the decode step runs the reference %s (backend none): the %s kernel "
                        "refuses a one-token step's inputs: %s", name, self.ops.provider[name], why)
        # the sampler's kernel (sample_ops: {"draw_tokens": backend}), else torch's sampler
        self.sample_ops, self._draw, why = sampler_choice(self.ops, self.device, CDF_BLOCK, config.vocab_size)
        if why is not None:
            log.warning("rollout engine: the sampler runs torch's ops: the %s draw_tokens kernel refuses them: %s",
                        self.ops.provider["draw_tokens"], why)
        # a decode step's draw with its records in one launch (sample_ops: {"draw_record": backend}), where the
        # table's draw runs
        recorded, self._record, why = ({}, None, None) if self._draw is None else record_choice(
            self.ops, self.device, CDF_BLOCK, config.vocab_size)
        self.sample_ops.update(recorded)
        if why is not None:
            log.warning("rollout engine: a decode step records its draws with torch's ops: the %s draw_record kernel "
                        "refuses them: %s", self.ops.provider["draw_record"], why)
        self._fullgraph = True        # torch.compile's: no graph break in the decode step
        if self.compile:              # untraceable kernel ops run eagerly inside it (a graph break each)
            from engine.compile import kernel_op_names, opaque_kernel_ops

            self._fullgraph = not set(kernel_op_names(self.decode_table)) & set(self.decode_ops)
            self.decode_table = opaque_kernel_ops(self.decode_table)
        self._decoder = None          # rollout.slot_decoder.SlotDecoder, built by the first cached generate
        self.positions_fed = 0        # token positions fed to the model by generate() (work done)
        self._timing = None           # the last cached generate's phases (generate_timing)
        self.model = DeepseekV4Model(config, device=device)
        if dtype != torch.float32:
            self.model.to(dtype)
            # Hold each tensor in the dtype it is published in: the model also keeps its RMSNorm weights in
            # fp32, but they arrive in `dtype` and an RMSNorm upcasts its weight anyway (same values). The
            # true-on-policy engine keeps the reference training model's own dtypes (its RMSNorm weights in fp32,
            # trained away from bf16 values), sent as they are (rollout.weight_sync.sync_weights, lossless=True).
            for name, t in self.model.state_dict(keep_vars=True).items():
                if t.dtype == torch.float32 and not published_in_fp32(name) and not true_on_policy:
                    t.data = t.data.to(dtype)
        self.model.eval().requires_grad_(False)
        if kv_cache:              # the decode step reads each layer's experts as one stacked tensor
            from kernels.reference.slots import stack_expert_weights

            stack_expert_weights(self.model)
        self.version: Optional[int] = None
        self._received: Optional[set] = None
        self._loaded_once = self._complete_before = self._released = False
        self._shapes: List[Tuple[torch.Tensor, Tuple[int, ...]]] = []
        self._params = self.model.state_dict(keep_vars=True)   # name -> the engine's tensor object (its .data moves)
        self._expected = {n: tuple(t.shape) for n, t in self._params.items()}
        self._shared: dict = {}       # name -> the trainer's address it shares (rollout.shared_weights)
        self._moved = False           # a shared update changed what a tensor points at
        self._stack_copied = False    # the decode MoE's stacks are copies, not the shared experts

    # -- weights ---------------------------------------------------------
    # An update is loaded IN PLACE, bucket by bucket, into the tensors the engine computes with: the engine
    # never holds a second copy of the weights (which matters when it shares the trainer's GPU). While an
    # update is under way, and after one that failed, the engine refuses to generate until an update
    # completes; an update that follows a release (``release_memory``) must send every tensor.
    def begin_update(self, version: int) -> None:
        self._received = set()
        self._complete_before, self._loaded_once = self._loaded_once, False
        self._next_version = version
        if self._released:
            self.resume_memory()

    def load_bucket(self, bucket) -> None:
        if self._received is None:
            raise RuntimeError("load_bucket before begin_update")
        sd = self.model.state_dict()
        with torch.no_grad():
            for n, t in decode_published(bucket, self.dtype).items():
                if n in self._received:
                    raise ValueError(f"weight update: {n!r} arrived twice")
                if n not in sd:
                    raise ValueError(f"weight update does not fit the engine: unexpected {n!r}")
                dst = sd[n]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"weight update: {n!r} has shape {tuple(t.shape)}, engine {tuple(dst.shape)}")
                dst.copy_(t.to(dst.device, dst.dtype))
                self._received.add(n)

    def finish_update(self) -> None:
        got, self._received = self._received, None
        if got is None:
            raise RuntimeError("finish_update before begin_update")
        missing = sorted(set(self.model.state_dict()) - got)
        if missing and not self._complete_before:
            raise ValueError(f"weight update does not fit the engine: missing {missing[:5]} ({len(missing)})")
        self._loaded_once = True
        self.version = self._next_version

    # Shared weights (rollout.shared_weights): the engine's tensors ARE the trainer's memory where they can be
    # (same dtype, device and shape); the rest is copied in at every update. The stacked experts of the decode
    # MoE become views of the trainer's expert banks, and the decode slots are built again once after the
    # tensors moved (their CUDA graphs hold the addresses they read).
    def begin_share(self, version: int) -> None:
        self._received = set()
        self._complete_before, self._loaded_once = self._loaded_once, False
        self._next_version = version
        if self._released:                # nothing to allocate: each tensor is shared or allocated as it comes
            self._shapes, self._released = [], False
            self._moved = True

    def share_tensor(self, name: str, src: torch.Tensor, live: bool = True) -> int:
        """Make the engine's ``name`` the memory of ``src`` (``live``: a view of the trainer's weights) where it can
        compute with it as it is, else copy ``src`` in; returns the bytes copied (0: shared)."""
        if self._received is None:
            raise RuntimeError("share_tensor before begin_share")
        if name in self._received:
            raise ValueError(f"weight update: {name!r} arrived twice")
        dst = self._params.get(name)
        if dst is None:
            raise ValueError(f"weight update does not fit the engine: unexpected {name!r}")
        if tuple(src.shape) != self._expected[name]:
            raise ValueError(f"weight update: {name!r} has shape {tuple(src.shape)}, engine {self._expected[name]}")
        self._received.add(name)
        if live and src.dtype == dst.dtype and src.device == dst.device:
            if not (dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride()):
                dst.data, self._moved = src, True
            self._shared[name] = src.data_ptr()
            return 0
        if name in self._shared or dst.numel() != src.numel():   # never write into the trainer's memory
            dst.data = torch.empty(self._expected[name], dtype=dst.dtype, device=dst.device)
            self._shared.pop(name, None)
            self._moved = True
        dst.copy_(src)
        return dst.numel() * dst.element_size()

    def finish_share(self) -> int:
        """End a shared update; returns the bytes the decode MoE's expert stacks copied (0: views)."""
        self.finish_update()
        copied = 0
        if self._moved:
            self._decoder = None          # its slots and graphs read the former addresses
            if self.kv_cache:
                from kernels.reference.slots import stack_expert_weights

                copied = stack_expert_weights(self.model)    # a copied stack re-points its experts into it
                self._stack_copied = copied > 0
                self._shared = {n: ptr for n, ptr in self._shared.items() if self._params[n].data_ptr() == ptr}
            self._moved = False
        return copied

    def shared_addresses(self) -> Dict[str, int]:
        """``{name: address}`` of the shared tensors as they are now (a moved one shows another address)."""
        return {n: self._params[n].data_ptr() for n in self._shared}

    def copied_names(self) -> List[str]:
        """The engine's tensors that hold copies (of weights it could not share), by official name."""
        return [n for n in self._expected if n not in self._shared]

    @property
    def holds_weights(self) -> bool:
        """Whether the last update completed and the weights were not released since."""
        return self._loaded_once and not self._released

    @property
    def reusable_share(self) -> bool:
        """Whether the next sync may keep this share (its decode MoE reads the shared experts in place)."""
        return self.holds_weights and not self._stack_copied

    def copy_into(self, name: str, src: torch.Tensor) -> int:
        """Copy ``src`` into the engine's own tensor ``name`` (not a shared one); returns the bytes copied."""
        if name in self._shared:
            raise ValueError(f"{name!r} is the trainer's memory: it is not copied into")
        dst = self._params[name]
        dst.copy_(src)
        return dst.numel() * dst.element_size()

    def bump(self, version: int) -> None:
        """The trainer's step already updated the shared weights in place: only the version moves."""
        if not self.holds_weights:
            raise RuntimeError("bump: the engine holds no complete weights (share them first)")
        self.version = version

    def release_memory(self) -> None:
        """Colocated mode: free the weights, the decode slots' KV cache and their CUDA graphs while the trainer
        uses the device. The storage is given back; the next update (``begin_update``) allocates the weights
        again and must send every tensor, since nothing is kept; the next generate builds the slots again (and
        captures their graphs: they hold the addresses of the tensors they read)."""
        if self._released:
            return
        self._decoder = None
        for layer in self.model.layers:               # the decode MoE's stacked experts (kernels.reference.slots)
            layer.ffn.__dict__.pop("_expert_stacks", None)
        for t in self.model.state_dict(keep_vars=True).values():
            self._shapes.append((t, tuple(t.shape)))
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._released, self._loaded_once = True, False
        self._shared = {}                 # shared tensors are the trainer's: dropping them frees nothing
        if self.device.type == "cuda":
            torch.cuda.empty_cache()     # give the blocks back to the driver: other processes may share the GPU

    def resume_memory(self) -> None:
        """Allocate the released weights again (uninitialized: an update fills them before any generate)."""
        for t, shape in self._shapes:
            t.data = torch.empty(shape, dtype=t.dtype, device=t.device)
        self._shapes, self._released = [], False
        if self.kv_cache:
            from kernels.reference.slots import stack_expert_weights

            stack_expert_weights(self.model)

    def held_bytes(self) -> int:
        """Device bytes the engine holds now: its weights and its decode slots' KV cache (0 while released)."""
        held = self.model.state_dict()
        seen = {held[n].untyped_storage().data_ptr() for n in self._shared}   # the trainer's memory, not the engine's
        total = 0
        tensors = list(held.values())
        if self._decoder is not None:
            tensors += self._decoder.cache_tensors()
        for t in tensors:                             # expert weights are views of one stack: count storage once
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def held_weights(self):
        return dict(self.model.state_dict())

    def generate_timing(self) -> Optional[Dict[str, float]]:
        """The last cached ``generate``'s time by phase (:class:`~rollout.phase_clock.PhaseClock`, device time
        on a GPU): ``setup_s`` (slots and their CUDA graphs, when a call needs new ones), ``prefill_s`` (the
        prompts and each sample's first draw), ``decode_s`` (the decode steps with their draws), and
        ``decode_steps`` / ``decode_rows`` (the steps, and the samples they fed in all), ``decode_kv_bytes`` (the
        cache bytes those steps read at least, each row's :func:`kernels.reference.decode.kv_read_bytes` at the
        positions its token attends: issue #32's roofline counts them beside the weights); a phase that did not
        occur is absent. None before a cached call (the uncached engine runs full forwards, no decode step)."""
        return None if self._timing is None else dict(self._timing)

    # -- generation ------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, *, n: int, seed: int,
                 first_prompt: int = 0) -> List[List[Sample]]:
        if not self._loaded_once:
            raise RuntimeError("the reference engine has no weights yet (sync weights first)")
        prompts = [[int(t) for t in p] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts or n < 1:
            return [[] for _ in prompts]
        seeds = [[sample_seed(seed, first_prompt + pi, j) for j in range(n)] for pi in range(len(prompts))]
        if self.kv_cache:
            with self._computing("decode"):               # prefills nest the prefill table inside
                return self._generate_cached(prompts, params, n, seeds)
        with self._computing("prefill"):                  # the uncached engine runs only full forwards
            return [self._generate_lockstep(p, params, s) for p, s in zip(prompts, seeds)]

    def reserve(self, slots: int, positions: int) -> None:
        """Build the decode slots (capture their CUDA graphs, compile their step) for ``slots`` samples of up to
        ``positions`` fed tokens now, so that a timed ``generate`` within those sizes does not."""
        self._decoder_for(slots, positions)

    def _decoder_for(self, slots: int, need_len: int):
        """The engine's :class:`~rollout.slot_decoder.SlotDecoder`, rebuilt (and its graphs recaptured) only when
        a call needs more slots or positions than it has; capacity is rounded up to 64 positions."""
        from kernels.reference.decode import prefill
        from rollout.slot_decoder import SlotDecoder

        dec = self._decoder
        if dec is None or not dec.fits(slots, need_len):
            if dec is not None:
                slots, need_len = max(slots, dec.slots), max(need_len, dec.max_len)
                self._decoder = dec = None
            with self._computing("decode"):   # the decode step's ops: the graphs record them; the template
                cache, _ = prefill(self.model, [[0]], max_len=-(-need_len // 64) * 64)   # is shapes only
                dec = self._decoder = SlotDecoder(self.model, cache, slots, cuda_graphs=self.cuda_graphs,
                                                  compile=self.compile, fullgraph=self._fullgraph,
                                                  indexer_picks=self.record_indexer)
        return dec

    def _computing(self, phase: str):
        """The model computes with this phase's op table (``"prefill"``: ``ops``, ``"decode"``: ``decode_table``)
        within the ``with`` block."""
        from kernels.reference.model import ops_in_use

        return ops_in_use(self.model, self.ops if phase == "prefill" else self.decode_table)

    def _prefill(self, prompts: List[List[int]], max_len: int, routed=None, ids=(), P=(), picks=None):
        """Prefill each distinct prompt once; the cache rows and last logits of ``prompts`` in order. With
        ``routed`` (``picks``), samples ``ids`` (prompt lengths ``P[id]``) get their prompts' routed experts
        (indexer picks)."""
        from kernels.reference.decode import prefill, to_device
        from kernels.reference.moe import inference_experts
        from kernels.reference.slots import prefill_experts

        distinct: Dict[Tuple[int, ...], int] = {}
        for p in prompts:
            distinct.setdefault(tuple(p), len(distinct))
        firsts = [list(p) for p in distinct]
        src = torch.tensor([distinct[tuple(p)] for p in prompts])
        S = max(len(p) for p in firsts)
        rec = RoutingRecorder(len(firsts), S) if routed is not None else None
        irec = IndexerPicksRecorder(self.model, self.config) if picks is not None else None
        with routing_context(rec), indexer_context(irec), self._computing("prefill"), \
                inference_experts(prefill_experts):                  # the grouped experts where the step has them
            cache, logits = prefill(self.model, firsts, max_len=max_len)
        self.positions_fed += len(firsts) * S
        if irec is not None:
            got = irec.as_tensor(len(firsts), S)[src]                         # [rows, S, n_csa, topk]
            got[torch.arange(S)[None, :] >= torch.tensor([P[i] for i in ids])[:, None]] = -1   # padding
            picks[list(ids), :S] = got
        if rec is not None:
            got = rec.as_tensor(self.config)[src]                              # [rows, S, layers, k]
            got[torch.arange(S)[None, :] >= torch.tensor([P[i] for i in ids])[:, None]] = -1   # padding
            routed[list(ids), :S] = got
        return cache.select(src), logits[to_device(src, logits.device)]

    def _generate_cached(self, prompts: List[List[int]], params: SamplingParams, n: int,
                         seeds: List[List[int]]) -> List[List[Sample]]:
        """Every prompt's ``n`` samples through the slots (continuous batching, module docstring)."""
        from kernels.reference.decode import to_device

        c, dev, T = self.config, self.model.embed.weight.device, params.max_new_tokens
        items = [(pi, j) for pi in range(len(prompts)) for j in range(n)]       # sample id -> (prompt, j)
        P = [len(prompts[pi]) for pi, _ in items]
        M = min(self.max_slots or len(items), len(items))
        u = sample_uniforms([seeds[pi][j] for pi, j in items], T).to(dev)
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=dev)
        tokens = torch.zeros(len(items), T, dtype=torch.long, device=dev)
        logps = torch.zeros(len(items), T, dtype=torch.float32, device=dev)
        lengths = [T] * len(items)
        routed = None
        if self.record_routing:
            routed = empty_routing(max(P) + T, c).unsqueeze(0).repeat(len(items), 1, 1, 1)
        picks = empty_indexer_picks(max(P) + T, c).unsqueeze(0).repeat(len(items), 1, 1, 1) \
            if self.record_indexer else None
        fed_ids, fed_pos, fed_routes = [], [], []     # per decode step: samples, positions, [rows, layers, k]
        fed_picks = []                                # per decode step: [rows, n_csa, index_topk]

        def stopped(tok):                             # a host sync (an admission's first draws)
            return stop_hits(tok, stops).tolist() if params.stop_token_ids else [False] * len(tok)

        def stop_flags(tok, flags=None):
            """A decode step's stop flags (``flags``, or computed here) on their way to the host, read one step
            later (:func:`settle`), so that the engine launches the next step without waiting for this one; None
            without stop tokens."""
            if not params.stop_token_ids:
                return None
            flags = stop_hits(tok, stops) if flags is None else flags
            if not flags.is_cuda:
                return flags, None
            host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return host, done

        def settle(step) -> None:
            """A step's stops, learnt a step late: a sample that drew a stop token ends there (its first stop);
            its slot, if it still holds it, is freed. It was fed that token in the step since (its cache row
            and the token drawn after it are past its end and dropped)."""
            nonlocal view
            sids, counts, (flags, done) = step
            if done is not None:
                done.synchronize()
            for sid, d, stop in zip(sids, counts, flags.tolist()):
                if stop and lengths[sid] == T:
                    lengths[sid] = d + 1
                    if sid in sample_of:
                        sample_of[sample_of.index(sid)], view = -1, None

        waiting = list(range(len(items)))[::-1]       # popped from the end: in sample order
        sample_of = [-1] * M                          # slot -> sample id (-1: free)
        drawn = [0] * M                               # slot -> index of its sample's last drawn token
        last = torch.zeros(M, dtype=torch.long, device=dev)   # slot -> the token it feeds next
        dec, view = None, None                        # view: device index tensors of the live slots
        late = None                                   # the last step's (samples, drawn counts, stop flags)
        clock, decode_steps, decode_rows, kv_bytes = PhaseClock(dev), 0, 0, 0
        kv_at = None                                  # positions attended -> cache bytes a row's step reads
        while True:
            free = [s for s in range(M) if sample_of[s] < 0]
            if waiting and free:                      # admit the next samples: prefill them into free slots
                take = [waiting.pop() for _ in range(min(len(free), len(waiting)))]
                slots = free[: len(take)]
                clock.enter("setup")                  # the slots (and their graphs) when a call needs new ones
                dec = self._decoder_for(M, max(P) + T - 1)      # a drawn token past T - 2 is never fed
                if last.data_ptr() != dec.tokens.data_ptr():     # the slots' next tokens where the step reads
                    last = dec.tokens[:M].copy_(last)            # them: no copy a step (SlotDecoder.step)
                clock.enter("prefill")                # the prompts and each sample's first draw
                step = self.prefill_batch or len(take)
                logits = []
                for i in range(0, len(take), step):
                    part = take[i: i + step]
                    cache, lg = self._prefill([prompts[items[s][0]] for s in part], dec.max_len, routed, part, P,
                                              picks)
                    dec.cache.load(slots[i: i + step], cache, range(len(part)))
                    logits.append(lg)
                logits = torch.cat(logits)
                ids = to_device(take, dev)
                tok, lp = sample_tokens(logits, u[ids, 0], params, self._draw)
                tokens[ids, 0], logps[ids, 0] = tok, lp
                last[to_device(slots, dev)] = tok
                for s, slot, stop in zip(take, slots, stopped(tok)):
                    if stop:
                        lengths[s] = 1
                    elif T > 1:
                        sample_of[slot], drawn[slot] = s, 0
                view = None
                continue
            live = [s for s in range(M) if sample_of[s] >= 0]
            if not live:
                break
            b = dec.bucket(len(live))
            if live[-1] >= b:                         # pack the live slots into the first b
                src = [s for s in live if s >= b]
                dst = [s for s in range(b) if sample_of[s] < 0][: len(src)]
                dec.cache.move(src, dst)
                last[to_device(dst, dev)] = last[to_device(src, dev)]
                for s, d in zip(src, dst):
                    sample_of[d], drawn[d], sample_of[s] = sample_of[s], drawn[s], -1
                live, view = [s for s in range(M) if sample_of[s] >= 0], None
            if view is None:
                mask = torch.zeros(b, dtype=torch.bool)
                mask[live] = True
                live_mask = dec.active[:b].copy_(mask.pin_memory() if dev.type == "cuda" else mask,
                                                 non_blocking=True)    # where the step reads it, not waiting
                view = (to_device(live, dev), live_mask, to_device([sample_of[s] for s in live], dev),
                        to_device([drawn[s] for s in live], dev))
                # the live slots are the first ones (packed above): their logits are a prefix, no gather needed
                prefix = live == list(range(len(live)))
            rows, mask, ids, t = view
            clock.enter("decode")                     # the decode steps, their draws and bookkeeping
            logits, routes, *step_picks = dec.step(b, last[:b], mask)
            decode_steps, decode_rows = decode_steps + 1, decode_rows + len(live)
            if kv_at is None:
                kv_at = _kv_bytes_table(c, dec.cache.layers[0].window.element_size())
            kv_bytes += sum(kv_at(P[sample_of[s]] + drawn[s] + 1) for s in live)   # fed at P + drawn
            self.positions_fed += len(live)
            if routed is not None or picks is not None:   # the fed token (index drawn) sits at position P + drawn
                fed_ids.append([sample_of[s] for s in live])
                fed_pos.append([P[sample_of[s]] + drawn[s] for s in live])
                if routed is not None:
                    fed_routes.append(routes.index_select(0, rows))
                if picks is not None:
                    fed_picks.append(step_picks[0].index_select(0, rows))
            step_logits = logits[:len(live)] if prefix else logits.index_select(0, rows)
            hits = None
            if self._record is not None and params.top_p == 1.0 and not params.top_k:
                tok, lp, hits = self._record(step_logits.float(), u, ids, t, tokens, logps, last, rows, stops,
                                             params.temperature, CDF_BLOCK)    # t moves on in place
            else:
                t = t + 1
                tok, lp = sample_tokens(step_logits, u[ids, t], params, self._draw)
                tokens[ids, t], logps[ids, t] = tok, lp
                last[rows] = tok
            view = (rows, mask, ids, t)
            flags, sids = stop_flags(tok, hits), [sample_of[s] for s in live]
            for s in live:
                drawn[s] += 1
                if drawn[s] == T - 1:                 # its last token: known without the GPU
                    sample_of[s], view = -1, None
            if late is not None:                      # the step before's stops, while the GPU runs this one
                settle(late)
            late = None if flags is None else (sids, [drawn[s] for s in live], flags)
        if late is not None:
            settle(late)
        self._timing = {**{f"{k}_s": v for k, v in clock.seconds().items()}, "decode_steps": decode_steps,
                        "decode_rows": decode_rows, "decode_kv_bytes": kv_bytes}
        if fed_routes:                                # one device -> host copy for the whole call
            learned = torch.tensor(learned_layers(c), dtype=torch.long)   # empty when every layer is hash-routed
            rows = torch.tensor([i for step in fed_ids for i in step])
            pos = torch.tensor([p for step in fed_pos for p in step])
            routed[rows[:, None], pos[:, None], learned[None, :]] = torch.cat(fed_routes).cpu()
        if fed_picks:                                 # likewise
            rows = torch.tensor([i for step in fed_ids for i in step])
            pos = torch.tensor([p for step in fed_pos for p in step])
            picks[rows, pos] = torch.cat(fed_picks).to("cpu", torch.int32)

        tokens, logps = tokens.cpu(), logps.cpu()
        out = []
        for pi, prompt in enumerate(prompts):
            r = slice(pi * n, (pi + 1) * n)
            out.append(samples_of(prompt, tokens[r], logps[r], lengths[r],
                                     None if routed is None else routed[r], params,
                                     None if picks is None else picks[r]))
        return out

    def _generate_lockstep(self, prompt: List[int], params: SamplingParams, seeds: List[int]) -> List[Sample]:
        """The uncached path: one prompt's ``n`` samples in lockstep, every token from a forward without a cache
        over the known prefix. With ``true_on_policy``, each new token comes from a forward over the whole
        ``[n, P + max_new_tokens]`` batch (positions not drawn yet hold the first stop token; attention is
        causal, so they do not reach the drawn positions), run with
        :func:`kernels.reference.moe.row_invariant_experts` and the trainer's own log-prob op
        (:func:`rollout.logprobs.next_token_logprobs`). The trainer scores the same ``[n, P + max_new_tokens]``
        shape the same way, on the same device, with the same weights in the same dtypes (the engine keeps the
        training model's fp32 tensors), so each token's log-prob is the trainer's bit for bit: on a GPU too, since
        every kernel of the forward (cuBLAS GEMMs included) computes a row from that row and the shape alone, and
        equal shapes pick equal kernels."""
        from kernels.reference.moe import row_invariant_experts

        from .logprobs import next_token_logprobs

        on_policy = self.true_on_policy

        def draw(ids, L, u):
            rec = RoutingRecorder(*ids.shape) if self.record_routing else None
            irec = IndexerPicksRecorder(self.model, self.config) if self.record_indexer else None
            with routing_context(rec), indexer_context(irec), \
                    (row_invariant_experts() if on_policy else contextlib.nullcontext()):
                out = self.model(ids)
            if on_policy:
                tok, lp = sample_from_logprobs(next_token_logprobs(out, params.temperature)[:, L - 1], u, params)
            else:
                tok, lp = sample_tokens(out[:, L - 1], u, params, self._draw)
            return tok, lp, None if rec is None else rec.layers, None if irec is None else irec.as_tensor(*ids.shape)

        T = params.max_new_tokens
        samples, fed = lockstep_samples(prompt, params, seeds, self.config, self.model.embed.weight.device, draw,
                                        (lambda L: len(prompt) + T) if on_policy else (lambda L: L),
                                        self.record_routing, self.record_indexer)
        self.positions_fed += fed
        return samples


def samples_of(prompt: List[int], tokens: torch.Tensor, logps: torch.Tensor, lengths: List[int],
               routed: Optional[torch.Tensor], params: SamplingParams,
               picks: Optional[torch.Tensor] = None) -> List[Sample]:
    """Rows of ``tokens``/``logps [n, T]`` (CPU), ``routed [n, >=, layers, k]`` and the indexer ``picks
    [n, >=, n_csa, index_topk]`` as Samples."""
    out = []
    P = len(prompt)
    for i, R in enumerate(lengths):
        resp = tokens[i, :R].tolist()
        finish = "stop" if resp and resp[-1] in params.stop_token_ids else "length"
        out.append(Sample(prompt, resp, logps[i, :R].clone(), finish,
                          routed[i, :P + R - 1].clone() if routed is not None else None,
                          indexer_picks=picks[i, :P + R - 1].clone() if picks is not None else None))
    return out


def lockstep_samples(prompt: List[int], params: SamplingParams, seeds: List[int], config, device, draw, width,
                     record_routing: bool, record_indexer: bool = False) -> Tuple[List[Sample], int]:
    """One prompt's ``n = len(seeds)`` samples drawn in lockstep without a cache: for each new token,
    ``draw(ids [n, W], L, u [n]) -> (tokens [n], their log-probs [n], {learned layer: idx [n, W, k]} or None,
    indexer picks [n, W, n_csa, index_topk] or None)``
    runs one forward over the first ``W = width(L)`` positions of ``ids [n, P + max_new_tokens]`` (the first
    ``L`` known; the rest hold the first stop token) and samples position ``L - 1``. Returns the samples and the
    positions fed."""
    n, T, P = len(seeds), params.max_new_tokens, len(prompt)
    u = sample_uniforms(seeds, T).to(device)
    pad = params.stop_token_ids[0] if params.stop_token_ids else 0
    ids = torch.full((n, P + T), pad, dtype=torch.long, device=device)
    ids[:, :P] = torch.tensor(prompt, dtype=torch.long, device=device)
    routed = empty_routing(P + T, config).unsqueeze(0).repeat(n, 1, 1, 1)
    picks = empty_indexer_picks(P + T, config).unsqueeze(0).repeat(n, 1, 1, 1) if record_indexer else None
    tokens = torch.zeros(n, T, dtype=torch.long)
    lps = torch.zeros(n, T)
    done = torch.zeros(n, dtype=torch.bool)
    lengths = torch.full((n,), T, dtype=torch.long)
    stops = torch.tensor(params.stop_token_ids, dtype=torch.long)
    fed = 0
    for t in range(T):
        L = P + t                             # tokens known; the next one is drawn from position L - 1
        W = width(L)
        tok, lp, layers, got_picks = draw(ids[:, :W], L, u[:, t])
        fed += n * W
        first = 0 if t == 0 else L - 1       # positions fed with their final token for the first time
        if record_routing:
            for layer, idx in layers.items():
                routed[:, first:L, layer] = idx[:, first:L].cpu()
        if picks is not None:
            picks[:, first:L] = got_picks[:, first:L]
        tok = torch.where(done, torch.full_like(tok.cpu(), pad), tok.cpu())
        tokens[:, t] = tok
        lps[:, t] = torch.where(done, torch.zeros_like(lp.cpu()), lp.cpu())
        if t + 1 < T:
            ids[:, L] = tok.to(device)
        newly = (~done) & stop_hits(tok, stops)
        lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
        done |= newly
        if bool(done.all()):
            break
    return samples_of(prompt, tokens, lps, lengths.tolist(), routed if record_routing else None, params,
                      picks), fed


class TrainModuleEngine(RolloutEngineBase):
    """``true_on_policy`` for an implementation's training model (``train_impl`` miles or megatron): generates
    from the trainer's OWN module (:class:`train.model.ImplTrainModel`), one prompt's ``n`` samples in lockstep
    (:func:`lockstep_samples`), each token drawn from :meth:`~train.model.ImplTrainModel.next_token_logprobs`
    over the whole ``[n, P + max_new_tokens]`` batch, the very forward and op with which the trainer then scores
    that batch (:meth:`~train.model.ImplTrainModel.forward_train`; the module runs its experts row-invariant,
    ``model.row_invariant``). Kernels, weights and reduction order are then shared by construction, not
    reproduced by a second model.

    No weight sync: the engine computes with the trainer's parameters themselves, so there is nothing to send
    (sending them into themselves would be work with no effect), and the trainer skips the sync for it
    (``reads_trainer_weights``; :meth:`train.trainer.Trainer.grpo_step`). ``generate`` requires the module in
    eval mode (the trainer's rollout phase) and runs without autograd."""

    name = "trainer-module"
    reads_trainer_weights = True

    def __init__(self, model):
        if not getattr(model, "row_invariant", False):
            raise ValueError("TrainModuleEngine needs the training model's row-invariant experts "
                             "(model.row_invariant = True): the grouped experts make a token's output depend on "
                             "the other tokens' routing")
        if not hasattr(model, "next_token_logprobs"):
            raise ValueError(f"the training model {type(model).__name__} has no next_token_logprobs to draw from")
        self.model = model
        self.version: Optional[int] = None
        self.positions_fed = 0

    def generate(self, prompts, params: SamplingParams, *, n: int, seed: int,
                 first_prompt: int = 0) -> List[List[Sample]]:
        if self.model.training:
            raise RuntimeError("TrainModuleEngine.generate: the training module is in train mode (call .eval())")
        prompts = [[int(t) for t in p] for p in prompts]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if n < 1:
            return [[] for _ in prompts]
        def draw(ids, L, u):
            logp, layers = self.model.next_token_logprobs(ids, params.temperature)
            tok, lp = sample_from_logprobs(logp[:, L - 1], u, params)
            return tok, lp, layers, None                  # no indexer picks (indexer_replay refuses it)

        out = []
        for pi, prompt in enumerate(prompts):
            seeds = [sample_seed(seed, first_prompt + pi, j) for j in range(n)]
            with torch.no_grad():
                samples, fed = lockstep_samples(prompt, params, seeds, self.model.config, self.model.device, draw,
                                                lambda L: len(prompt) + params.max_new_tokens, True)
            self.positions_fed += fed
            out.append(samples)
        return out

    def _no_sync(self, *a, **k):
        raise RuntimeError("TrainModuleEngine computes with the trainer's module: it takes no weight update")

    begin_update = load_bucket = finish_update = _no_sync


def _compile_backend(compile, kv_cache: bool) -> Optional[str]:
    """The engine's ``compile`` option as a ``torch.compile`` backend name (None: eager)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        compile = "inductor"
    if not isinstance(compile, str) or not compile:
        raise ValueError(f"compile must be None, True, False or a torch.compile backend name, got {compile!r}")
    if not kv_cache:
        raise ValueError("compile applies to the cached decode step; the uncached engine (kv_cache=False) runs "
                         "full forwards: drop compile or use kv_cache=True")
    return compile


def make_reference_engine(config, *, settings=None, run_dir=None, publish_format=None, **kwargs) -> ReferenceEngine:
    """Factory named by the ``reference`` RolloutEngine record (``dtype``, ``device``, ``ops``, ``kv_cache``,
    ...). From the trainer's ``settings`` (its ``TrainConfig``) the engine takes ``rollout_max_slots``,
    ``rollout_cuda_graphs``, ``rollout_compile`` and ``indexer_replay`` as ``max_slots``, ``cuda_graphs``, ``compile``
    and ``record_indexer`` (an option
    given here wins); ``run_dir`` and ``publish_format`` are not used: the engine holds the weights it is sent,
    in any published format, in memory."""
    if settings is not None:
        kwargs.setdefault("max_slots", getattr(settings, "rollout_max_slots", None))
        kwargs.setdefault("cuda_graphs", getattr(settings, "rollout_cuda_graphs", None))
        kwargs.setdefault("compile", getattr(settings, "rollout_compile", None))
        kwargs.setdefault("record_indexer", bool(getattr(settings, "indexer_replay", False)))
        if getattr(settings, "true_on_policy", False):
            kwargs.setdefault("true_on_policy", True)
            kwargs.setdefault("kv_cache", False)
    return ReferenceEngine(config, **kwargs)
