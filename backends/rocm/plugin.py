"""Registers the `rocm` hardware target (AMD GPUs, RCCL, no cuDNN).

No AMD GPU is available to this project: the target defines the rules (which
kernel backends and quantization schemes can run there) and is untested on
hardware.
"""

from core.hookspecs import hookimpl
from core.records import HardwareTarget


@hookimpl
def dsv4_hardware_targets():
    return [
        HardwareTarget(
            name="rocm",
            description="AMD GPUs over RCCL (torch's nccl backend on HIP); no cuDNN; rules only, untested on hardware",
            factory="backends.rocm.target:RocmTarget",
            availability="backends.rocm.target:unavailable_reason",
            distributed_backend="nccl",
            gpu=True,
        )
    ]
