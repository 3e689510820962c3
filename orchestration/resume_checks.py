"""``--resume`` never restarts silently: the run folder, its ``latest`` pointer and its checkpoint's state are
checked before anything is built, loaded, written or pruned.

Why: ``--resume`` on a folder that did not exist, or on a user's folder that was not a run, started at step
0 and wrote run files among the user's files; with every ``state.json`` emptied it started over at step 0,
pruned the intact old checkpoints and rewrote ``metrics.jsonl``; a ``checkpoints/latest`` naming a folder
outside the run was followed, and pruning then deleted the run's own checkpoints; a checkpoint at step 999
with ``--steps 5`` printed 999/5 and trained nothing. As Megatron's ``latest_checkpointed_iteration.txt``
(one pointer, inside the run), the pointer here must name a ``step_NNNNNN`` folder of the run itself.

:func:`check_resume` raises :class:`ResumeError` (a user error: one line naming the file and the fix) when

* the folder is missing, not a folder, or not a dsv4 run (no ``train_config.json``);
* ``checkpoints/latest`` is not a plain ``step_NNNNNN`` name, or resolves outside ``RUN/checkpoints``;
* the checkpoint it names (or, without a pointer, any step folder) has a ``state.json`` that is missing,
  unreadable, not a dsv4 state or of another step;
* a file of the run (``train_config.json``, ``metrics.jsonl``, ``latest``) or of that checkpoint
  (``optim.json``, ``rng.safetensors``, the DCP data files ...) is a FIFO, a device or a link to nothing:
  the trainer's readers would block or read forever;
* the checkpoint's step is past ``--steps``.

A run folder with a configuration but no checkpoint yet (stopped before its first save) resumes at step 0,
and says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

from core.errors import UserInputError

__all__ = ["ResumeError", "check_resume", "check_run_files", "MAX_STEPS"]

#: far beyond any run (a step a second for 30 years); larger values are a typo
MAX_STEPS = 10 ** 9


class ResumeError(UserInputError):
    """The run folder given to ``--resume`` cannot be continued as it is."""


def _state_of(folder: Path) -> Tuple[Optional[int], str]:
    """``(step, "")`` of a complete checkpoint folder, or ``(None, why)``."""
    from core.bounded_io import BoundedReadError, load_json

    path = folder / "state.json"
    if not os.path.lexists(path):
        return None, f"{path} is missing"
    try:
        st = load_json(path, what="checkpoint state")
    except BoundedReadError as exc:
        return None, exc.problem
    except (OSError, ValueError) as exc:
        return None, f"{path} is unreadable ({type(exc).__name__}: {exc})"
    step = st.get("step") if isinstance(st, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or st.get("complete") is not True:
        return None, f"{path} is not a dsv4 checkpoint state (an object with a step and \"complete\": true)"
    if folder.name != f"step_{step:06d}":
        return None, f"{path} records step {step}, but its folder is {folder.name}"
    return step, ""


def _step_folders(root: Path) -> List[Path]:
    from train.checkpointing import _STEP_RE

    return sorted(p for p in root.iterdir() if _STEP_RE.match(p.name)) if root.is_dir() else []


def _pointer(root: Path) -> Optional[Path]:
    """The folder ``root/latest`` names, checked to be a step folder of this run; None without a pointer."""
    from core.bounded_io import BoundedReadError, read_text
    from core.path_safety import PathSafetyError, inside_folder

    from train.checkpointing import _STEP_RE, LATEST

    path = root / LATEST
    if not os.path.lexists(path):
        return None
    fix = (f"Fix: write the name of one of the run's own checkpoint folders (step_NNNNNN in {root}) into it, "
           f"or start a new --run-dir")
    try:
        name = read_text(path, limit=4096, what="checkpoint pointer").strip()
    except BoundedReadError as exc:
        raise ResumeError(f"{exc.problem}. {fix}") from None
    except OSError as exc:
        raise ResumeError(f"{path}: cannot read the checkpoint pointer ({exc}). {fix}") from None
    if not _STEP_RE.match(name):
        raise ResumeError(f"{path} names {name[:80]!r}, not a step_NNNNNN folder of this run. {fix}")
    try:
        folder = inside_folder(root, name, what="the checkpoint that latest names")
    except PathSafetyError:
        raise ResumeError(f"{path} names {name}, which resolves to {os.path.realpath(root / name)}, outside the "
                          f"run's checkpoints folder {root}; resuming from it would mix runs and prune this "
                          f"run's own checkpoints. {fix}") from None
    if not folder.is_dir():
        raise ResumeError(f"{path} names {name}, which is not a folder in {root}. {fix}")
    return folder


def check_run_files(run: Path, *, fix: str, prefix: str = "") -> None:
    """Refuse a run's own small files (``train_config.json``, ``metrics.jsonl``, ``checkpoints/latest``) when
    they are there but not regular files: the trainer and ``dsv4 export`` read them whole."""
    from core.bounded_io import BoundedReadError, SMALL_JSON_LIMIT, check_regular

    from train.checkpointing import CKPT_DIR, LATEST
    from train.export import CONFIG_FILE

    for path in (run / CONFIG_FILE, run / "metrics.jsonl", run / CKPT_DIR / LATEST):
        if not os.path.lexists(path):
            continue
        try:
            check_regular(path, what="run file")
            if path.name.endswith(".json") and os.stat(path).st_size > SMALL_JSON_LIMIT:
                raise ResumeError(f"{prefix}run file {path} holds {os.stat(path).st_size:,} bytes, over the limit "
                                  f"of {SMALL_JSON_LIMIT:,} bytes for such a file. {fix}")
        except BoundedReadError as exc:
            raise ResumeError(f"{prefix}{exc.problem}. {fix}") from None
        except FileNotFoundError:
            raise ResumeError(f"{prefix}run file {path} is a link to nothing. {fix}") from None


def _check_checkpoint_files(folder: Path, fix: str) -> None:
    """Every file of the checkpoint to resume from is a regular file (optim.json, rng.safetensors, the DCP data
    files ...): the trainer's readers open them blocking and unbounded."""
    from core.bounded_io import BoundedReadError, check_tree

    try:
        check_tree(folder, what="checkpoint file")
    except BoundedReadError as exc:
        raise ResumeError(f"--resume: {exc.problem}; the run's latest checkpoint cannot be read. {fix}") from None


def check_resume(run_dir, steps: int) -> Optional[int]:
    """Check that ``run_dir`` can be resumed (module docstring); the step it resumes from (None: no checkpoint
    yet). Reads only small files, bounded."""
    from train.checkpointing import CKPT_DIR
    from train.export import CONFIG_FILE

    run = Path(run_dir)
    if not run.exists():
        raise ResumeError(f"--resume: the run folder {run} does not exist. Fix: check --run-dir, or leave out "
                          f"--resume to start a new run there")
    if not run.is_dir():
        raise ResumeError(f"--resume: {run} is not a folder. Fix: pass the --run-dir of a dsv4 train run")
    check_run_files(run, fix="Fix: restore the run's own file, or start a new --run-dir", prefix="--resume: ")
    if not (run / CONFIG_FILE).is_file():
        raise ResumeError(f"--resume: {run} is not a dsv4 run folder (no {CONFIG_FILE}); resuming would write run "
                          f"files among its files. Fix: pass the --run-dir of a dsv4 train run, or leave out "
                          f"--resume and use a new --run-dir")
    root = run / CKPT_DIR
    if os.path.islink(root) or (root.exists() and not root.is_dir()):
        raise ResumeError(f"--resume: {root} is not a folder of the run (a link or a file). Fix: restore the "
                          f"run's checkpoints folder, or start a new --run-dir")
    pointed = _pointer(root) if root.is_dir() else None
    fix = f"Fix: point {root / 'latest'} at an intact checkpoint of the run, or start a new --run-dir"
    if pointed is not None:
        step, why = _state_of(pointed)
        if step is None:
            raise ResumeError(f"--resume: {why}; the run's latest checkpoint cannot be read. {fix}")
    else:
        found = [(p, *_state_of(p)) for p in _step_folders(root)]
        bad = [why for _p, s, why in found if s is None]
        if bad:
            raise ResumeError(f"--resume: {bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; "
                              f"without a readable latest checkpoint the run would start over. {fix}")
        step, pointed = max(((s, p) for p, s, _w in found), default=(None, None))
    if pointed is not None:
        _check_checkpoint_files(pointed, fix)
    if step is not None and step > steps:
        raise ResumeError(f"--resume: {run} is at step {step}, past --steps {steps}; nothing would be trained. Fix: "
                          f"pass --steps {step + 1} or more to train further, or export the run (dsv4 export "
                          f"--run-dir {run})")
    return step
