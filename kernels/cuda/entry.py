"""The `cuda` backend's attention entry points (THD and batched) over the ``dsv4_cuda`` custom ops, with the
checks that run before the op (so also while ``torch.compile`` traces): what the kernel does not take is
refused with the fix, never handed to another kernel."""

from __future__ import annotations

import torch

from kernels import gpu_common, gpu_ops
from kernels.cuda.shape import HEAD_DIM, HEAD_TILE

__all__ = ["sparse_attention_with_sink_thd", "sparse_attention_with_sink", "kernel_supports"]


def _check(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor) -> None:
    gpu_common.check_attention_inputs(q, kv, idx, sink, "cuda")
    H, D = q.shape[1], q.shape[2]
    if q.dtype != torch.bfloat16:
        raise ValueError(f"the cuda attention kernel takes bf16 q and kv, got {q.dtype}. Fix: run with --dtype "
                         "bf16, or --kernel-backend triton (bf16/fp16)")
    if D != HEAD_DIM or H % HEAD_TILE:
        raise ValueError(f"the cuda attention kernel is built for head dim {HEAD_DIM} and a multiple of "
                         f"{HEAD_TILE} heads, got {H} heads of {D}. Fix: use --kernel-backend triton")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        cap = torch.cuda.get_device_capability(q.device)
        raise ValueError(f"the cuda attention kernel is built for sm_90a (H100 / H200); this GPU is sm_{cap[0]}"
                         f"{cap[1]}. Fix: use --kernel-backend triton")


def kernel_supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Batched inputs the kernel takes: bf16 q and kv, head dim 512, heads a multiple of 64."""
    return (q.dtype == torch.bfloat16 and kv.dtype == q.dtype and q.shape[-1] == HEAD_DIM
            and q.shape[-2] % HEAD_TILE == 0)


sparse_attention_with_sink_thd, sparse_attention_with_sink = gpu_common.make_attention_api(
    gpu_ops.CUDA, _check, kernel_supports, __name__)
