"""Registers the `nvidia` hardware target (CUDA devices, NCCL)."""

from core.hookspecs import hookimpl
from core.probes import python_package_missing
from core.records import HardwareTarget


def _description() -> str:
    # A cheap find_spec probe (no import): `dsv4 plugins` says plainly whether Transformer Engine is here.
    te = "not installed here" if python_package_missing("transformer_engine") else "installed here"
    return f"NVIDIA GPUs over NCCL; Transformer Engine (optional: TE linears / FP8 training) {te}"


@hookimpl
def dsv4_hardware_targets():
    return [
        HardwareTarget(
            name="nvidia",
            description=_description(),
            factory="backends.nvidia.target:NvidiaTarget",
            availability="backends.nvidia.target:unavailable_reason",
            distributed_backend="nccl",
            gpu=True,
        )
    ]
