"""Worker of the expert-parallel CPU test: one gloo rank of an ep=world run; rank 0 saves the results."""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, impl: str, weights_path: str, out_path: str) -> None:
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    target = CpuTarget()
    target.init_process_group(rank, world, ep=world, port=port)
    try:
        from .parity import ep_results

        res = ep_results(impl, torch.load(weights_path), world, rank, torch.device("cpu"))
        if rank == 0:
            torch.save(res, out_path)
    finally:
        target.destroy_process_group()
