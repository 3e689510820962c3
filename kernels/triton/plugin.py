"""Registers the `triton` kernel backend."""

from core.hookspecs import hookimpl
from core.records import KernelBackend


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="triton",
            description="Triton GPU kernels: sparse attention with sink (fwd/bwd), indexer, compressor, mHC",
            factory="kernels.triton.backend:ops",
            availability="kernels.triton.backend:unavailable_reason",
            hardware={"nvidia", "rocm"},
            impls={"miles", "megatron"},
        )
    ]
