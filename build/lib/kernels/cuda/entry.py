"""The `cuda` backend's attention entry points (THD and batched) over the ``dsv4_cuda`` custom ops, with the
checks that run before the op (so also while ``torch.compile`` traces): what the kernel does not take is
refused with the fix, never handed to another kernel."""

from __future__ import annotations

import torch

from kernels import gpu_common, gpu_ops
from kernels.cuda import attention
from kernels.cuda.shape import HEAD_DIM, HEAD_TILE

__all__ = ["sparse_attention_with_sink_thd", "sparse_attention_with_sink", "kernel_supports"]


def _check(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor) -> None:
    """The GPU backends' common checks, then the kernel's own (:func:`kernels.cuda.attention.check_inputs`;
    the launcher makes the inputs contiguous)."""
    gpu_common.check_attention_inputs(q, kv, idx, sink, "cuda")
    attention.check_inputs(q, kv, idx, sink, contiguous=False)


def kernel_supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Batched inputs the kernel takes: bf16 q and kv, head dim 512, heads a multiple of 64."""
    return (q.dtype == torch.bfloat16 and kv.dtype == q.dtype and q.shape[-1] == HEAD_DIM
            and q.shape[-2] % HEAD_TILE == 0)


sparse_attention_with_sink_thd, sparse_attention_with_sink = gpu_common.make_attention_api(
    gpu_ops.CUDA, _check, kernel_supports, __name__)
