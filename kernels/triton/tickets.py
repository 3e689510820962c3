"""Ticket counters of the triton kernels whose programs split a reduction and let the last program to finish sum
the partials (``kernels/triton/mhc_decode.py``, ``kernels/triton/linear_group.py``'s and ``kernels/triton/experts.py``'s
``SPLIT``), and the kernels' side of that protocol (:func:`last_ticket`, :func:`release`).

A program writes its partial and takes a ticket (an atomic add on its counter); the one whose ticket completes
the count sums the partials in a fixed order and sets the counter back to 0, so every counter is 0 between
launches. The kernels run on one stream (a decode step), so launches never overlap and one buffer a device
serves them all.

The counters are made (or grown) outside any CUDA graph capture: made during one they would live in the graph's
pool and be zeroed by a captured memset. A grown buffer keeps the old one alive, since a captured graph still
counts on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["counters", "last_ticket", "release"]

_COUNTERS: dict = {}
_OUTGROWN: list = []


def counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, each 0 between launches."""
    key = (device.type, device.index)
    got = _COUNTERS.get(key)
    if got is None or got.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a triton kernel first needed {count} ticket counters inside a CUDA graph capture; "
                               f"call it once at that size before capturing (the engine's op probe does)")
        if got is not None:
            _OUTGROWN.append(got)
        got = _COUNTERS[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return got


@triton.jit
def last_ticket(TICKET, count):
    """Once this program's partial is written: take a ticket of the counter ``TICKET``; True in the program whose
    ticket completes ``count``, which then sees every partial (a barrier before the release, so every thread's
    stores are in it, and one after, before the partials are read)."""
    tl.debug_barrier()
    last = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu") == count - 1
    tl.debug_barrier()
    return last


@triton.jit
def release(TICKET):
    """The counter back to 0 for the next launch (the last program's, after its sum)."""
    tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")
