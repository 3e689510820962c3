"""Registers the `none` kernel backend: the PyTorch reference ops.

The reference ops are the oracle every other kernel backend is tested against;
they run anywhere torch runs.
"""

from core.hookspecs import hookimpl
from core.records import KernelBackend


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="none",
            description="PyTorch reference ops (the oracle for every other backend); runs on any hardware",
            factory="kernels.reference.backend:ops",
            hardware=None,
            impls=None,
            deterministic=True,
        )
    ]
