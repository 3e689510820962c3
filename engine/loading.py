"""Loading official (HF) checkpoints into a native model, and full views of TP-sharded state.

Names go through the one weight contract (``core.weight_contract``); this module only shards /
gathers: a native tensor's TP layout is read from its own metadata (``engine.tp.tp_spec``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, Tuple

import torch
from torch import nn

from .runtime import tp_group, tp_rank, tp_world
from .tp import gather_tensor, shard_tensor, tp_spec

__all__ = ["native_tensors", "load_native_tensors", "load_hf_checkpoint", "load_hf_state_dict",
           "full_native_state", "full_native_grads"]


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
    rank's shard of TP-sharded tensors. Returns the names loaded; with ``strict`` every model
    tensor must be covered and every name must exist in the model."""
    targets = native_tensors(model)
    rank, world = tp_rank(), tp_world()
    done = []
    for name, full in items:
        dst = targets.get(name)
        if dst is None:
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
    """Load an official-format checkpoint directory (bf16 / fp8 / fp4; dequantised on read)."""
    from core.checkpoint import open_checkpoint

    reader = open_checkpoint(path)
    config = config or reader.config
    return load_hf_state_dict(model, reader.iter_tensors(dequantize=True, dtype=torch.float32, progress=False),
                              config, strict=strict)


def full_native_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full (TP-gathered) detached copies of every native tensor (collective over the TP group)."""
    group = tp_group()
    return {n: gather_tensor(t.detach(), tp_spec(t), group) for n, t in native_tensors(model).items()}


def full_native_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full (TP-gathered) gradients of the parameters that have one (collective over TP)."""
    group = tp_group()
    return {n: gather_tensor(p.grad, tp_spec(p), group) for n, p in model.named_parameters()
            if p.grad is not None}


def iter_native_state(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    yield from full_native_state(model).items()
