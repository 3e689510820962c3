"""Importing megatron-core safely (CPU shims first) and parallel-state accessors."""

from __future__ import annotations

import torch

__all__ = ["ensure_megatron", "ensure_parallel_state", "tp_world", "tp_rank", "tp_group", "ep_world", "ep_rank",
           "ep_group", "is_distributed"]


def ensure_megatron():
    """Import megatron.core; returns the module.

    The hardware target prepares the process first (on the CPU, `CpuTarget.setup()`
    applies megatron-core's shims). Nothing is patched here: a process that was
    not set up fails with the fix named instead of being patched silently.
    """
    try:
        import megatron.core
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        raise RuntimeError(
            "megatron-core cannot be imported: 'triton' is not importable. On a CPU run the cpu hardware "
            "target applies megatron-core's shims: call the hardware target's setup() (CpuTarget().setup()) "
            "before building a model."
        ) from exc
    return megatron.core


def ensure_parallel_state(tp: int, ep: int = 1) -> None:
    """megatron's model-parallel state must already exist with these tensor- and expert-parallel sizes."""
    ensure_megatron()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron model-parallel state is not initialized: call the hardware target's "
            f"init_process_group(rank, world_size, tp={tp}) before building a model"
        )
    have = ps.get_tensor_model_parallel_world_size()
    if have != tp:
        raise ValueError(f"the run asks for tensor-parallel size {tp} but megatron is initialized with {have}")
    have = ps.get_expert_model_parallel_world_size()
    if have != ep:
        raise ValueError(f"the run asks for expert-parallel size {ep} but megatron is initialized with {have}; "
                         f"call the hardware target's init_process_group(rank, world, ep={ep})")


def is_distributed() -> bool:
    ensure_megatron()
    from megatron.core import parallel_state as ps

    return torch.distributed.is_available() and torch.distributed.is_initialized() and ps.model_parallel_is_initialized()


def _parallel_state(query: str, default):
    """megatron's ``parallel_state.<query>()``, or ``default`` in a process without a process group."""
    if not is_distributed():
        return default
    from megatron.core import parallel_state as ps

    return getattr(ps, query)()


def tp_world() -> int:
    return _parallel_state("get_tensor_model_parallel_world_size", 1)


def tp_rank() -> int:
    return _parallel_state("get_tensor_model_parallel_rank", 0)


def tp_group():
    return _parallel_state("get_tensor_model_parallel_group", None)


def ep_world() -> int:
    """Expert-parallel size (megatron's expert-model-parallel group; 1 without a process group)."""
    return _parallel_state("get_expert_model_parallel_world_size", 1)


def ep_rank() -> int:
    return _parallel_state("get_expert_model_parallel_rank", 0)


def ep_group():
    return _parallel_state("get_expert_model_parallel_group", None)
