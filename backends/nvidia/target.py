"""The NVIDIA hardware target: CUDA devices and NCCL process groups."""

from typing import Optional

import torch


def unavailable_reason() -> Optional[str]:
    """None when a CUDA device is visible, else why not."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


class NvidiaTarget:
    """One CUDA device per local rank; ranks talk over NCCL."""

    distributed_backend = "nccl"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)
