"""Registers the `example-ref` kernel backend.

It reuses the reference ops and declares that it serves only the miles
implementation on the CPU, so the combination table accepts
`--impl miles --kernel-backend example-ref --hardware cpu` and rejects the rest
with the same messages it gives for built-in backends.
"""

from core.hookspecs import hookimpl
from core.records import KernelBackend


@hookimpl
def dsv4_kernel_backends():
    return [
        KernelBackend(
            name="example-ref",
            description="example third-party kernel backend (wraps the reference ops)",
            factory="dsv4_example_plugin.plugin:ops",
            hardware={"cpu"},
            impls={"miles"},
        )
    ]


def ops():
    from kernels.reference.backend import ops as reference_ops

    return reference_ops()
