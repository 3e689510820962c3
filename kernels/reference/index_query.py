"""The ``index_query`` op in torch: the Lightning Indexer's decode query after its GEMM, the contract of the GPU
backends' one-kernel version (``kernels/triton/index_query.py``), which the eager static decode step calls where
the run's table has it (``kernels.reference.decode._index_step``): RoPE on the query heads, the Hadamard rotation
in the compute dtype, and the cast to the dtype ``indexer_scores`` takes, four launches in torch (a rotation, a
cast, the transform, a cast)."""

from __future__ import annotations

import torch

from .compressor import hadamard_transform
from .layers import compute_dtype
from .rope import apply_rope

__all__ = ["index_query"]


def index_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``q [B, 1, H, D]`` (the indexer's ``wq_b`` output) -> ``hadamard(rope(q).to(compute)).to(out_dtype)``: RoPE at
    each row's angles ``cos, sin [B, 1, r/2]`` (:func:`~.rope.apply_rope`, in ``q``'s dtype), the transform
    (:func:`~.compressor.hadamard_transform`) in the compute dtype (fp32; fp64 for fp64)."""
    return hadamard_transform(apply_rope(q, cos, sin).to(compute_dtype(q))).to(out_dtype)
