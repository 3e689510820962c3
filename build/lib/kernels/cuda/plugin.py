"""Registers the `cuda` kernel backend."""

from core.hookspecs import hookimpl
from core.records import KernelBackend
from kernels.cuda.shape import HEAD_DIM, HEAD_TILE


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="cuda",
            description="CUDA C++ sparse-attention forward for H100/H200 (sm_90a, head dim 512, heads in tiles of 64; compiled with nvcc on first use); its backward, the indexer and the mHC ops are the triton backend's kernels",
            factory="kernels.cuda.backend:ops",
            availability="kernels.cuda.backend:unavailable_reason",
            hardware={"nvidia"},
            dtypes={"bf16"},
            impls={"miles", "megatron"},
            attention_head_dims={HEAD_DIM},
            attention_heads_multiple=HEAD_TILE,
        )
    ]
