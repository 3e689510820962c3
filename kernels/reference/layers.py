"""Small shared building blocks: a bare ``Linear``, ``RMSNorm`` and the fp32-keeping mixin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "RMSNorm", "KeepFP32", "compute_dtype", "rms_normalize"]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 if any input is fp64 (lets tests run the whole model in double precision)."""
    dt = torch.float32
    for t in tensors:
        dt = torch.promote_types(dt, t.dtype)
    return dt


class KeepFP32(nn.Module):
    """Mixin: the tensors named in ``_fp32_names`` (direct params/buffers of the module) keep
    float32 storage when the module is cast (``.to(torch.bfloat16)``, ``.half()``, ...).
    Device moves and ``to_empty`` still apply. Casting to float64 is allowed (tests)."""

    _fp32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        keep = set()
        for n in self._fp32_names:
            t = self._parameters.get(n, None)
            if t is None:
                t = self._buffers.get(n, None)
            if t is not None:
                keep.add(id(t))

        def guarded(t):
            out = fn(t)
            if (id(t) in keep and t.dtype == torch.float32 and out.is_floating_point()
                    and out.dtype not in (torch.float32, torch.float64)):
                if t.is_meta or out.is_meta:
                    return torch.empty_like(out, dtype=torch.float32)
                return t.to(device=out.device)
            return out

        return super()._apply(guarded, recurse=recurse)


class Linear(nn.Module):
    """``y = x W^T`` (no bias). Storage only ``weight [out, in]``; no costly init at construction
    (``init_weights`` initializes), so huge configs build quickly on the meta device."""

    def __init__(self, in_features: int, out_features: int, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim, computed in fp32 (fp64 for fp64 input)."""
    ct = compute_dtype(x)
    xf = x.to(ct)
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class RMSNorm(KeepFP32):
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32, cast back to the input dtype; weight stays fp32."""

    _fp32_names = ("weight",)

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x, self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)
