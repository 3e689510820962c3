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
            description="AMD GPUs over RCCL (torch's nccl backend on HIP); no cuDNN; declares which kernels and schemes could run there",
            factory="backends.rocm.target:RocmTarget",
            availability="backends.rocm.target:unavailable_reason",
            distributed_backend="nccl",
            gpu=True,
            not_runnable=("rules only: the rocm target has no device setup or process groups yet, and no AMD GPU "
                          "is available to test one"),
        )
    ]
