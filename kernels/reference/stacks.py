"""Equal-shaped tensors that already lie one after another in memory, seen as one stacked tensor without a copy.

Why: a grouped GEMM (``torch._grouped_mm``) reads a MoE layer's experts as one ``[E, out, in]`` tensor, while the
weight contract and megatron-core keep one parameter per expert (``linear_fc1.weight{e}``). ``torch.stack`` over
the experts copies every expert weight on every forward (and keeps the copy for the backward); at Flash size that
is most of the model's bytes. When the experts are views of one buffer at a constant distance - the trainer's
expert bank allocates them that way, megatron-core's DDP lays out a bank's parameters one after another, and a
rollout engine that shares the trainer's weights sees the same memory - the stack is an ``as_strided`` view of
that buffer instead. :func:`stacked_view` finds it or says there is none (the caller then copies, as before).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["stacked_view"]


def stacked_view(tensors: Sequence[torch.Tensor], *, step: Optional[int] = None) -> Optional[torch.Tensor]:
    """``[n, *shape]`` whose ``i``-th entry IS ``tensors[i]`` (same memory), or None when the tensors are not
    evenly spaced over one storage. Every tensor must be contiguous with the same shape, dtype and device.
    ``step``: the distance in elements between consecutive tensors (default: their size, i.e. packed); a
    larger one skips what lies between (the up half between two experts' gate halves).

    Cheap enough for every forward (a MoE layer's banks are read per step): one address read per tensor; the
    view must fit in the FIRST tensor's storage, so tensors that merely sit next to each other in separate
    allocations are refused."""
    if not tensors:
        return None
    first = tensors[0]
    size, shape, dtype = first.numel(), first.shape, first.dtype
    step = size if step is None else int(step)
    if step < size or not first.is_contiguous():
        return None
    stride_bytes = step * first.element_size()
    base_ptr = first.data_ptr()
    for i, t in enumerate(tensors):
        if t.data_ptr() != base_ptr + i * stride_bytes or t.shape != shape or t.dtype != dtype:
            return None
    n = len(tensors)
    offset = first.storage_offset()
    if (offset + (n - 1) * step + size) * first.element_size() > first.untyped_storage().nbytes():
        return None
    if not all(t.is_contiguous() for t in tensors):
        return None
    return first.as_strided((n, *shape), (step, *first.stride()), offset)
