"""Which lines of the engine's code launch a decode step's kernels: a profile's kernels grouped by call site.

Why: a step's profile by kernel name (``bench.rollout --profile-steps``) says that 18 copies, 14 index writes
and 20 norms ran, not which code asked for them; the Flash-shaped eager step runs about 390 kernels, and cutting
them needs their call sites. With ``with_stack=True`` ``torch.profiler`` records the Python frames around every
operator, and on CUDA it hands each kernel to the operator that launched it (``FunctionEvent.kernels``); here
each operator is walked up to the innermost frame of the repository's model and engine code
(:data:`CALL_SITES`: ``kernels/reference/``, ``rollout/``, ``engine/``; else the innermost frame of the
repository), and the kernels (CUDA) or the top-level operators (CPU) are counted and timed per function
(``file:line function``, the line its definition starts on: the profiler records frames by function). Under
CUDA graphs the replay launches the kernels without the code that recorded them, so ``bench.rollout
--profile-sources`` runs with ``--cuda-graphs off`` (the same kernels, launched one by one).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterable, Tuple

REPO = Path(__file__).resolve().parent.parent
CALL_SITES = ("kernels/reference/", "rollout/", "engine/")
_FRAME = re.compile(r"^(?P<path>.+\.py)\((?P<line>\d+)\): (?P<func>.+)$")


def is_python_frame(name: str) -> bool:
    """Whether a profiler event ``name`` is a Python frame (``path(line): function``, a built-in method's call)
    rather than an operator: ``with_stack`` records both."""
    return bool(_FRAME.match(name)) or name.startswith("<built-in")


def _repo_path(path: str):
    """``path`` relative to the repository, or None (torch, the standard library, the bench itself)."""
    p = Path(path)
    try:
        rel = (p if p.is_absolute() else (REPO / p)).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None
    return None if rel.startswith("bench/") or not (REPO / rel).is_file() else rel


def call_site(event) -> str:
    """``file:line function`` (the line of its definition) of the innermost frame of :data:`CALL_SITES` code
    above ``event`` (its ``cpu_parent`` chain), else of the innermost repository frame, else ``(outside the
    repository)``."""
    first = None
    e = event
    while e is not None:
        m = _FRAME.match(e.name)
        if m:
            rel = _repo_path(m["path"])
            if rel is not None:
                site = f"{rel}:{m['line']} {m['func']}"
                if rel.startswith(CALL_SITES):
                    return site
                first = first or site
        e = e.cpu_parent
    return first or "(outside the repository)"


def by_call_site(events: Iterable, cuda: bool) -> Dict[str, Tuple[int, float]]:
    """``{call site: (count, us)}``: on CUDA the kernels each operator launched (count, device time); on the
    CPU the top-level operators (an ``aten::`` operator under no other, count and CPU time)."""
    out: Dict[str, Tuple[int, float]] = {}
    for e in events:
        if cuda:
            n, us = len(e.kernels), sum(k.duration for k in e.kernels)
        else:
            parent = e.cpu_parent
            top = e.name.startswith("aten::") and not (parent is not None and parent.name.startswith("aten::"))
            n, us = (1, e.cpu_time_total) if top else (0, 0.0)
        if n:
            site = call_site(e)
            c, t = out.get(site, (0, 0.0))
            out[site] = (c + n, t + us)
    return out


def per_step(base: Dict[str, Tuple[int, float]], full: Dict[str, Tuple[int, float]], steps: int,
             top: int = 100) -> list:
    """The call sites of ``steps`` decode steps: ``full`` (a call with ``1 + steps`` new tokens) less ``base``
    (one new token), over ``steps``, the ``top`` costliest: ``[{site, calls, us}]`` per step. A step's time at
    a site is a difference of two timed calls, and where the second ran slower (a loaded CPU) it is clamped at
    0, so the cut keeps enough sites that every one the step calls stays listed: a step of the engine has
    about 45."""
    rows = []
    for site, (count, us) in full.items():
        c0, t0 = base.get(site, (0, 0.0))
        if count > c0:
            rows.append(dict(site=site, calls=round((count - c0) / steps, 2), us=round(max(us - t0, 0.0) / steps, 2)))
    return sorted(rows, key=lambda r: (-r["us"], -r["calls"]))[:top]
