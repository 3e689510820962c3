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
* :func:`open_run`: where a run starts: rank 0 writes the run's description
  or, on ``--resume``, checks it and loads the last complete checkpoint (every
  rank its share), and the KL reference policy is written or read back.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, List

__all__ = ["has_progress", "cleanup_failed_start", "config_differences", "resumes", "open_run", "REF_MODEL_FILE"]


def has_progress(run_dir) -> bool:
    from .checkpointing import latest_checkpoint
    from reporting.metrics import read_metrics

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


# -- resume: the run folder decides where a run starts ---------------------------------------------------------
REF_MODEL_FILE = "ref_model.safetensors"     # the KL reference policy's weights (safetensors: never unpickled)
RESUME_MAY_CHANGE = ("tracker", "profile_steps", "rendezvous_timeout_s")   # may change on resume: nothing trained


def resumes(run_dir, resume: bool) -> bool:
    """Whether a run continues from a checkpoint in ``run_dir`` (``--resume`` and one exists), decided before
    the model is built so that it is built without random init: :func:`train.checkpointing.load_checkpoint`
    then writes every weight (and checks it did). Every rank decides alike (the run folder is shared)."""
    from .checkpointing import latest_checkpoint

    return bool(resume) and latest_checkpoint(run_dir) is not None


def open_run(run, resume: bool) -> int:
    """The step ``run`` (a :class:`train.trainer._Run` with its models and optimizer built) starts after: rank 0
    writes the run's description or, on ``--resume``, checks it and loads the last complete checkpoint; every
    other rank loads the same checkpoint (its share). The KL reference policy is written or read back too."""
    start = _agree_on_start(run, resume)
    if run.resume_fills and start == 0:
        # built without init for a checkpoint that was then not loaded (the run folder changed meanwhile)
        from core.finite import check_written

        check_written(run.model, source=f"no checkpoint of {run.run_dir}")
    _keep_reference_policy(run, start)
    return start


def _agree_on_start(run, resume: bool) -> int:
    from .checkpointing import latest_checkpoint, load_checkpoint

    dist = run.dist
    if dist.world == 1:
        return _write_or_check_main(run, resume)
    if dist.is_main:
        try:
            start = _write_or_check_main(run, resume)
            found = latest_checkpoint(run.run_dir) if start else None
            msg = (start, None if found is None else str(found[1]), None)
        except Exception as exc:
            dist.broadcast_world((0, None, f"{type(exc).__name__}: {exc}"))
            raise
        dist.broadcast_world(msg)
        return start
    step, folder, err = dist.broadcast_world(None)
    if err is not None:
        raise RuntimeError(f"rank 0 failed: {err}")
    if folder is not None:
        load_checkpoint(folder, run.model, run.optim)
    return int(step)


def _compared(desc: dict, keys, defaults: dict) -> dict:
    """The parts of a run description that ``--resume`` must find unchanged. A training option the run's saved
    config lacks (added to TrainConfig since the run started) counts as its default (``defaults``), which keeps
    what runs did."""
    out = {k: desc.get(k) for k in keys}
    if isinstance(out.get("train"), dict):
        train = {**defaults, **out["train"]}
        out["train"] = {k: v for k, v in train.items() if k not in RESUME_MAY_CHANGE}
    return out


def _write_or_check_main(run, resume: bool) -> int:
    """Global rank 0: the start step, after writing ``train_config.json`` (a new run) or checking it against the
    requested run and loading the last complete checkpoint (``--resume``)."""
    import json

    from core.atomic import write_text_atomically
    from core.errors import UserInputError

    from .checkpointing import latest_checkpoint, load_checkpoint
    from .export import CONFIG_FILE
    from reporting.metrics import truncate_after

    p = run.run_dir / CONFIG_FILE
    desc = run.description()
    found = latest_checkpoint(run.run_dir)
    start = 0
    if resume and found is not None:
        saved = json.loads(p.read_text()) if p.is_file() else None
        keys = ("mode", "train", "model_config")
        defaults = type(run.cfg)().to_json()           # TrainConfig's
        diff = [] if saved is None else config_differences(_compared(saved, keys, defaults),
                                                           _compared(desc, keys, defaults))
        if diff:
            raise UserInputError(f"{run.run_dir}: --resume with options that differ from the run's "
                                 f"({'; '.join(diff[:6])}{'; ...' if len(diff) > 6 else ''}); resume with "
                                 f"the original options (see {p}) or start a new --run-dir")
        start = int(load_checkpoint(found[1], run.model, run.optim)["step"])
    else:
        if not resume and has_progress(run.run_dir):
            raise UserInputError(f"{run.run_dir} already holds a run; pass --resume to continue it or use "
                                 f"a new --run-dir")
        write_text_atomically(p, json.dumps(desc, indent=2, sort_keys=True) + "\n")
    truncate_after(run.run_dir, start)
    return start


def _keep_reference_policy(run, start: int) -> None:
    """The KL reference policy is the run's starting weights: written (full tensors) when the run starts,
    read back on resume (each rank keeps its share), so a resumed run keeps its reference whatever its
    layout or ``--model``."""
    from . import state_io
    from .model import full_view

    if run.ref_model is None:
        return
    path = run.run_dir / REF_MODEL_FILE
    if start > 0:
        from core.finite import check_written

        run.ref_model.load_native_state(state_io.load_tensors(path))
        check_written(run.ref_model, source=f"the run's reference policy {path}")   # built without init
        return
    view = full_view(run.ref_model, run.dist)
    if run.dist.is_main:
        state_io.save_tensors(path, dict(view.native_tensors()))
    run.dist.barrier()
