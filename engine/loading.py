"""Loading official (HF) checkpoints into a native model, and full views of TP-sharded state.

Names go through the one weight contract (``core.weight_contract``); this module only shards /
gathers: a native tensor's TP layout is read from its own metadata (``engine.tp.tp_spec``); under expert
parallelism a rank holds its experts under their global names and the full views gather the others
(``engine.expert_parallel``).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Tuple

import torch
from torch import nn

from .expert_parallel import expert_banks, expert_name
from .layout import current as parallel_layout
from .tp import full_shape, gather_tensor, shard_tensor, tp_pieces, tp_spec

__all__ = ["native_tensors", "load_native_tensors", "load_native_slices", "load_hf_checkpoint", "load_hf_tensors",
           "load_hf_state_dict", "full_native_state", "full_native_grads", "with_every_expert", "held_official_names"]


def native_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every native tensor of ``model``: parameters (incl. the frozen ``tid2eid``) and buffers."""
    out = dict(model.named_parameters())
    for n, b in model.named_buffers():
        out.setdefault(n, b)
    return out


@torch.no_grad()
def load_native_tensors(model: nn.Module, items: Iterable[Tuple[str, torch.Tensor]], *,
                        strict: bool = True) -> list:
    """Copy full (unsharded) native ``(name, tensor)`` pairs into ``model``, keeping this TP
    rank's shard of TP-sharded tensors (and, under expert parallelism, only this rank's experts).
    Returns the names loaded; with ``strict`` every model tensor must be covered and every name must
    exist in the model."""
    targets = native_tensors(model)
    layout = parallel_layout()
    rank, world = layout.tp_rank, layout.tp
    held_banks = expert_banks(targets) if parallel_layout().ep > 1 else set()
    done = []
    for name, full in items:
        dst = targets.get(name)
        if dst is None:
            parsed = expert_name(name)
            if parsed is not None and parsed[0] in held_banks:  # another EP rank's expert
                continue
            if strict:
                raise KeyError(f"native tensor {name!r} has no place in the model")
            continue
        local = shard_tensor(full, tp_spec(dst), rank, world)
        if tuple(local.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: shard shape {tuple(local.shape)} != model shape {tuple(dst.shape)}")
        dst.copy_(local.to(dst.dtype))
        done.append(name)
    if strict:
        missing = sorted(set(targets) - set(done))
        if missing:
            raise KeyError(f"{len(missing)} model tensor(s) not loaded, e.g. {missing[:5]}")
    return done


def load_hf_state_dict(model: nn.Module, official: Iterable[Tuple[str, torch.Tensor]], config, *,
                       strict: bool = True) -> list:
    """Official-name ``(name, tensor)`` pairs -> ``hf_to_native`` -> :func:`load_native_tensors`."""
    from core.weight_contract import hf_to_native

    return load_native_tensors(model, hf_to_native(official, config), strict=strict)


def load_hf_checkpoint(model: nn.Module, path, config=None, *, strict: bool = True) -> list:
    """Load an official-format checkpoint directory (or an open ``core.checkpoint`` reader; bf16 / fp8 /
    fp4, dequantised on read): each rank reads only its share (:func:`load_hf_tensors`)."""
    from core.checkpoint import CheckpointReader, open_checkpoint

    reader = path if isinstance(path, CheckpointReader) else open_checkpoint(path)
    return load_hf_tensors(native_tensors(model), reader, config or reader.config, strict=strict)


@torch.no_grad()
def load_hf_tensors(targets: Dict[str, torch.Tensor], reader, config, *, strict: bool = True) -> list:
    """Fill ``targets`` (native name -> this rank's tensor: a tensor-parallel slice, or whole) from the open
    HF checkpoint ``reader``, reading from the safetensors files only the boxes this rank holds
    (``core.checkpoint.slices``): a tensor-parallel rank its rows / columns (of w1 and of w3 for
    ``linear_fc1``; FP8 / FP4 weights by the quantisation blocks covering them), replicated tensors whole,
    under expert parallelism only its experts. The values equal reading whole tensors and slicing them
    (:func:`load_hf_state_dict`). Returns the names loaded; with ``strict`` every official tensor this rank
    needs must have a place in ``targets``."""
    from core.checkpoint.slices import BoxReader
    from core.weight_contract import native_names, official_boxes

    contract = native_names(config)
    layout = parallel_layout()
    rank, world = layout.tp_rank, layout.tp
    used, done = set(), []
    with BoxReader(reader) as boxes:
        for name, dst in targets.items():
            if name not in contract:
                raise KeyError(f"model tensor {name!r} is not a contract tensor of this model")
            spec = tp_spec(dst)
            if full_shape(dst.shape, spec, world) != tuple(contract[name][0]):
                raise ValueError(f"{name}: a tensor-parallel slice {tuple(dst.shape)} of {world} does not fit "
                                 f"the contract shape {tuple(contract[name][0])}")
            local = torch.empty(tuple(dst.shape), dtype=torch.float32 if dst.is_floating_point() else torch.int64)
            for offsets, view in tp_pieces(local.view(-1), tuple(local.shape), 0, spec, rank, world):
                for off_name, off, sizes, inner in official_boxes(name, offsets, view.shape, config):
                    part = boxes.read(off_name, off, sizes, torch.float32)   # floats as fp32, as hf_to_native
                    view[tuple(slice(i, i + s) for i, s in zip(inner, sizes))].copy_(part)
                    used.add(off_name)
            dst.copy_(local.to(dst.dtype))
            done.append(name)
    if strict:
        needed = held_official_names(targets, reader.logical_specs(), config)
        unplaced = sorted(set(reader.logical_specs() if needed is None else needed) - used)
        if unplaced:
            raise KeyError(f"{len(unplaced)} checkpoint tensor(s) have no place in the model, e.g. {unplaced[:5]}")
    return done


_OFFICIAL_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def held_official_names(held_native: Iterable[str], official: Iterable[str], config=None):
    """The official tensors a rank needs when it holds ``held_native``: every tensor but the routed experts
    another expert-parallel rank holds (None: all of them, without expert or pipeline parallelism); a pipeline
    stage (engine.pipeline) needs those of the native tensors it holds."""
    if parallel_layout().pp > 1 and config is not None:
        from core.weight_contract import native_to_official_names

        return sorted({o for n in held_native for o in native_to_official_names(n, config)})
    if parallel_layout().ep == 1:
        return None
    experts = {parsed[1] for parsed in map(expert_name, held_native) if parsed is not None}
    keep = []
    for name in official:
        m = _OFFICIAL_EXPERT.search(name)
        if m is None or int(m.group(1)) in experts:
            keep.append(name)
    return keep


def full_native_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full (TP-gathered, every EP rank's experts) detached copies of every native tensor (collective over
    the TP and EP groups)."""
    group = parallel_layout().group("tp")
    local = {n: gather_tensor(t.detach(), tp_spec(t), group) for n, t in native_tensors(model).items()}
    return with_every_expert(local)


def full_native_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full (TP-gathered, every EP rank's experts) gradients of the parameters that have one (collective
    over TP and EP; under EP an expert without a gradient counts as zeros, so every rank takes part)."""
    group = parallel_layout().group("tp")
    ep = parallel_layout().ep > 1
    out = {}
    for n, p in model.named_parameters():
        grad = p.grad
        if grad is None and ep and expert_name(n) is not None:
            grad = torch.zeros_like(p)
        if grad is not None:
            out[n] = gather_tensor(grad, tp_spec(p), group)
    return with_every_expert(out)


def with_every_expert(named: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Under expert parallelism, replace each bank's local experts by every rank's (all-gather over the EP
    group; ranks hold equal, contiguous expert ranges), in global expert order."""
    import torch.distributed as dist

    world = parallel_layout().ep
    if world == 1:
        return named
    group = parallel_layout().group("ep")
    banks: Dict[str, list] = {}
    for n in named:
        parsed = expert_name(n)
        if parsed is not None:
            banks.setdefault(parsed[0], []).append(parsed[1])
    out: Dict[str, torch.Tensor] = {}
    for n, t in named.items():
        parsed = expert_name(n)
        if parsed is None:
            out[n] = t
            continue
        ids = banks.pop(parsed[0], None)
        if ids is None:
            continue  # its bank already went out with the bank's first expert
        prefix = parsed[0]
        local = torch.stack([named[f"{prefix}{i}"] for i in sorted(ids)])
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        for r, part in enumerate(parts):
            for j, w in enumerate(part):
                out[f"{prefix}{r * len(ids) + j}"] = w
    return out


def iter_native_state(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    yield from full_native_state(model).items()


@torch.no_grad()
def load_native_slices(named: Iterable[Tuple[str, torch.Tensor]], checkpoint, config) -> dict:
    """Read this rank's share of a native checkpoint straight into the ``(contract name, tensor)`` pairs it
    holds (a module's :func:`native_tensors`; a training model's ``native_tensors()``): their tensor-parallel
    slices (``engine.tp.tp_pieces``: where they lie in the full tensors) and, under expert parallelism, its
    experts. Only the stored chunks overlapping them are read (``core.native_checkpoint.load_native_pieces``),
    so from a ``dsv4 convert`` checkpoint (split tensors stored as chunks along their split dim,
    ``core.tp_layout``) a tensor-parallel rank reads its slices alone; from a one-chunk-per-tensor one, the
    whole tensors it slices, as before. Returns the checkpoint's metadata."""
    from core.native_checkpoint import load_native_pieces

    layout = parallel_layout()

    rank, world = layout.tp_rank, layout.tp
    wanted = {n: tp_pieces(t.data.view(-1), tuple(t.shape), 0, tp_spec(t), rank, world) for n, t in named}
    return load_native_pieces(checkpoint, wanted, config=config)


def load_weights(model: nn.Module, checkpoint, config) -> None:
    """``checkpoint`` into ``model``: a native checkpoint (``dsv4 convert``, recognized by its metadata; one
    written under pre-contract names is refused), a megatron-core torch_dist one (upstream names,
    ``converters.torch_dist``) or an HF one (official names, any weight format). Each rank keeps its own
    tensor- and expert-parallel share. Every weight of ``model`` must be written by the load
    (``core.finite.check_written``: a model built with ``initialize=False`` starts NaN)."""
    from converters.torch_dist import is_torch_dist_checkpoint, load_torch_dist
    from core.finite import check_written
    from core.native_checkpoint import is_native_checkpoint

    if is_native_checkpoint(checkpoint):
        load_native_slices(native_tensors(model).items(), checkpoint, config)
    elif is_torch_dist_checkpoint(checkpoint):
        state, _config = load_torch_dist(checkpoint, config)
        layout = parallel_layout()
        if layout.pp > 1:                   # a pipeline stage loads its own tensors (core.pp_layout)
            from core.pp_layout import stage_of

            state = {n: t for n, t in state.items() if stage_of(n, config.n_layers, layout.pp, layout.vp)
                     == layout.pp_rank}
        load_native_tensors(model, state.items())
    else:
        load_hf_checkpoint(model, checkpoint, config)
    check_written(model, source=f"checkpoint {checkpoint}")
