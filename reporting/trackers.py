"""Experiment trackers (``--tracker``): where a run's per-step scalars go besides ``RUN_DIR/metrics.jsonl``.

Why: ``metrics.jsonl`` is the run's record (resume truncates and rewrites it, the plots read it), but
teams follow runs in a tracker. Rather than write clients of our own, each tracker is the maintained
library: TensorBoard (``torch.utils.tensorboard``, events in ``RUN_DIR/tb``), Weights & Biases (``wandb``)
and MLflow (``mlflow``; ``mlflow-skinny`` is enough). ``--tracker`` takes a comma list or is repeated;
``none`` turns them all off; the default, ``tensorboard``, is what runs did before the option.

Each tracker gets the same scalars per step (:func:`scalars`: ``train/KEY`` and ``time/KEY``, step =
the optimizer step) and, at start, the run's resolved configuration (wandb's ``config``, MLflow's params,
dotted keys such as ``train.lr``, ``run.impl``, ``model.hidden_size``). Only global rank 0 logs.

Settings are the libraries' own environment variables: ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE``
(``offline`` writes ``RUN_DIR/wandb`` only), ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` (MLflow's
own default store, ``sqlite:///mlflow.db``, needs the full ``mlflow`` package; a ``file:`` store needs
``MLFLOW_ALLOW_FILE_STORE=true``). The tracker run is named after the run folder, and its id is kept in
``RUN_DIR/trackers.json`` so that ``--resume`` continues the same wandb / MLflow run.

Failures, decided so that a tracker never costs a run: a tracker whose library is missing is refused
before any work starts (:func:`check_available`, one line naming the ``pip install``), and one that
cannot start its run stops the start (one line with the library's reason); a tracker that fails during
the run (server gone, disk full) is warned about once and dropped, training goes on, and metrics.jsonl
keeps every step.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from core.atomic import write_text_atomically
from core.errors import UserInputError

__all__ = ["TRACKERS", "DEFAULT", "STATE_FILE", "TB_DIR", "selected", "check_available", "scalars",
           "flatten_params", "open_trackers", "log_all", "close_all", "Tracker"]

TRACKERS = ("tensorboard", "wandb", "mlflow", "none")
DEFAULT = ("tensorboard",)
STATE_FILE = "trackers.json"
TB_DIR = "tb"
# tracker -> (module to import, the pip requirement that provides it)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}
log = logging.getLogger("dsv4")


def selected(names: Sequence[str]) -> Tuple[str, ...]:
    """The trackers to open: ``names`` (a TrainConfig's ``tracker``, already validated) without ``none``."""
    return tuple(n for n in names if n != "none")


def check_available(names: Sequence[str]) -> None:
    """Refuse, in one line naming the fix, a tracker whose library is not installed."""
    for name in selected(names):
        module, requirement = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise UserInputError(f"--tracker {name}: the {module} package is not installed. "
                                 f"Fix: pip install {requirement} (or leave {name} out of --tracker)")


def scalars(row: Mapping[str, Any]) -> Dict[str, float]:
    """A metrics row's numbers under the trackers' names: ``time/KEY`` for timings, ``train/KEY`` otherwise
    (``step`` is the step itself; None, booleans and text are not scalars)."""
    out = {}
    for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[("time/" if k.startswith("time_") else "train/") + k] = float(v)
    return out


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested settings as dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``), lists as text."""
    out: Dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_params(v, key + "."))
        else:
            out[key] = json.dumps(list(v)) if isinstance(v, (list, tuple)) else v
    return out


class Tracker:
    """One tracker's run: ``log(step, scalars)`` every step, ``close()`` at the end. ``run_id`` (or None)
    is kept in ``RUN_DIR/trackers.json`` so a resumed run continues it."""

    name = ""
    run_id: Optional[str] = None

    def log(self, step: int, values: Dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in ``RUN_DIR/tb``; on resume the events past the checkpoint's step are purged."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, *, start_step: int, **_):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(run_dir / TB_DIR), purge_step=start_step + 1 if start_step else None)

    def log(self, step, values):
        for tag, v in values.items():
            self._w.add_scalar(tag, v, step)
        self._w.flush()

    def close(self):
        self._w.close()


class WandbTracker(Tracker):
    """A wandb run (``WANDB_PROJECT``, ``WANDB_MODE``, ...), its files under ``RUN_DIR/wandb``."""

    name = "wandb"

    def __init__(self, run_dir: Path, *, params, run_name, resume_id, config, **_):
        import wandb

        self._run = wandb.init(dir=str(run_dir), name=run_name, config=config, id=resume_id,
                               resume="allow" if resume_id else None)
        self.run_id = self._run.id

    def log(self, step, values):
        self._run.log(values, step=step)

    def close(self):
        self._run.finish()


class MlflowTracker(Tracker):
    """An MLflow run (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``), the configuration as params."""

    name = "mlflow"

    def __init__(self, run_dir: Path, *, params, run_name, resume_id, **_):
        import mlflow

        self._mlflow = mlflow
        run = mlflow.start_run(run_id=resume_id, run_name=None if resume_id else run_name)
        self.run_id = run.info.run_id
        if resume_id is None:          # params are logged once: MLflow refuses to change one
            mlflow.log_params(params, run_id=self.run_id)

    def log(self, step, values):
        self._mlflow.log_metrics(values, step=step, run_id=self.run_id)

    def close(self):
        self._mlflow.end_run()


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def open_trackers(names: Sequence[str], run_dir, *, start_step: int, config: Mapping[str, Any],
                  run_name: str) -> List[Tracker]:
    """Start the selected trackers' runs (``config``: the resolved configuration, nested). A resumed run
    (``start_step > 0``) continues the tracker runs named in ``RUN_DIR/trackers.json``. A tracker that
    cannot start is a UserInputError (the ones already started are closed)."""
    run_dir = Path(run_dir)
    check_available(names)
    state_path = run_dir / STATE_FILE
    saved = json.loads(state_path.read_text()) if start_step and state_path.is_file() else {}
    params = flatten_params(config)
    opened: List[Tracker] = []
    for name in selected(names):
        try:
            opened.append(_CLASSES[name](run_dir, start_step=start_step, params=params, run_name=run_name,
                                         resume_id=saved.get(name), config=dict(config)))
        except Exception as exc:
            for t in opened:
                t.close()
            raise UserInputError(f"--tracker {name} could not start its run ({_first_line(exc)}); fix its "
                                 f"settings (docs/training.md#trackers) or leave {name} out of --tracker") from exc
    ids = {t.name: t.run_id for t in opened if t.run_id is not None}
    if ids:
        write_text_atomically(state_path, json.dumps({**saved, **ids}, indent=2, sort_keys=True) + "\n")
    return opened


def log_all(trackers: List[Tracker], step: int, values: Dict[str, float]) -> None:
    """Log ``values`` to every tracker; one that fails is warned about once and removed from ``trackers``
    (the run goes on; metrics.jsonl has the step)."""
    for t in list(trackers):
        try:
            t.log(step, values)
        except Exception as exc:
            trackers.remove(t)
            log.warning(f"--tracker {t.name} failed at step {step} ({_first_line(exc)}); it is dropped for the "
                        f"rest of the run, training goes on and metrics.jsonl keeps every step")
            try:
                t.close()
            except Exception:   # already warned about: this tracker's run is broken
                pass


def _close_quietly(t: Tracker) -> None:
    try:
        t.close()
    except Exception as exc:
        log.warning(f"--tracker {t.name} failed to close ({_first_line(exc)})")


def close_all(trackers: List[Tracker]) -> None:
    """Close every tracker; a failure is a warning (the run's own files are complete)."""
    for t in trackers:
        _close_quietly(t)
    trackers.clear()
