"""Ticket counters of the triton kernels whose programs split a reduction and let the last program to finish sum
the partials (``kernels/triton/mhc_decode.py``, ``kernels/triton/linear_group.py``'s ``SPLIT``).

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

__all__ = ["counters"]

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
