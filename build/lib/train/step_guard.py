"""Stop a training run at the first non-finite loss, gradient or weight.

Why: without this, a diverged run (an infinite learning rate, exploding
weights, a NaN in the data path) keeps "training": every later step is NaN,
checkpoints and the final HF export are written full of NaN and the process
exits 0. The trainer calls these checks every step:

* :func:`check_gradients` after the gradients are summed and before the
  optimizer step (a non-finite gradient norm names the first bad tensor);
* :func:`check_parameters` after the optimizer step (weights blown up by the
  update itself, e.g. ``lr=inf``);
* :func:`check_loss` on the step's metrics row.

The trainer then raises :class:`TrainingDiverged` (a user-facing error: the
launcher prints one line and exits 1) naming the step, the tensor and the
fix. The failing step is not checkpointed, so the last good checkpoint stays
the latest one, and nothing is exported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from core.finite import NonFiniteError, check_finite, check_finite_number

__all__ = ["TrainingDiverged", "check_gradients", "check_parameters", "check_loss", "diverged"]


class TrainingDiverged(NonFiniteError):
    """A training step produced NaN/inf; the message names the step, the tensor and the fix."""


def check_gradients(model, grad_norm: float) -> None:
    if math.isfinite(grad_norm):
        return
    grads = ((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)
    check_finite(grads, where="gradient")
    check_finite_number("the gradient norm", grad_norm, where="gradient")


def check_parameters(model) -> None:
    check_finite(((n, p) for n, p in model.named_parameters()), where="weights after the optimizer step")


def check_loss(row: dict) -> None:
    for key in ("loss", "mtp_loss", "indexer_loss", "kl_loss"):
        if row.get(key) is not None:
            check_finite_number(f"the {key.replace('_', ' ')}", row[key], where="loss")


def diverged(step: int, exc: NonFiniteError, run_dir: Path, last_good: Optional[int], lr: float) -> TrainingDiverged:
    """The error the run stops with: what went non-finite at which step, and what to do."""
    keep = (f"the last good checkpoint (step {last_good}) is kept in {Path(run_dir) / 'checkpoints'}"
            if last_good else "no checkpoint was written")
    return TrainingDiverged(f"training diverged at step {step}: {exc}. Fix: lower --lr (now {lr:g}) or check "
                            f"the data and the starting checkpoint; {keep}")
