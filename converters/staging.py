"""Safe, resumable, multi-process "prepare" stages that write a directory.

:func:`run_stage` builds ``dest_dir`` exactly once, even when many processes
(on one host, or several hosts sharing a file system with working ``flock``)
prepare the same shared cache at the same time, and never leaves a
half-written result at ``dest_dir``:

1. **Fast path.** If ``dest_dir/.dsv4-complete.json`` (the *sentinel*) exists
   and records the same stage name and inputs, the stage is done: return.
2. **Lock.** Take an exclusive file lock keyed by the *normalized* destination
   (``os.path.realpath`` of ``dest_dir``, sha256-hashed into
   ``<lock_dir>/<hash>.lock``), so ``./cache/x``, ``cache/../cache/x`` and a
   symlink to it all serialize on one lock. The default lock dir is
   ``.dsv4-locks`` next to the resolved destination (so every process that can
   see the destination sees the lock); ``$DSV4_LOCK_DIR`` or ``lock_dir=``
   override it. The lock is ``flock``-based (``filelock``): the kernel drops it
   when its holder dies, ``kill -9`` included.
3. **Re-check** the sentinel under the lock (another process may have finished
   while we waited) -> return without building.
4. **Clean up** stale temporaries of earlier, killed runs
   (``.<dest>.stage-*`` / ``.<dest>.old-*`` next to the destination). Safe:
   only the lock holder ever creates them.
5. **Disk space.** ``shutil.disk_usage`` of the destination's file system must
   show at least ``required_bytes`` free, else :class:`InsufficientDiskSpace`
   (naming the bytes needed and available) before anything is written.
6. **Build** into a fresh temp dir next to the destination (same file system,
   so the final rename is atomic), write the sentinel last, fsync, then
   ``rename`` the temp dir onto ``dest_dir``.

Crash safety: a process killed at any point leaves ``dest_dir`` as it was (or,
after the final rename, complete); the next run cleans the temporaries and
builds again. Replacing an existing result (``overwrite=True``) is one atomic
``renameat2(RENAME_EXCHANGE)`` on Linux; where that is unavailable the old
directory is renamed aside (``.<dest>.old-*``) and the new one renamed in, so
a crash in between leaves *no* ``dest_dir`` (never a mixed one) and the next
run rebuilds.

An existing ``dest_dir`` with a sentinel of different inputs raises
:class:`StageConflict` unless ``overwrite=True``. One without a sentinel (not
made by a completed stage: possibly the user's own data) always raises, with
``overwrite=True`` too: ``--overwrite`` replaces only what dsv4 wrote. The
sentinel lists the files the stage wrote (``"files"``), and a folder holding
any other file is refused too (:mod:`core.overwrite`). A destination that is,
contains or sits inside an input (``input_paths``) is refused before anything. An
empty folder counts as free. Concurrent writers with ``overwrite=True``
build once: a result completed after a writer started counts as done for it
(``StageResult.built`` False, so exactly one process reports "wrote").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from filelock import FileLock, Timeout

from core.atomic import fsync_dir
from core.errors import UserInputError
from core.overwrite import SENTINEL, manifest, refuse_foreign

LOCK_DIR_ENV = "DSV4_LOCK_DIR"
DEFAULT_LOCK_DIR_NAME = ".dsv4-locks"

# Test hook: pause at a named point so crash tests can SIGKILL there.
# Value "<phase>:<marker file>"; phases: "before-sentinel", "before-rename",
# "after-exchange", "after-aside".
_PAUSE_ENV = "DSV4_STAGING_TEST_PAUSE"


class StageError(UserInputError, RuntimeError):
    """Base class of staging errors (the launcher prints them and exits 1)."""


class StageConflict(StageError):
    """The destination exists but is not this stage's completed result."""


class InsufficientDiskSpace(StageError):
    """Not enough free space for the stage's output."""

    def __init__(self, path, needed: int, available: int):
        super().__init__(f"not enough free disk space at {path}: {needed} bytes needed "
                         f"({needed / 2**30:.2f} GiB), {available} bytes available "
                         f"({available / 2**30:.2f} GiB)")
        self.path = str(path)
        self.needed = int(needed)
        self.available = int(available)


@dataclass(frozen=True)
class StageResult:
    path: Path
    built: bool          # False: an earlier (or concurrent) run had already produced it
    sentinel: dict


def normalize_dest(dest_dir) -> Path:
    """Absolute, symlink-resolved destination path (the lock key)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(dest_dir))))


def lock_path_for(dest_dir, lock_dir=None) -> Path:
    """``<lock_dir>/<sha256(normalized dest)[:32]>.lock``."""
    dest = normalize_dest(dest_dir)
    if lock_dir is None:
        lock_dir = os.environ.get(LOCK_DIR_ENV) or (dest.parent / DEFAULT_LOCK_DIR_NAME)
    key = hashlib.sha256(str(dest).encode("utf-8")).hexdigest()[:32]
    return Path(lock_dir) / f"{key}.lock"


def read_sentinel(dest_dir) -> Optional[dict]:
    """The sentinel of a completed stage at ``dest_dir``, or None."""
    p = Path(dest_dir) / SENTINEL
    try:
        d = json.loads(p.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) and d.get("complete") is True else None


def _canon(inputs: Optional[Mapping[str, Any]]) -> dict:
    # JSON round trip: what we compare is what we stored
    return json.loads(json.dumps(dict(inputs or {}), sort_keys=True, default=str))


def _matches(sentinel: Optional[dict], name: str, inputs: dict) -> bool:
    return sentinel is not None and sentinel.get("stage") == name and sentinel.get("inputs") == inputs


def _fsync_tree(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for f in filenames:
            fsync_dir(Path(dirpath) / f)
        fsync_dir(Path(dirpath))


def _maybe_pause(phase: str) -> None:
    spec = os.environ.get(_PAUSE_ENV)
    if not spec:
        return
    want, _, marker = spec.partition(":")
    if want != phase:
        return
    if marker:
        Path(marker).write_text(phase)
    time.sleep(3600)


def _log(msg: str) -> None:
    print(f"[dsv4 stage] {msg}", file=sys.stderr, flush=True)


def stale_temporaries(dest: Path):
    """Temp / aside directories a killed run may have left next to ``dest``."""
    parent = dest.parent
    if not parent.is_dir():
        return []
    pre = (f".{dest.name}.stage-", f".{dest.name}.old-")
    return sorted(p for p in parent.iterdir() if p.name.startswith(pre))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False
    when the platform / file system does not support it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE)
    return rc == 0


def _replace_dir(new: Path, dest: Path) -> None:
    """Put the finished ``new`` directory at ``dest``, which exists.

    Preferred: one atomic exchange (readers see the old or the new directory,
    nothing in between), then the old one (now at ``new``) is removed. Fallback
    (no renameat2): rename the old one aside, then the new one in; a crash in
    between leaves no ``dest`` (and an ``.old-*`` that the next run removes).
    """
    if _rename_exchange(new, dest):
        _maybe_pause("after-exchange")
        shutil.rmtree(new, ignore_errors=True)
        return
    old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(dest, old)
    _maybe_pause("after-aside")
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)


def check_disk_space(path, required_bytes: Optional[int]) -> None:
    """Raise :class:`InsufficientDiskSpace` when ``path``'s file system has less
    than ``required_bytes`` free (``path`` or its nearest existing parent)."""
    if not required_bytes:
        return
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(str(p)).free
    if free < required_bytes:
        raise InsufficientDiskSpace(p, required_bytes, free)


def _refuse_existing(dest: Path, s: Optional[dict], *, name: str, want, overwrite: bool) -> None:
    """Raise :class:`StageConflict` (naming the one fix that works) unless ``dest`` may be (re)built: it is
    missing, or ``overwrite`` and it holds only dsv4's own earlier output."""
    if overwrite and s is not None and dest.is_dir():
        refuse_foreign(dest, s, stage=name)     # the user's own files in dsv4's output: never deleted
    if overwrite and s is None and dest.exists():
        raise StageConflict(f"{name}: {dest} was not written by dsv4 (no {SENTINEL}); refusing to replace "
                            f"it even with --overwrite, which only replaces dsv4's own outputs. Fix: choose "
                            f"another output folder, or remove this one yourself")
    if dest.exists() and not overwrite:
        if s is None:
            raise StageConflict(f"{name}: {dest} exists and was not written by dsv4 (no {SENTINEL}); dsv4 "
                                f"writes only into a new or empty folder or over its own output. Fix: choose "
                                f"another output folder, or empty this one yourself")
        raise StageConflict(f"{name}: {dest} holds the result of stage {s.get('stage')!r} with "
                            f"inputs {s.get('inputs')!r}, not {want!r}. Fix: pass --overwrite to replace it, "
                            f"or choose another output folder")


def _build_in_place(dest: Path, build_fn: Callable[[Path], Any], *, name: str, want, verbose: bool) -> dict:
    """Build into a temporary sibling of ``dest``, write the sentinel, rename into place; the sentinel."""
    tmp = dest.parent / f".{dest.name}.stage-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        t0 = time.time()
        if verbose:
            _log(f"{name}: building {dest}")
        build_fn(tmp)
        _maybe_pause("before-sentinel")
        sentinel = {"complete": True, "stage": name, "inputs": want, "created_unix": time.time(),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - t0, 3),
                    "host": socket.gethostname(), "pid": os.getpid(), "files": manifest(tmp)}
        (tmp / SENTINEL).write_text(json.dumps(sentinel, indent=2, sort_keys=True) + "\n")
        _fsync_tree(tmp)
        _maybe_pause("before-rename")
        if dest.exists():
            _replace_dir(tmp, dest)
        else:
            os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        _log(f"{name}: {dest} complete in {time.time() - t0:.1f} s")
    return sentinel


def run_stage(dest_dir, build_fn: Callable[[Path], Any], *, name: str, input_paths: Iterable,
              inputs: Optional[Mapping[str, Any]] = None, required_bytes: Optional[int] = None,
              lock_dir=None, lock_timeout: Optional[float] = None, overwrite: bool = False,
              verbose: bool = True) -> StageResult:
    """Build ``dest_dir`` with ``build_fn(tmp_dir)`` safely (see module docstring).

    ``build_fn`` receives an empty directory on the destination's file system
    and fills it; its return value is ignored, an exception aborts the stage
    (temp dir removed, destination untouched). ``input_paths``: every file or folder the stage reads (no
    default, so that no stage forgets it): a destination that is, contains or sits inside one of them is
    refused first (:func:`core.path_safety.refuse_overlap`). ``inputs`` (JSON-able) is stored
    in the sentinel and must match on reruns. ``required_bytes``: free space
    checked before building. ``lock_timeout``: seconds to wait for another
    process (None: forever). Returns a :class:`StageResult`.
    """
    from core.path_safety import refuse_overlap

    refuse_overlap(dest_dir, input_paths)
    dest = normalize_dest(dest_dir)
    want = _canon(inputs)
    started = time.time()

    s = read_sentinel(dest)
    if _matches(s, name, want) and not overwrite:
        return StageResult(dest, False, s)

    lp = lock_path_for(dest, lock_dir)
    lp.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lp), timeout=-1 if lock_timeout is None else lock_timeout)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if verbose:
            _log(f"{name}: waiting for another process preparing {dest} (lock {lp})")
        try:
            lock.acquire()
        except Timeout:
            raise StageError(f"{name}: timed out after {lock_timeout} s waiting for the lock on {dest} "
                             f"({lp})") from None
    try:
        s = read_sentinel(dest)
        # overwrite=True replaces an older result, not one a concurrent writer finished while we waited
        fresh = s is not None and float(s.get("created_unix", 0)) >= started
        if _matches(s, name, want) and (not overwrite or fresh):
            if verbose:
                _log(f"{name}: {dest} was completed by another process")
            return StageResult(dest, False, s)
        if s is None and dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
            dest.rmdir()  # an empty folder (made by the user, or by a failed start) is free to use
        _refuse_existing(dest, s, name=name, want=want, overwrite=overwrite)

        for p in stale_temporaries(dest):
            if verbose:
                _log(f"{name}: removing stale temporary {p}")
            shutil.rmtree(p, ignore_errors=True)
        if dest.parent.is_dir():
            from core.stale_temps import remove_stale

            remove_stale(dest.parent)  # other writers' temporaries (save_native, write_checkpoint) of dead pids

        dest.parent.mkdir(parents=True, exist_ok=True)
        check_disk_space(dest.parent, required_bytes)

        return StageResult(dest, True, _build_in_place(dest, build_fn, name=name, want=want, verbose=verbose))
    finally:
        lock.release()
