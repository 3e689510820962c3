"""Importing megatron-core safely (CPU shims first), and the check that a model's parallel sizes are this rank's
layout's (the layout itself: :mod:`engine.layout`)."""

from __future__ import annotations

from typing import Optional

__all__ = ["ensure_megatron", "ensure_parallel_state"]


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


def ensure_parallel_state(tp: int, ep: int = 1, cp: Optional[int] = None):
    """This rank's layout (``engine.layout``), which must exist with these tensor-, expert- and (when given)
    context-parallel sizes; returns it. A model is built after the hardware target's ``init_process_group``."""
    from .layout import current

    ensure_megatron()
    layout = current()
    if not layout.distributed:
        raise RuntimeError(
            "megatron model-parallel state is not initialized: call the hardware target's "
            f"init_process_group(rank, world_size, tp={tp}) before building a model"
        )
    if layout.tp != tp:
        raise ValueError(f"the run asks for tensor-parallel size {tp} but megatron is initialized with {layout.tp}")
    if layout.ep != ep:
        raise ValueError(f"the run asks for expert-parallel size {ep} but megatron is initialized with {layout.ep}; "
                         f"call the hardware target's init_process_group(rank, world, ep={ep})")
    if cp is not None and layout.cp != cp:
        raise ValueError(f"the run asks for context-parallel size {cp} but megatron is initialized with {layout.cp}; "
                         f"call the hardware target's init_process_group(rank, world, tp=..., cp={cp})")
    return layout
