"""The CPU hardware target: device and process-group choices for CPU runs."""

import torch


class CpuTarget:
    """Runs on the host CPU; several ranks talk over gloo."""

    distributed_backend = "gloo"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")
