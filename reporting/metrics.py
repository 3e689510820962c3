"""Metrics: ``RUN_DIR/metrics.jsonl`` (one object per step), the run's trackers (:mod:`reporting.trackers`:
TensorBoard events in ``RUN_DIR/tb`` by default, wandb, MLflow), console.

Every line has at least :data:`REQUIRED_KEYS`. Values that do not apply to a mode are ``null`` (SFT has
no reward or rollout). Time per phase is in seconds: ``time_rollout``, ``time_logprobs``, ``time_train``,
``time_update_weights`` (and ``time_step``). GRPO rows also hold ``rollout_policy_lag`` (the step minus the
weights version its samples came from: 1 with ``async_rollout`` but at a run's first step), ``time_rollout_wait``,
``at_train_end`` and, with ``async_rollout``, ``at_next_rollout_issued`` (seconds from the step's start); with the
built-in cached engine, its generate call by phase: ``time_rollout_setup``, ``time_rollout_prefill``,
``time_rollout_decode`` (device time on a GPU), ``rollout_decode_steps``, ``rollout_decode_rows`` and
``rollout_decode_kv_bytes`` (the cache bytes the decode steps read); and
``zero_variance_group_frac``, the fraction of prompt groups whose rewards were all equal and so gave no gradient
(``train.losses``). On
resume, :func:`truncate_after` drops the lines of steps after the checkpoint (they are recomputed) and the
TensorBoard writer purges events past that step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, List

from core.atomic import write_text_atomically

from reporting.trackers import DEFAULT as DEFAULT_TRACKERS, TB_DIR

METRICS_FILE = "metrics.jsonl"
REQUIRED_KEYS = ("step", "reward_mean", "train_rollout_logprob_abs_diff", "train_rollout_kl", "loss", "grad_norm",
                 "tokens_per_s", "time_rollout", "time_logprobs", "time_train", "time_update_weights")
TIMING_KEYS = ("tokens_per_s", "time_rollout", "time_logprobs", "time_train", "time_update_weights", "time_step",
               "weight_sync_seconds", "wall_time", "time_rollout_wait", "at_next_rollout_issued", "at_train_end",
               "time_rollout_setup", "time_rollout_prefill", "time_rollout_decode")


def read_metrics(run_dir) -> List[Dict]:
    p = Path(run_dir) / METRICS_FILE
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line after a crash
    return out


def truncate_after(run_dir, step: int) -> None:
    """Keep only the lines with ``step <= step`` (atomic rewrite)."""
    p = Path(run_dir) / METRICS_FILE
    if not p.exists():
        return
    keep = [r for r in read_metrics(run_dir) if int(r.get("step", 0)) <= step]
    write_text_atomically(p, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else v
    return v


class MetricsLogger:
    """Writes each step's row to ``metrics.jsonl`` (fsynced: the run's record) and then to the run's
    trackers (:mod:`reporting.trackers`: TensorBoard by default; a tracker that fails mid-run is dropped with
    one warning, the run and this file go on)."""

    def __init__(self, run_dir, *, start_step: int = 0, trackers=DEFAULT_TRACKERS, config=None,
                 run_name: str = ""):
        from reporting.trackers import open_trackers

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._trackers = open_trackers(trackers, self.run_dir, start_step=start_step, config=config or {},
                                       run_name=run_name or self.run_dir.name)
        self._f = open(self.path, "a")

    def log(self, row: Dict) -> None:
        from reporting.trackers import log_all, scalars

        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")
        row = {k: _clean(v) for k, v in row.items()}
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        log_all(self._trackers, int(row["step"]), scalars(row))

    def close(self) -> None:
        from reporting.trackers import close_all

        self._f.close()
        close_all(self._trackers)


def tensorboard_scalars(run_dir) -> Dict[str, List]:
    """Read back the TensorBoard scalars (tag -> [(step, value)]) - for tests and tools."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / TB_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
