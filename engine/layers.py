"""Small replicated building blocks with native (megatron) parameter names."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels import wgrad
from kernels.reference.layers import rms_norm

from .runtime import ensure_megatron
from .tp import keeps_fp32, mark_keep_in_fp32

__all__ = ["KeepFP32Module", "Linear", "RMSNorm", "init_normal_", "row_parallel_linear", "attribute_on"]


class KeepFP32Module(nn.Module):
    """Casting (``.to(bf16)``, ``.half()``) leaves this module's *direct* fp32 tensors flagged
    with ``mark_keep_in_fp32`` in fp32 (device moves still apply; fp64 casts are allowed)."""

    def _apply(self, fn, recurse=True):
        keep = {id(t) for t in list(self._parameters.values()) + list(self._buffers.values())
                if t is not None and keeps_fp32(t)}

        def guarded(t):
            out = fn(t)
            if (id(t) in keep and t.dtype == torch.float32 and out.is_floating_point()
                    and out.dtype not in (torch.float32, torch.float64)):
                return t.to(device=out.device)
            return out

        return super()._apply(guarded, recurse=recurse)


def init_normal_(t: torch.Tensor, std: Optional[float] = 0.02, generator=None) -> torch.Tensor:
    """``t`` drawn from normal(0, ``std``) in place. ``std=None``: ``t`` is left as allocated, for a model
    that a checkpoint fills (``build_model(initialize=False)``: drawing random numbers for every weight of a
    large model takes minutes on one core, and the load overwrites them all)."""
    if std is None:
        return t
    with torch.no_grad():
        return t.normal_(0.0, std, generator=generator)


class Linear(nn.Module):
    """Replicated ``y = x W^T`` without bias (``weight [out, in]``; computed in x's dtype). ``std=None``:
    not initialized (:func:`init_normal_`)."""

    def __init__(self, in_features: int, out_features: int, dtype=torch.float32, std: Optional[float] = 0.02):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(init_normal_(torch.empty(out_features, in_features, dtype=dtype), std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype:    # a fused weight gradient where the trainer asked for one (kernels.wgrad)
            return wgrad.linear(x, self.weight)
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class RMSNorm(KeepFP32Module):
    """``x * rsqrt(mean(x^2) + eps) * w``, math in fp32, result in x's dtype. ``keep_fp32``
    marks the weight fp32-kept (compressor norms).

    ``ops``: the run's op table; its ``rms_norm`` does the work (the triton backend's kernel, one pass each way;
    fp32-kept weights included). Built without one (tests, tools that build a module alone), the reference op
    ``kernels.reference.layers.rms_norm`` does, the same math. Held as ``self.ops`` so that
    ``engine.compile.compile_blocks`` swaps in its copy of the table as for every module holding the table."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=torch.float32, keep_fp32: bool = False, ops=None):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32 if keep_fp32 else dtype))
        if keep_fp32:
            mark_keep_in_fp32(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = rms_norm if self.ops is None else self.ops.rms_norm
        return norm(x, self.weight, self.eps)


@functools.cache
def _row_parallel_linear_class():
    ensure_megatron()
    from megatron.core import tensor_parallel

    class RowParallelLinear(tensor_parallel.RowParallelLinear):
        def _forward_impl(self, input, weight, *args, **kwargs):
            kwargs["tp_group"] = self.tp_group
            return super()._forward_impl(input, weight, *args, **kwargs)

    return RowParallelLinear


def row_parallel_linear(*args, **kwargs):
    """megatron-core's ``RowParallelLinear`` (same arguments, same parameters) that hands its own TP group
    to the linear function: megatron-core 0.19.2 passes ``tp_group=None`` there, which warns on every call
    and makes ``torch.compile`` break the graph at each such linear."""
    return _row_parallel_linear_class()(*args, **kwargs)


def attribute_on(module: nn.Module, name: str, device: torch.device) -> torch.Tensor:
    """The plain tensor attribute ``module.<name>`` on ``device``, moved there once and kept (RoPE inverse
    frequencies: fp64 attributes, not buffers, so dtype casts of the model leave them alone). Keeping them
    on the device spares a host-to-device copy per forward, which CUDA-graph capture would refuse."""
    t = getattr(module, name)
    if t.device != device:
        t = t.to(device)
        setattr(module, name, t)
    return t
