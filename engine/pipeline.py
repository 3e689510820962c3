"""Pipeline parallelism (``--pp P``): which decoder layers a stage holds, the split of a built model into its
stage, megatron-core's 1F1B schedule over the trainer's micro-batches, and the collectives that bring a stage's
results and tensors to the other stages.

Why here: the split and the schedule are the same for every implementation whose modules carry the native
(megatron) names of ``core.weight_contract`` (``embedding``, ``decoder.layers.N``, ``decoder.final_layernorm``,
``decoder.hc_head_*``, ``output_layer``, ``mtp``), and the schedule is megatron-core's own
(``megatron.core.pipeline_parallel.get_forward_backward_func``: non-interleaved 1F1B, or with ``--vpp`` the
interleaved one), which this module only feeds; the trainer's steps say what a micro-batch's loss is
(:func:`run_items`, :func:`forward_items`).

The split (:func:`stage_layers`, :func:`split_stage`): stage ``s`` of ``P`` holds a contiguous range of the
decoder layers, as even as the count allows (the first ``n_layers % P`` stages take one layer more); stage 0 also
holds the embedding, the last stage the final norm, the hc head, the output layer and the MTP blocks. Every
parameter keeps its GLOBAL native name (``decoder.layers.N`` with the model's N), so checkpoints, weight sync and
the weight contract see the same names on every layout; the layers of other stages are :class:`OtherStage`
placeholders (no parameters) so ``decoder.layers[N]`` still indexes by the global N. A model is built whole and
then cut (the random initialization draws every weight in the one-stage order, so ``--pp 2`` starts from the very
weights of ``--pp 1``); a stage's memory at construction is therefore the whole model's.

The schedule (:func:`run_schedule`): between stages travel the mHC residual streams ``[B, S, hc, d]``, sent as
megatron's ``[S, B, hc x d]`` in fp32 (lossless for bf16 and fp32 streams), padded to the step's largest
micro-batch so one fixed shape serves every micro-batch (megatron's ``variable_seq_lengths`` exchange calls
``torch.cuda.synchronize``; fixed shapes need no such exchange). Point-to-point runs unbatched
(``batch_p2p_comm=False``: isend / irecv, which gloo has). The loss is computed on the last stage (megatron's
``calculate_per_token_loss``: the trainer's loss is already divided by the step's global token count and is
backpropagated as it is).

Virtual stages (``--vpp V``, ``layout.vp``): a rank holds ``V`` chunks of the layers (``core.pp_layout``: chunk
``v`` of stage ``s`` is the ``v x P + s``-th of ``P x V`` ranges) in its one module, and megatron's interleaved
schedule runs them as ``V`` model chunks. While a chunk runs (:func:`_running`), :func:`is_first` and
:func:`is_last` answer for it (the embedding is on chunk 0 of stage 0, the head on chunk ``V - 1`` of the last
stage) and :func:`active_layers` gives the decoders only its layers; outside the schedule they answer for the
rank. The chunks share the module's parameters, so gradients, checkpoints (global names) and weight sync see one
module per rank, as without virtual stages.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from core.pp_layout import chunk_layers, rank_layers, stage_layers   # the split (dsv4 inspect reads the same rule)

__all__ = ["stage_layers", "split_stage", "OtherStage", "is_first", "is_last", "active_layers", "run_schedule",
           "from_last_stage", "gather_over_stages", "full_stage_tensors", "pipelined", "rows_device", "run_items",
           "forward_items"]

# The model chunk megatron's interleaved schedule runs now on this rank (None: outside the schedule, or no --vpp).
_CHUNK: Dict[str, Optional[int]] = {"now": None}


class OtherStage(nn.Module):
    """Stands where another pipeline stage's module is (no parameters): calling it is a bug."""

    def __init__(self, name: str, stage: int):
        super().__init__()
        self.name, self.stage = name, stage

    def forward(self, *a, **kw):
        raise RuntimeError(f"{self.name} is held by pipeline stage {self.stage}, not this one")

    def extra_repr(self) -> str:
        return f"{self.name} on stage {self.stage}"


def is_first(layout) -> bool:
    """Whether this rank (inside the schedule: the chunk running now) holds the embedding."""
    return layout.pp_rank == 0 and _CHUNK["now"] in (None, 0)


def is_last(layout) -> bool:
    """Whether this rank (inside the schedule: the chunk running now) holds the head."""
    return layout.pp_rank == layout.pp - 1 and _CHUNK["now"] in (None, _vp(layout) - 1)


def _vp(layout) -> int:
    return getattr(layout, "vp", 1)


@contextlib.contextmanager
def _running(chunk: Optional[int]):
    """Model chunk ``chunk`` runs (None: the rank's whole stage, no virtual stages)."""
    before, _CHUNK["now"] = _CHUNK["now"], chunk
    try:
        yield
    finally:
        _CHUNK["now"] = before


def active_layers(layers) -> list:
    """The decoder layers that run now, in order: this rank's (another stage's are :class:`OtherStage`), and while a
    model chunk runs only that chunk's (the decoders of both implementations loop over these)."""
    from engine.layout import current

    chunk, layout = _CHUNK["now"], current()
    span = range(len(layers)) if chunk is None else chunk_layers(len(layers), layout.pp, layout.pp_rank, chunk,
                                                                  _vp(layout))
    return [layers[i] for i in span if not isinstance(layers[i], OtherStage)]


def split_stage(module: nn.Module, n_layers: int, layout) -> nn.Module:
    """Cut a whole model (native names) to this rank's stage, in place; returns it."""
    pp, stage = layout.pp, layout.pp_rank
    if pp == 1:
        return module
    owner = {i: s for s in range(pp) for i in rank_layers(n_layers, pp, s, _vp(layout))}
    layers = module.decoder.layers
    for i in range(len(layers)):
        if owner[i] != stage:
            layers[i] = OtherStage(f"decoder.layers.{i}", owner[i])
    if not is_first(layout):
        module.embedding = OtherStage("embedding", 0)
    if not is_last(layout):
        for name in ("output_layer", "mtp"):
            if hasattr(module, name):
                setattr(module, name, OtherStage(name, pp - 1))
        module.decoder.final_layernorm = OtherStage("decoder.final_layernorm", pp - 1)
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            if name in module.decoder._parameters:
                del module.decoder._parameters[name]
    return module


def _cpu_scratch():
    """megatron's schedule makes its token counter with ``device="cuda"``; without CUDA, inside the schedule
    every tensor asked for on ``cuda`` is made on the CPU (the model's own tensors never ask for it there)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.overrides import TorchFunctionMode

    class _CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return _CudaToCpu()


class _Chunk(nn.Module):
    """What megatron's schedule holds as "the model" (one per model chunk with ``--vpp``): its config, its chunk
    index (None: no virtual stages) and the stage's received input."""

    def __init__(self, config, index: Optional[int] = None):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config, self.index = config, index
        self.model_type = ModelType.encoder_or_decoder     # the interleaved schedule asks the chunks for it
        self.input: Optional[torch.Tensor] = None

    def set_input_tensor(self, t) -> None:
        self.input = t[0] if isinstance(t, (list, tuple)) else t


def _group_size(n_micro: int, pp: int) -> int:
    """megatron's ``microbatch_group_size_per_vp_stage`` for ``n_micro`` micro-batches: the smallest size in
    ``[pp, n_micro]`` whose last group is full or at least ``pp`` (its schedule refuses the rest); ``pp`` (the
    depth-first default) when the count is a multiple of it."""
    return next(g for g in range(pp, n_micro + 1) if n_micro % g == 0 or n_micro % g >= pp)


def _schedule_config(hidden: int, n_micro: int):
    from engine.layout import current

    layout = current()
    vp = _vp(layout)
    if vp > 1 and n_micro < layout.pp:
        raise ValueError(f"--vpp {vp} runs megatron-core's interleaved schedule, which needs at least --pp "
                         f"{layout.pp} micro-batches per step on each data-parallel rank, and this step has "
                         f"{n_micro}. Fix: set micro_batch_size so the step splits into {layout.pp} or more, or "
                         f"drop --vpp")
    from megatron.core.model_parallel_config import ModelParallelConfig

    cfg = ModelParallelConfig(pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32,
                              virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                              batch_p2p_comm=False, variable_seq_lengths=False, deallocate_pipeline_outputs=False)
    if vp > 1:
        cfg.microbatch_group_size_per_vp_stage = _group_size(n_micro, layout.pp)
    cfg.hidden_size = hidden         # get_tensor_shapes reads it: the flattened hc x d of a stream row
    cfg.calculate_per_token_loss = True   # (a TransformerConfig field the schedule reads): no rescaling
    return cfg


def run_schedule(micro_batches: Sequence[Any], shapes: Sequence[tuple], hidden: int,
                 stage_fn: Callable, loss_fn: Callable, *, forward_only: bool = False) -> None:
    """Run megatron-core's pipeline schedule over ``micro_batches`` on this stage.

    ``shapes[k]``: ``(B, S)`` of micro-batch k (every stage knows it: every stage has the ids, which hash-routed
    layers look up); ``hidden``: ``hc x d``. ``stage_fn(mb, streams)`` runs this stage (``streams [B, S, hc x d]``
    fp32 from the previous stage, None on the first) and returns the streams for the next stage, or on the last
    stage whatever ``loss_fn(mb, out)`` takes; ``loss_fn`` returns the scalar to backpropagate (its value is
    the caller's, nothing rescales it) and is called on the last stage only. Gradients accumulate in the
    parameters' ``.grad``. With ``--vpp V`` each micro-batch runs ``V`` times here, once per model chunk (in the
    interleaved schedule's order), ``stage_fn`` inside :func:`_running` of the chunk."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from engine.layout import current

    layout = current()
    S = max(s for _b, s in shapes)
    B = max(b for b, _s in shapes)
    cfg, vp = _schedule_config(hidden, len(shapes)), _vp(layout)
    chunks = [_Chunk(cfg, v if vp > 1 else None) for v in range(vp)]
    items = list(zip(micro_batches, shapes))

    def forward_step(data_iterator, model):
        mb, (b, s) = next(data_iterator)
        x = None
        if model.input is not None:             # [S, B, hc*d] padded -> [b, s, hc*d]
            x = model.input[:s, :b].transpose(0, 1)
        with _running(model.index):
            out, last = stage_fn(mb, x), is_last(layout)
        if last:
            def reduce(o):
                loss = loss_fn(mb, o)
                return loss, torch.tensor(1, dtype=torch.int), {}
            return out, reduce
        y = out.reshape(b, s, -1).to(torch.float32).transpose(0, 1)
        y = torch.nn.functional.pad(y, (0, 0, 0, B - b, 0, S - s)).contiguous()   # isend takes contiguous ones
        return y, (lambda o: (o.sum() * 0, torch.tensor(0, dtype=torch.int), {}))

    fb = get_forward_backward_func(pp_size=layout.pp, vp_size=vp if vp > 1 else None)
    with _cpu_scratch():
        fb(forward_step_func=forward_step, data_iterator=[iter(items) for _ in chunks] if vp > 1 else iter(items),
           model=chunks if vp > 1 else chunks[0], num_microbatches=len(shapes), seq_length=S, micro_batch_size=B,
           forward_only=forward_only)


def _last_rank(layout) -> int:
    return dist.get_global_rank(layout.group("pp"), layout.pp - 1)


def from_last_stage(obj, layout):
    """The last stage's ``obj`` on every stage (a pickled broadcast over the pipeline group)."""
    if layout.pp == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_last_rank(layout), group=layout.group("pp"))
    return box[0]


def gather_over_stages(obj, layout) -> List[Any]:
    """Every stage's ``obj``, in stage order (pickled)."""
    if layout.pp == 1:
        return [obj]
    parts: List[Any] = [None] * layout.pp
    dist.all_gather_object(parts, obj, group=layout.group("pp"))
    return parts


def full_stage_tensors(local: Dict[str, torch.Tensor], layout) -> Dict[str, torch.Tensor]:
    """Every stage's tensors (global names) on every stage: each stage's names and shapes first, then each
    tensor broadcast from the stage that holds it (a collective over the pipeline group)."""
    if layout.pp == 1:
        return dict(local)
    group = layout.group("pp")
    metas = gather_over_stages({n: (tuple(t.shape), t.dtype) for n, t in local.items()}, layout)
    out: Dict[str, torch.Tensor] = {}
    for stage, meta in enumerate(metas):
        src = dist.get_global_rank(group, stage)
        for name, (shape, dtype) in meta.items():
            t = local[name].detach().contiguous() if stage == layout.pp_rank else torch.empty(shape, dtype=dtype)
            dist.broadcast(t, src=src, group=group)
            out[name] = t
    return out


# -- the trainer's micro-batches (train.sft, train.grpo) -------------------------------------------------------------
# The loss runs on the last stage only, so a step's running sums (``acc``) are filled there and then broadcast to
# the other stages; each stage records the routing of the layers it holds, merged over the stages for the replay
# check. ``model`` is the trainer's model (``train.model.ImplTrainModel``: ``forward_stage``, ``config``); an item
# is a micro-batch dict with its ``ids [B, S]``.

def pipelined() -> bool:
    """Whether this rank is one stage of several."""
    from engine.layout import current

    return current().pp > 1


def rows_device(model, packed: bool) -> Optional[torch.device]:
    """Where a training step's rows go before the forward: a model's CUDA device when the rows are not packed and
    run on one stage (copied without a stream sync, so log-probs, loss and the step's sums stay on the device);
    None leaves them where they are (packed rows are laid out on the host, a pipeline's schedule moves its own)."""
    dev = getattr(model, "device", None)
    on_gpu = dev is not None and torch.device(dev).type == "cuda" and not (packed or pipelined())
    return torch.device(dev) if on_gpu else None


def _items_schedule(model, items: List[dict], forward_kw: Callable, loss: Callable, forward_only: bool):
    """Run ``items`` through the stages, ``loss(k, item, out)`` on the last stage; returns every micro-batch's
    routing merged over the stages (``{k: {layer: idx}}``)."""
    from engine.layout import current

    c, used = model.config, {}
    hidden = c.hc_mult * c.dim + (c.dim if items and forward_kw(items[0]).get("with_mtp") else 0)

    def stage(mb, streams):
        k, it = mb
        out, layers = model.forward_stage(it["ids"], streams, **forward_kw(it))
        used.setdefault(k, {}).update(layers)        # --vpp: each of this rank's chunks records its layers
        return out

    run_schedule(list(enumerate(items)), [tuple(it["ids"].shape) for it in items], hidden, stage,
                 lambda mb, out: loss(mb[0], mb[1], out), forward_only=forward_only)
    merged: Dict[int, dict] = {k: {} for k in range(len(items))}
    for part in gather_over_stages(used, current()):
        for k, layers in part.items():
            merged[k].update(layers)
    return merged


def run_items(model, items: List[dict], forward_kw: Callable, loss: Callable, acc: Dict[str, float]) -> None:
    """Forward and backward of every micro-batch; ``loss(item, out)`` adds to ``acc`` on the last stage, whose
    sums every stage then takes (in place)."""
    from engine.layout import current

    _items_schedule(model, items, forward_kw, lambda k, it, out: loss(it, out), forward_only=False)
    acc.update(from_last_stage(dict(acc), current()))


def forward_items(model, items: List[dict], forward_kw: Callable) -> list:
    """Every micro-batch's forward without gradients: ``(log-probs, routing of every layer)`` on every stage."""
    from engine.layout import current

    lps: Dict[int, torch.Tensor] = {}

    def keep(k, it, out):
        lps[k] = out.logprobs.detach()
        return out.logprobs.sum() * 0

    with torch.no_grad():
        used = _items_schedule(model, items, forward_kw, keep, forward_only=True)
    lps = from_last_stage(lps, current())
    return [(lps[k], used[k]) for k in range(len(items))]
