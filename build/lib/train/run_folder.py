"""What a run folder may hold before, during and after a failed start.

Why: a run that failed before its first step (bad data, a bad option, a
missing reward answer) used to leave a run folder behind (``train_config.json``,
an empty ``metrics.jsonl``, TensorBoard files) and a plain rerun was then
refused with "already holds a run; pass --resume". And ``--resume`` with a
changed option said only that the configuration differs, not which option.

* :func:`has_progress`: a folder counts as holding a run only once a step was
  logged or a checkpoint written; anything less may be started over.
* :func:`cleanup_failed_start`: a folder this invocation created is removed
  again when the run fails before logging a step.
* :func:`config_differences`: the dotted keys that differ between the saved
  and the requested run description, for the ``--resume`` error.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, List

__all__ = ["has_progress", "cleanup_failed_start", "config_differences"]


def has_progress(run_dir) -> bool:
    from .checkpointing import latest_checkpoint
    from .metrics import read_metrics

    run = Path(run_dir)
    if not run.is_dir():
        return False
    try:
        if read_metrics(run):
            return True
    except Exception:  # an unreadable metrics file is progress we must not discard
        return True
    return latest_checkpoint(run) is not None


@contextlib.contextmanager
def cleanup_failed_start(run_dir):
    """Remove ``run_dir`` again if this block created it and fails before any progress."""
    run = Path(run_dir)
    created = not run.exists()
    try:
        yield
    except BaseException:
        if created and run.is_dir() and not has_progress(run):
            shutil.rmtree(run, ignore_errors=True)
        raise


def config_differences(saved: Any, now: Any, prefix: str = "") -> List[str]:
    """Dotted keys whose values differ (``train.lr: 0.001 -> 0.01``)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out: List[str] = []
        for k in sorted(set(saved) | set(now), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in saved:
                out.append(f"{key}: (absent) -> {now[k]!r}")
            elif k not in now:
                out.append(f"{key}: {saved[k]!r} -> (absent)")
            else:
                out.extend(config_differences(saved[k], now[k], key))
        return out
    return [] if saved == now else [f"{prefix}: {saved!r} -> {now!r}"]
