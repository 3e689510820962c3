"""Registers the `cpu` hardware target (gloo process groups, reference kernels)."""

from core.hookspecs import hookimpl
from core.records import HardwareTarget


@hookimpl
def dsv4_hardware_targets():
    return [
        HardwareTarget(
            name="cpu",
            description="CPU processes over gloo; reference (PyTorch) kernels only",
            factory="backends.cpu.target:CpuTarget",
            distributed_backend="gloo",
            gpu=False,
        )
    ]
