"""Registers the `triton` kernel backend."""

from core.hookspecs import hookimpl
from core.records import KernelBackend


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="triton",
            description="Triton GPU kernels: sparse attention with sink (fwd/bwd) and the indexer; the other ops from the reference set",
            factory="kernels.triton.backend:ops",
            availability="kernels.triton.backend:unavailable_reason",
            hardware={"nvidia", "rocm"},
            dtypes={"bf16"},
            impls={"miles", "megatron"},
        )
    ]
