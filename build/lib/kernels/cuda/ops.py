"""Launchers of the ``dsv4_cuda`` custom ops (``kernels.gpu_ops.CUDA``): the forward is the CUDA C++ kernel
(:mod:`kernels.cuda.attention`), the backward the Triton one (:func:`kernels.triton.attention.sparse_attention_bwd`,
which takes the forward's ``o`` and ``lse2`` in the same layout and units). Inputs are made contiguous here,
as the kernel reads raw rows; the entry points (:mod:`kernels.cuda.backend`) have checked them before."""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["sparse_attention_fwd", "sparse_attention_bwd"]


def sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    from kernels.cuda import attention

    return attention.sparse_attention_fwd(q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous(),
                                          sink, scale)


def sparse_attention_bwd(q, kv, idx, sink, o, lse2, do, scale):
    from kernels.triton import attention

    return attention.sparse_attention_bwd(q, kv, idx, sink, o, lse2, do, scale)
