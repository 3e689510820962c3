"""Worker of the multi-GPU parity tests: one NCCL rank of a tensor- or context-parallel run on its own GPU.

The same computations as the CPU (gloo) workers of ``tests/impl_miles`` and ``tests/thd_impl``, on CUDA:

* ``tp``: the miles model at tensor parallel ``world`` scores two batches and takes one Adam step
  (``tests.impl_miles._helpers.miles_step``: loss with MTP, TP-gathered official-named gradients, loss after);
* ``cp``: a packed THD stream split contiguously over ``world`` context-parallel ranks: per-token
  log-probs (all-gathered), this rank's loss share, gradients summed over the CP group (megatron: with its
  indexer KL loss).

Rank 0 saves the results (on the CPU) for the parent to compare with its single-GPU run."""

from __future__ import annotations

import torch


def _setup(rank: int, world: int, port: int, *, tp: int = 1, cp: int = 1, ep: int = 1) -> torch.device:
    from backends.nvidia.target import NvidiaTarget

    NvidiaTarget().init_process_group(rank, world, tp=tp, cp=cp, ep=ep, port=port)
    return torch.device("cuda", torch.cuda.current_device())


def _teardown() -> None:
    from backends.nvidia.target import NvidiaTarget

    NvidiaTarget().destroy_process_group()


def to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    return tree


def tensor_parallel(rank: int, world: int, port: int, weights_path: str, out_path: str) -> None:
    dev = _setup(rank, world, port, tp=world)
    try:
        from .parity import tp_results

        res = tp_results(torch.load(weights_path), world, dev)
        if rank == 0:
            torch.save(to_cpu(res), out_path)
    finally:
        _teardown()


def context_parallel(rank: int, world: int, port: int, impl: str, weights_path: str, out_path: str) -> None:
    dev = _setup(rank, world, port, cp=world)
    try:
        from .parity import cp_results

        res = cp_results(impl, torch.load(weights_path), world, rank, dev)
        if rank == 0:
            torch.save(to_cpu(res), out_path)
    finally:
        _teardown()


def expert_parallel(rank: int, world: int, port: int, impl: str, weights_path: str, out_path: str) -> None:
    dev = _setup(rank, world, port, ep=world)
    try:
        from tests.expert_parallel.parity import ep_results

        res = ep_results(impl, torch.load(weights_path), world, rank, dev, hardware="nvidia")
        if rank == 0:
            torch.save(to_cpu(res), out_path)
    finally:
        _teardown()
