"""Registers the `cudnn` kernel backend."""

from core.hookspecs import hookimpl
from core.records import KernelBackend


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="cudnn",
            description="cuDNN-frontend sparse attention (NVIDIA only; the Megatron-native path's fused kernel)",
            factory="kernels.cudnn.backend:ops",
            availability="kernels.cudnn.backend:unavailable_reason",
            hardware={"nvidia"},
            impls={"megatron"},
            dtypes={"bf16"},
            not_runnable="not built: the cuDNN-frontend sparse-attention kernels are not written",
        )
    ]
