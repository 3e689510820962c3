"""The ROCm hardware target: HIP devices, RCCL through torch's nccl backend."""

from typing import Optional

import torch


def unavailable_reason() -> Optional[str]:
    """None when a HIP device is visible, else why not."""
    if getattr(torch.version, "hip", None) is None:
        return f"this torch build ({torch.__version__}) has no ROCm/HIP support"
    if not torch.cuda.is_available():
        return "no ROCm device is visible (torch.cuda.is_available() is False)"
    return None


class RocmTarget:
    """One HIP device per local rank (torch exposes them as 'cuda')."""

    distributed_backend = "nccl"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)
