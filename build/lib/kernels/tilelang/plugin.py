"""Registers the `tilelang` kernel backend."""

from core.hookspecs import hookimpl
from core.records import KernelBackend


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="tilelang",
            description="TileLang GPU kernels: sparse attention with sink (fwd/bwd) and the indexer; the other ops from the reference set",
            factory="kernels.tilelang.backend:ops",
            availability="kernels.tilelang.backend:unavailable_reason",
            hardware={"nvidia", "rocm"},
            dtypes={"bf16"},
            impls={"miles"},
        )
    ]
