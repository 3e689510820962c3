"""Picks the fused Triton kernels (:mod:`converters.triton_kernels`) for CUDA tensors.

The torch code in each converter stays the reference; the Triton path is taken
only when every given tensor is on CUDA, triton is importable and the
environment does not switch it off (``DSV4_CONVERTERS_TRITON=0``). The kernel
module is imported lazily, on the first CUDA call, so CPU-only hosts never
import triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ENV_SWITCH = "DSV4_CONVERTERS_TRITON"


@functools.lru_cache(maxsize=None)
def _kernels():
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from . import triton_kernels
    except Exception:  # an incompatible triton build: keep the torch path
        return None
    return triton_kernels


def triton_kernels_for(*tensors):
    """The kernel module when every tensor is a CUDA tensor and Triton may be used, else ``None``."""
    if not tensors or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return None
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return _kernels()
