"""Where a ``generate`` call's time goes, phase by phase, without waiting for the device between steps.

Why: a GRPO step's rollout time (``time_rollout``, ``time_rollout_wait``) holds the decode steps, the prefill
of the prompts, the slots' set-up (CUDA graph capture, the first call only) and the host's bookkeeping. The
decode step's share of the memory roofline, the goal of issue #32, needs the decode steps' time alone, measured
in the run itself rather than in a side benchmark. The engine's loop launches work ahead of the GPU, so a
wall clock read at a phase change would time the launches; :class:`PhaseClock` records a CUDA event at each
change instead and reads them once, at the end of the call (which waits for the device anyway). On the CPU the
work is synchronous and the wall clock is the time."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["PhaseClock", "timing_metrics"]


class PhaseClock:
    """``enter(phase)`` at each change of phase, ``seconds()`` once at the end: ``{phase: seconds}``, summed over
    the phase's spans. Entering the current phase again marks nothing (one mark per change, not per step)."""

    def __init__(self, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._marks: List[Tuple[Optional[str], object]] = []

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def enter(self, phase: Optional[str]) -> None:
        """From here on the work is ``phase``'s (None: no phase, the end)."""
        if self._marks and self._marks[-1][0] == phase:
            return
        self._marks.append((phase, self._now()))

    def seconds(self) -> Dict[str, float]:
        """Each phase's seconds from its marks to the next ones; ends the last phase now."""
        self.enter(None)
        if self._cuda:
            self._marks[-1][1].synchronize()
        out: Dict[str, float] = {}
        for (phase, a), (_, b) in zip(self._marks, self._marks[1:]):
            if phase is not None:
                dt = a.elapsed_time(b) / 1e3 if self._cuda else b - a
                out[phase] = out.get(phase, 0.0) + dt
        return out


def timing_metrics(engine) -> Dict[str, float]:
    """A GRPO step's metrics of the engine's last ``generate`` (the step's batch), for engines that can say (the
    built-in cached engine's ``generate_timing``, directly or through a Ray actor): ``time_rollout_setup`` /
    ``_prefill`` / ``_decode`` (seconds, device time on a GPU), ``rollout_decode_steps``,
    ``rollout_decode_rows`` and ``rollout_decode_kv_bytes``; empty otherwise."""
    timing = getattr(engine, "generate_timing", None)
    got = None if timing is None else timing()
    if not got:
        return {}
    out = {f"time_rollout_{k[:-2]}": v for k, v in got.items() if k.endswith("_s")}
    out.update({f"rollout_{k}": v for k, v in got.items() if not k.endswith("_s")})
    return out
