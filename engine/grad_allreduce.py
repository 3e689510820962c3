"""Gradients summed over a process group without megatron-core's buffers: the trainer's plain torch optimizer
(``train.optim.TorchOptimizer``: the CPU target, one flat all-reduce per dtype) and the parallel benchmark."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

__all__ = ["all_reduce_grads"]


def all_reduce_grads(params: List[torch.nn.Parameter], group, average: bool = False) -> None:
    """Sum (or average) the gradients of ``params`` over ``group``, one flat all-reduce per dtype (a parameter
    without a gradient counts as zeros, so every rank sends the same layout)."""
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: Dict[torch.dtype, list] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        grads = [p.grad for p in group_params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
