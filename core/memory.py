"""Per-GPU memory estimate of a training layout (``dsv4 inspect``; formulas in docs/training.md).

What one GPU holds when the model trains under a layout (tensor parallel ``tp``, context parallel ``cp``,
expert parallel ``ep``, pipeline parallel ``pp``, ``world`` GPUs in all) with Megatron's mixed precision and
DistributedOptimizer. With ``pp`` > 1 the estimate is of one stage (``stage``; by default the stage whose total
is largest), which holds the tensors ``core.pp_layout`` gives it:

* **weights**: every tensor of the weight contract (``core.weight_contract.native_names``) that this
  rank holds: the tensor-parallel ones (:data:`TP_SPLIT`, the layout both implementations and upstream
  Megatron use) cut by ``tp``, the routed experts ``E / ep`` per rank; in the run's ``dtype``, except
  the fp32-kept tensors (mHC, sinks, compressor ``ape`` and norms, router bias) and ``tid2eid`` (int64);
* **gradients**: Megatron's main-gradient buffer, fp32 for every trainable weight this rank holds (with
  bf16 weights Megatron accumulates and reduces gradients in fp32);
* **optimizer** (DistributedOptimizer): per trainable weight an fp32 master copy (none for weights that
  are fp32 already) and Adam's two moments (fp32, or bf16 with ``moments="bf16"``: the trainer's
  ``adam_moments_dtype``), sharded over the data-parallel ranks that hold a
  replica of it: ``world / (tp * pp)`` for dense weights (the data- and context-parallel group),
  ``world / (tp * ep * pp)`` for routed experts (the expert data-parallel group);
* **activations** (a lower bound): with full activation recomputation, what stays alive through the
  backward pass: every block's input (``hc_mult`` residual streams of ``dim``, in the run's dtype), and
  the logits of the main head and of each MTP head, fp32 over the full vocabulary (the implementations
  gather it), with their fp32 log-softmax, for ``seq * micro_batch / cp`` tokens per rank. Under 1F1B
  (megatron-core's non-interleaved schedule) stage ``s`` runs ``pp - s - 1`` warm-up forwards before its
  first backward, so it keeps the block inputs of ``pp - s`` micro-batches (a step of at least that many);
  the last stage, which holds the heads, keeps one. The block being recomputed, attention and MoE
  intermediates, the streams exchanged between stages, communication buffers and the allocator's slack
  come on top.

Nothing here builds a model: counts come from the contract's shapes.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from core import weight_contract as wc
from core.errors import UserInputError
from core.pp_layout import stage_layers, stage_of

__all__ = ["TP_SPLIT", "DTYPE_BYTES", "MemoryEstimate", "estimate_memory", "check_state_fits", "check_run_fits_gpu",
           "rank_tensors", "default_world",
           "in_flight_micro_batches"]

DTYPE_BYTES = {"bf16": 2, "fp32": 4}

#: Native tensors split by tensor parallelism: ``(name pattern, dim, chunks)``; a ``chunks = 2`` tensor is
#: cat(gate, up) and each half is split. Everything else is replicated on every TP rank.
TP_SPLIT: Tuple[Tuple["re.Pattern", int, int], ...] = tuple((re.compile(p), d, c) for p, d, c in (
    (r"(.*\.)?embedding\.word_embeddings\.weight", 0, 1),      # vocabulary
    (r"(.*\.)?output_layer\.weight", 0, 1),                    # vocabulary
    (r".*self_attention\.linear_q_up_proj\.weight", 0, 1),     # heads
    (r".*self_attention\.linear_o_group_proj", 0, 1),          # output groups
    (r".*self_attention\.linear_proj\.weight", 1, 1),          # output groups (row parallel)
    (r".*self_attention\.core_attention\.attn_sink", 0, 1),    # heads
    (r".*mlp\.experts\.linear_fc1\.weight\d+", 0, 2),          # each expert's ffn
    (r".*mlp\.experts\.linear_fc2\.weight\d+", 1, 1),
    (r".*mlp\.shared_experts\.linear_fc1\.weight", 0, 2),
    (r".*mlp\.shared_experts\.linear_fc2\.weight", 1, 1),
))
_RX_EXPERT = re.compile(r".*\.mlp\.experts\.linear_fc[12]\.weight(\d+)\Z")


_NUMBERS = re.compile(r"(?<=\.)\d+(?=\.)|(?<=weight)\d+\Z")    # layers.N. / mtp.N. / ...weightN (expert)


def _tp_split(name: str) -> Optional[Tuple[int, int]]:
    return _tp_split_of_form(_NUMBERS.sub("0", name))


@functools.lru_cache(maxsize=None)
def _tp_split_of_form(name: str) -> Optional[Tuple[int, int]]:
    """The split of every name that differs from ``name`` only in its numbers (layer, expert: the patterns
    match any number there), so V4-Pro's 172k native names are matched in a few hundred forms."""
    for rx, dim, chunks in TP_SPLIT:
        if rx.fullmatch(name):
            return dim, chunks
    return None


def default_world(tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1) -> int:
    """The fewest GPUs the layout runs on: dense weights need ``tp * cp * pp`` ranks per replica, routed
    experts ``tp * ep * pp`` (expert tensor parallel = ``tp``)."""
    return tp * pp * (cp * ep // math.gcd(cp, ep))


def rank_tensors(config, *, tp: int = 1, ep: int = 1, pp: int = 1,
                 stage: Optional[int] = None) -> Dict[str, Tuple[int, str, bool, bool]]:
    """``native name -> (elements on one rank, kind, trainable, routed expert)`` of the tensors one rank of
    the layout holds (rank 0's experts; every rank holds as many; with ``stage``, those of pipeline stage
    ``stage`` of ``pp`` only).
    ``kind``: ``"fp32"`` (kept in fp32), ``"int64"`` (``tid2eid``) or ``"run"`` (the run's dtype)."""
    E = config.n_routed_experts
    if E % ep:
        raise UserInputError(f"expert-parallel size {ep} must divide the {E} routed experts")
    local_experts = E // ep
    out = {}
    for name, (shape, dt) in wc.native_names(config).items():
        if stage is not None and stage_of(name, config.n_layers, pp) != stage:
            continue
        m = _RX_EXPERT.fullmatch(name)
        if m and int(m.group(1)) >= local_experts:
            continue
        n = math.prod(shape)
        split = _tp_split(name)
        if split is not None and tp > 1:
            dim, chunks = split
            if shape[dim] % (chunks * tp):
                raise UserInputError(f"tensor-parallel size {tp} does not divide {name} (dim {dim} of "
                                     f"{tuple(shape)}{' in 2 halves' if chunks == 2 else ''})")
            n //= tp
        kind = "int64" if not dt.is_floating_point else ("fp32" if wc.keeps_fp32(name) else "run")
        out[name] = (n, kind, wc.is_trainable(name), m is not None)
    return out


@dataclass(frozen=True)
class MemoryEstimate:
    """One GPU's share of a layout (bytes; see the module docstring)."""

    tp: int
    cp: int
    ep: int
    pp: int
    world: int
    dp: int            # data-parallel replicas of the dense weights (world / (tp * cp * pp))
    dense_shards: int  # ranks the dense weights' optimizer state is sharded over (world / (tp * pp))
    expert_shards: int  # ranks the routed experts' optimizer state is sharded over (world / (tp * ep * pp))
    dtype: str
    seq: int
    micro_batch: int
    tokens_per_rank: int
    parameters: int            # elements held (weights, frozen tables and buffers)
    trainable_dense: int       # trainable elements held, outside the routed experts
    trainable_expert: int      # trainable routed-expert elements held
    weights: int
    gradients: int
    optimizer: int
    activations: int           # lower bound (full recomputation)
    stage: int = 0             # the pipeline stage estimated (0 of 1 without --pp)
    moments: str = "fp32"      # Adam's moments dtype (the trainer's adam_moments_dtype)
    layers: int = 0            # decoder layers that stage holds

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def in_flight_micro_batches(pp: int, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``pp`` keeps at once under megatron-core's
    non-interleaved 1F1B (``pp - stage - 1`` warm-up forwards, then one forward before each backward)."""
    return pp - stage


def _check_layout(config, tp: int, cp: int, ep: int, pp: int, world: Optional[int], dtype: str, seq: int,
                  micro_batch: int, stage: Optional[int]) -> int:
    """The layout's world size, after refusing a layout the estimate cannot describe (one line, the reason)."""
    if dtype not in DTYPE_BYTES:
        raise UserInputError(f"unknown dtype {dtype!r}; valid choices: {', '.join(DTYPE_BYTES)}")
    for what, v in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp), ("seq", seq), ("micro_batch", micro_batch)):
        if not isinstance(v, int) or v < 1:
            raise UserInputError(f"{what} must be a positive integer, got {v!r}")
    try:
        stage_layers(config.n_layers, pp, 0)
    except ValueError as exc:
        raise UserInputError(str(exc)) from None
    if stage is not None and not 0 <= stage < pp:
        raise UserInputError(f"stage {stage} is not one of the {pp} pipeline stages (0 to {pp - 1})")
    world = default_world(tp, cp, ep, pp) if world is None else int(world)
    if world < 1 or world % (tp * cp * pp) or world % (tp * ep * pp):
        raise UserInputError(f"{world} GPUs do not fit the layout: the world size must be a multiple of "
                             f"tp*cp*pp = {tp * cp * pp} (dense replicas) and of tp*ep*pp = {tp * ep * pp} "
                             f"(expert replicas); e.g. {default_world(tp, cp, ep, pp)}")
    if seq % cp:
        raise UserInputError(f"sequence length {seq} does not split over {cp} context-parallel ranks")
    return world


def estimate_memory(config, *, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, world: Optional[int] = None,
                    dtype: str = "bf16", seq: int = 4096, micro_batch: int = 1,
                    stage: Optional[int] = None, moments: str = "fp32") -> MemoryEstimate:
    """The per-GPU memory of training ``config`` under the layout (see the module docstring): of pipeline stage
    ``stage``, or of the stage whose total is largest (the first of equals)."""
    world = _check_layout(config, tp, cp, ep, pp, world, dtype, seq, micro_batch, stage)
    if moments not in ("fp32", "bf16"):
        raise UserInputError(f"Adam moments dtype {moments!r}: fp32 or bf16")
    layout = dict(tp=tp, cp=cp, ep=ep, pp=pp, world=world, dtype=dtype, seq=seq, micro_batch=micro_batch,
                  moments=moments)
    every = rank_tensors(config, tp=tp, ep=ep)         # the contract's names once (V4-Pro: 172k of them)
    owner = {n: stage_of(n, config.n_layers, pp) for n in every} if pp > 1 else dict.fromkeys(every, 0)
    estimates = [_stage_estimate(config, {n: t for n, t in every.items() if owner[n] == s}, stage=s, **layout)
                 for s in (range(pp) if stage is None else (stage,))]
    return max(estimates, key=lambda e: (e.total, -e.stage))


def _stage_estimate(config, tensors: Dict[str, Tuple[int, str, bool, bool]], *, tp: int, cp: int, ep: int, pp: int,
                    world: int, dtype: str, seq: int, micro_batch: int, stage: int, moments: str) -> MemoryEstimate:
    """One stage's estimate from the tensors it holds (:func:`rank_tensors`)."""
    a = DTYPE_BYTES[dtype]
    size = {"run": a, "fp32": 4, "int64": 8}
    weights = sum(n * size[kind] for n, kind, _t, _e in tensors.values())
    dense = sum(n for n, _k, t, e in tensors.values() if t and not e)
    expert = sum(n for n, _k, t, e in tensors.values() if t and e)
    gradients = 4 * (dense + expert)
    dense_shards, expert_shards = world // (tp * pp), world // (tp * ep * pp)
    master = 4 if a != 4 else 0  # weights held in fp32 are their own master copy

    def optimizer_share(experts: bool, shards: int) -> int:
        held = sum(n * (2 * DTYPE_BYTES[moments] + (master if kind == "run" else 0)) for n, kind, t, e in tensors.values() if t and e == experts)
        return math.ceil(held / shards)

    optimizer = optimizer_share(False, dense_shards) + optimizer_share(True, expert_shards)
    tokens = seq * micro_batch // cp
    M, last = config.n_mtp_layers, stage == pp - 1
    layers = len(stage_layers(config.n_layers, pp, stage))
    blocks = (layers + (M if last else 0)) * config.hc_mult * config.dim * a    # per token of one micro-batch
    heads = (1 + M) * config.vocab_size * (4 + 4) if last else 0
    activations = tokens * (in_flight_micro_batches(pp, stage) * blocks + heads)
    return MemoryEstimate(
        tp=tp, cp=cp, ep=ep, pp=pp, world=world, dp=world // (tp * cp * pp), dense_shards=dense_shards,
        expert_shards=expert_shards, dtype=dtype, seq=seq, micro_batch=micro_batch, tokens_per_rank=tokens,
        parameters=sum(n for n, *_ in tensors.values()), trainable_dense=dense, trainable_expert=expert,
        weights=weights, gradients=gradients, optimizer=optimizer, activations=activations, stage=stage,
        layers=layers, moments=moments)


class StateDoesNotFit(UserInputError):
    """The training state alone is larger than the GPU's memory."""


def check_state_fits(config, *, tp: int, cp: int, ep: int, pp: int, world: int, dtype: str, moments: str,
                     device_bytes: int, device_name: str) -> MemoryEstimate:
    """Refuse a layout whose weights, fp32 gradients and optimizer state on one GPU (the estimate's exact parts:
    no activations, no buffers, no rollout engine) exceed the GPU's ``device_bytes``, before anything is built.
    Why: a Flash-shaped GRPO run on an 80 GB H100 built the model, loaded it, started the engine and failed with
    CUDA's out-of-memory error 71 s in (``bench/results/grpo-h100-flash-shaped-oom-256.json``); its state needs
    97.4 GiB on one GPU. Returns the estimate when it fits."""
    est = estimate_memory(config, tp=tp, cp=cp, ep=ep, pp=pp, world=world, dtype=dtype, moments=moments)
    state = est.weights + est.gradients + est.optimizer
    if state <= device_bytes:
        return est
    gib = 2 ** 30
    fixes = ["spread the model over more GPUs (--ep, --tp, --pp; data-parallel ranks shard the optimizer)"]
    if moments == "fp32":
        saved = est.optimizer - estimate_memory(config, tp=tp, cp=cp, ep=ep, pp=pp, world=world, dtype=dtype,
                                                moments="bf16").optimizer
        fixes.append(f"adam_moments_dtype=bf16 (saves {saved / gib:.1f} GiB)")
    raise StateDoesNotFit(
        f"the training state needs {state / gib:.1f} GiB a GPU (weights {est.weights / gib:.1f}, fp32 gradients "
        f"{est.gradients / gib:.1f}, optimizer {est.optimizer / gib:.1f}; tp {tp}, cp {cp}, ep {ep}, pp {pp} on "
        f"{world} GPU(s)), more than the {device_bytes / gib:.1f} GiB of {device_name}, before any activation. "
        f"Fix: {', or '.join(fixes)}; `dsv4 inspect` estimates a layout")


def check_run_fits_gpu(config, run_config, moments: str) -> None:
    """:func:`check_state_fits` for a run (``core.run_config``) on this process's GPU, before its model is built:
    on a GPU target with ``--quant bf16`` (the estimate's dtypes) only; other schemes and the CPU are not
    checked. ``moments``: the trainer's ``adam_moments_dtype``."""
    import torch

    sel = run_config.selection
    if not sel.hardware.gpu or sel.quant.name != "bf16" or not torch.cuda.is_available():
        return
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    check_state_fits(config, tp=run_config.tp, cp=run_config.cp, ep=run_config.ep, pp=run_config.pp,
                     world=run_config.world, dtype=run_config.dtype, moments=moments,
                     device_bytes=props.total_memory, device_name=props.name)
