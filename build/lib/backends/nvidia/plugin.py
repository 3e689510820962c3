"""Registers the `nvidia` hardware target (CUDA devices, NCCL)."""

from core.hookspecs import hookimpl
from core.records import HardwareTarget


@hookimpl
def dsv4_hardware_targets():
    return [
        HardwareTarget(
            name="nvidia",
            description="NVIDIA GPUs over NCCL (plain torch / megatron-core linears; no Transformer Engine)",
            factory="backends.nvidia.target:NvidiaTarget",
            availability="backends.nvidia.target:unavailable_reason",
            distributed_backend="nccl",
            gpu=True,
        )
    ]
