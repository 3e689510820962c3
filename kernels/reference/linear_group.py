"""The ``linear_group`` op in torch: the projections of one decode-step input by several weights, the contract of
the GPU backends' one-launch version (``kernels/triton/linear_group.py``), which the eager static decode step
calls where the run's table has it (``kernels.reference.decode.layer_projections``): a layer's attention input
feeds ``wq_a`` and ``wkv``, each compressor's ``wkv`` and ``wgate`` (fp32 results) and the indexer's
``weights_proj``, up to seven GEMMs of a few rows (and as many split-K reductions) where one pass over the
weights does."""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F

from .layers import linear_fp32

__all__ = ["linear_group"]


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor], fp32: Sequence[bool]) -> List[torch.Tensor]:
    """``x [M, K]`` and weights ``[N_i, K]`` -> ``[x @ W_i^T]``: in fp32 where ``fp32[i]``
    (:func:`~.layers.linear_fp32`, as the compressors compute theirs), else in ``x``'s dtype (``F.linear``, as
    :class:`~.layers.Linear` does)."""
    return [linear_fp32(x, w) if f else F.linear(x, w.to(x.dtype)) for w, f in zip(weights, fp32, strict=True)]
