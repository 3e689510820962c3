"""Claiming a run folder before a run writes into it: the steps range, ``--resume``'s checks, the lock.

Why: the trainer used to create the run folder and start writing with no look at who else was writing there
or whether ``--resume`` had anything to resume (docs/bad-inputs.md, "Run folders"). :func:`claimed_run_folder`
is the one gate a training run passes first:

1. ``steps`` within 1 .. :data:`orchestration.resume_checks.MAX_STEPS`;
2. with ``resume``: :func:`orchestration.resume_checks.check_resume` (folder, pointer, state, step counter), before
   anything is created;
3. the run folder's lock (:mod:`orchestration.run_lock`), taken by the process that writes the run's own files: a
   one-process run, the launcher of local ranks, the Ray driver, or rank 0 under torchrun / srun;
4. ``resume`` checked again under the lock (another run may have written meanwhile);
5. a start that fails before its first step removes the folder it created (:mod:`train.run_folder`), but
   never a folder another writer holds.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

from core.errors import UserInputError

from .resume_checks import MAX_STEPS, check_resume
from train.run_folder import cleanup_failed_start, has_progress
from .run_lock import hold_run_lock, release_run_lock

__all__ = ["claimed_run_folder", "check_steps"]


def check_steps(steps) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise UserInputError(f"--steps {steps} is out of range: allowed 1 .. {MAX_STEPS:,}. Fix: pass the number "
                             f"of optimizer steps to train")


def _writes_run_files() -> bool:
    """Whether this process writes the run folder's own files: not a rank other than 0 of torchrun / srun."""
    from .dist_env import launcher_env     # (orchestration.launch.launched_env reads it too)

    env = launcher_env()
    return env is None or int(env["RANK"]) == 0


@contextlib.contextmanager
def claimed_run_folder(run_dir, *, resume: bool, steps: int):
    """The block runs with ``run_dir`` checked and locked by this process (module docstring)."""
    check_steps(steps)
    if resume:
        resumed = check_resume(run_dir, steps)
        if resumed is None and _writes_run_files():
            print(f"--resume: {run_dir} has no checkpoint yet; the run starts again at step 0", file=sys.stderr)
    if not _writes_run_files():
        with cleanup_failed_start(run_dir):
            yield
        return
    run = Path(run_dir)
    created = not run.exists()
    hold_run_lock(run_dir)                   # refused: nothing was created or removed
    try:
        if resume:
            check_resume(run_dir, steps)
        yield
    except BaseException:
        if created and run.is_dir() and not has_progress(run):
            shutil.rmtree(run, ignore_errors=True)
        raise
    finally:
        release_run_lock(run_dir)
