"""Asynchronous rollout (``async_rollout=true``): the next step's batch is generated while this step trains.

Why: in the synchronous step (weight sync -> rollout -> log-probs -> train) the engine idles while the trainer
computes and the trainer idles while the engine generates. With this option, step ``k`` does

    wait for the batch of step k (issued during step k-1)   time_rollout_wait
    weight sync (version k: the weights after k-1 optimizer steps)
    issue the generate of step k+1 on those weights          (step 1 first generates its own batch)
    rewards, log-probs, train on the batch of step k         (the engine generates step k+1 meanwhile)

so step ``k`` trains on samples drawn from the weights synced at step ``k-1``: one step off-policy
(``rollout_policy_lag`` 1; 0 for the first step of a run or of a resumed run, which generates its own batch).
The importance ratio still uses the old log-probs the trainer recomputes with its current weights, so
``train_rollout_logprob_abs_diff`` / ``train_rollout_kl`` now measure the off-policy gap as well.

Safety: the engine is never updated while it generates. The trainer calls :meth:`RolloutPipeline.take` (which
waits for the call in flight) before each weight sync, and :meth:`RolloutPipeline.issue` refuses a second call
while one is in flight. Seeds are unchanged: a batch's prompts and sample seeds are those of its step, so step
``k``'s samples are exactly what a synchronous engine draws at step ``k`` from the same weights.

How a call runs in the background: an engine that offers ``generate_async`` (the Ray proxy,
:class:`orchestration.ray_engines.RayEngineProxy`: the actor call is already asynchronous, its ObjectRef resolved at the
next step) is asked through it; any other engine's ``generate`` runs in one worker thread of this process (an
in-process engine on the CPU, or a server engine whose ``generate`` is an HTTP call; the combination table's rule
``async-rollout`` refuses an in-process engine on a GPU under the local orchestrator).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger("dsv4")       # the run's logger (reporting.run_log sets its handlers)

__all__ = ["InFlight", "RolloutPipeline"]


@dataclass
class InFlight:
    """One generate call in flight: the step whose batch it draws, the weights version it draws from, when it was
    issued (``time.perf_counter``) and the handle whose ``result()`` returns the groups."""

    step: int
    version: int
    issued: float
    handle: Any


class RolloutPipeline:
    """The data-parallel leader's one generate call in flight (module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: Optional[InFlight] = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def issue(self, step: int, version: int, prompts, params, *, n: int, seed: int, first_prompt: int) -> InFlight:
        """Start generating the batch of ``step`` on the weights the engine holds (``version``)."""
        if self.pending is not None:
            raise RuntimeError(f"async rollout: the batch of step {self.pending.step} is still being generated; "
                               f"take it before issuing step {step}'s")
        kw = dict(n=n, seed=seed, first_prompt=first_prompt)
        submit = getattr(self.engine, "generate_async", None)
        if submit is not None:
            handle = submit(prompts, params, **kw)
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-rollout")
            handle = self._pool.submit(self.engine.generate, prompts, params, **kw)
        self.pending = InFlight(step, version, time.perf_counter(), handle)
        return self.pending

    def take(self, step: int):
        """``(groups, version, seconds waited)`` of the batch in flight for ``step``, or None when there is none (the
        first step of a run or of a resumed one). Must be called before the engine's next weight update."""
        got = self.pending
        if got is None:
            return None
        if got.step != step:
            raise RuntimeError(f"async rollout: the batch in flight is step {got.step}'s, step {step} asked for it")
        t0 = time.perf_counter()
        try:
            groups = got.handle.result()
        finally:
            self.pending = None
        return groups, got.version, time.perf_counter() - t0

    def close(self) -> None:
        """Wait for a call still in flight (a run that failed mid-step: the engine is shut down next, and must not
        be generating then) and stop the worker thread. The call's own error is logged, not raised: the run's is."""
        got, self.pending = self.pending, None
        if got is not None:
            try:
                got.handle.result()
            except Exception as exc:
                log.warning(f"async rollout: the batch of step {got.step}, in flight when the run stopped, failed "
                            f"too: {type(exc).__name__}: {exc}")
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
