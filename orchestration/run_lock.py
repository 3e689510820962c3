"""A run folder belongs to one run at a time: an exclusive lock held for the writer's life.

Why: two ``dsv4 train`` on one ``--run-dir`` (fresh, or both ``--resume``) both ran: one crashed with an
unexpected CheckpointException, or both trained and ``metrics.jsonl`` lost steps, each pruning the other's
checkpoints. As git and the Hugging Face cache take a lock per repository or cache entry, a writer of a run
folder takes ``RUN_DIR/.dsv4-run.lock`` first:

* ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the open file, kept open for the process's life: the kernel drops the
  lock when the process ends, however it ends (``kill -9`` included), so a crashed run never blocks the next;
* the holder writes its pid, host and start time into the file, so a second writer is refused naming the
  holder (and how to find it);
* a lock file whose recorded holder is gone (same host, no such pid) while the lock is still taken means the
  lock went to a child of the holder (a forked rank that outlived it): the refusal names that too. On a file
  system where ``flock`` does not work across hosts (some NFS setups) the holder's host is named, so the user
  sees which machine runs it.

One holder per run: the process that writes the run folder's own files (global rank 0; the launcher process
of local ranks, and under torchrun rank 0). :func:`hold_run_lock` is idempotent within a process.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Dict, Optional

from core.errors import UserInputError
from core.stale_temps import pid_alive

__all__ = ["LOCK_FILE", "RunFolderBusy", "hold_run_lock", "release_run_lock", "read_holder"]

LOCK_FILE = ".dsv4-run.lock"
_HELD: Dict[str, int] = {}          # realpath of the run folder -> the open descriptor holding its lock


class RunFolderBusy(UserInputError):
    """Another process holds the run folder."""


def read_holder(run_dir) -> Optional[dict]:
    """What the lock file says about its holder (pid, host, started), or None."""
    try:
        with open(Path(run_dir) / LOCK_FILE, "rb") as f:
            d = json.loads(f.read(4096).decode("utf-8", "replace") or "null")
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _describe(holder: Optional[dict]) -> str:
    if not holder:
        return "another process (it has not written its pid yet)"
    pid, host = holder.get("pid"), holder.get("host")
    started = holder.get("started", "?")
    text = f"process {pid} on host {host} (started {started}"
    if host == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        text += "; that process is gone, so a process it started (a rank or server) still holds the lock"
    return text + ")"


def hold_run_lock(run_dir, *, what: str = "dsv4 train") -> Path:
    """Take the run folder's lock for this process's life, or raise :class:`RunFolderBusy` naming the holder.
    Creates ``run_dir`` when missing. Idempotent: a second call in the same process returns at once."""
    run = Path(run_dir)
    key = os.path.realpath(run)
    if key in _HELD:
        return run / LOCK_FILE
    run.mkdir(parents=True, exist_ok=True)
    path = run / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderBusy(f"{run} is in use by {_describe(read_holder(run))}: one run folder takes one run at "
                            f"a time. Fix: wait for that run to end (or stop it), or use another --run-dir") from None
    except OSError as exc:
        os.close(fd)
        raise RunFolderBusy(f"{run}: cannot lock {path} ({exc.strerror}); the file system does not support "
                            f"file locks. Fix: put the run folder on a local or lock-capable file system") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "started_unix": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record, sort_keys=True) + "\n").encode(), 0)
    _HELD[key] = fd
    return path


def release_run_lock(run_dir) -> None:
    """Give the lock back before the process ends (the run is over; a test runs several in one process)."""
    fd = _HELD.pop(os.path.realpath(Path(run_dir)), None)
    if fd is not None:
        os.close(fd)          # closing the last descriptor drops the flock


def held_by_this_process(run_dir) -> bool:
    return os.path.realpath(Path(run_dir)) in _HELD
