"""How many Triton kernels a step compiled: a slow step that compiled kernels says so (metric ``triton_compiles``).

Why: Triton compiles a kernel once per specialization of its arguments in a process (the constexprs, an integer's
divisibility by 16 or its being 1, a pointer's alignment), so a shape first seen mid-run compiles inside a timed
step. On one H200 the Flash-shaped GRPO run at 128 new tokens took 918 ms for most steps and 1,374 and 2,771 ms
for two, in micro-batches of the same count (``per_step`` of
``bench/results/grpo-h200-flash-shaped-engine-ops-128.json``); compiles were the likely cause, unconfirmed. The
count per step confirms or rules them out.

Counted through ``triton.knobs.runtime.jit_cache_hook``, which Triton calls before it compiles a kernel the process
has not compiled with those specializations (loading it from Triton's on-disk cache counts too: it is still read,
linked and loaded). Inductor's generated kernels do not pass through it. Any hook already installed keeps
running (it is called first and its answer returned). Without triton (or with the CPU target's stub of it)
nothing is counted and the metric is absent.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

from .run_log import log

__all__ = ["Compiles", "counted", "install"]

_active: List["Compiles"] = []        # the counters open now (nested steps count in each)
_installed_on: Optional[Any] = None    # the knobs object the hook is installed on


class Compiles:
    """The Triton kernels compiled while a :func:`counted` block ran (``enabled`` False: triton is absent)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.names: List[str] = []
        self.specializations: List[str] = []     # each compile's signature and constants (triton's ``repr``)

    @property
    def count(self) -> int:
        return len(self.names)

    def metrics(self) -> Dict[str, int]:
        """``{"triton_compiles": count}``, or nothing when triton is absent (the metric never claims a zero)."""
        return {"triton_compiles": self.count} if self.enabled else {}


def _counting(previous):
    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or "?"
        for c in _active:
            c.names.append(name)
            c.specializations.append(str(kwargs.get("repr") or name))
        return previous(*args, **kwargs) if previous is not None else None
    return hook


def _triton_knobs():
    from triton import knobs
    return knobs


def install(knobs: Any = None) -> bool:
    """Put the counting hook on ``knobs.runtime.jit_cache_hook`` (default: ``triton.knobs``), once; whether it is
    there (False: no triton)."""
    global _installed_on
    try:
        knobs = _triton_knobs() if knobs is None else knobs
        knobs.runtime.jit_cache_hook
    except (ImportError, AttributeError):     # no triton, or the CPU target's stub of it (backends.cpu)
        return False
    if _installed_on is not knobs:
        knobs.runtime.jit_cache_hook = _counting(knobs.runtime.jit_cache_hook)
        _installed_on = knobs
    return True


@contextlib.contextmanager
def counted(label: str = "", knobs: Any = None) -> Iterator[Compiles]:
    """The Triton kernels compiled in the block (:class:`Compiles`); logged (debug) with their names when any."""
    c = Compiles(install(knobs))
    _active.append(c)
    try:
        yield c
    finally:
        _active.remove(c)
        if c.count:
            log.debug(f"{label + ': ' if label else ''}{c.count} Triton kernel(s) compiled: "
                      f"{', '.join(sorted(set(c.names)))}; specializations: {'; '.join(c.specializations)}")
