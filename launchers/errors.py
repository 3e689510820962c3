"""How `dsv4` reports a failure: one line ``error: ...`` with the fix, never a traceback.

Why: expected failures (bad data, a full disk, a read-only output, a damaged
checkpoint) used to print 40 lines of traceback with the useful line buried
inside. :func:`report` turns an exception into one line and an exit code:

* user errors (:class:`core.errors.UserInputError`, :class:`core.config.ConfigError`
  and their subclasses): the message as is, exit 1;
* operating-system errors a user can fix (no space, quota, read-only file
  system, permission denied, missing file): the path, the reason and the fix,
  exit 1;
* the GPU running out of memory (torch's ``OutOfMemoryError``, anywhere in the chain): what was asked for and
  what was free, and the settings that shrink a run, exit 1 (before, a Flash-shaped GRPO run on an 80 GB card
  printed torch's five sentences as an "unexpected" bug);
* anything else is a bug: one line naming the exception plus
  "rerun with --debug for the traceback", exit 1.

``dsv4 --debug ...`` (or ``DSV4_DEBUG=1``) re-raises instead, so the full
traceback is shown.
"""

from __future__ import annotations

import errno
import os
import re

__all__ = ["debug_enabled", "set_debug", "one_line"]

_DEBUG = {"on": False}

_OS_FIX = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space (disk quota exceeded) or write elsewhere",
    errno.EROFS: "the file system is read-only; choose an output on a writable one",
    errno.EACCES: "check the permissions of the path, or choose another one",
    errno.EPERM: "check the permissions of the path, or choose another one",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path: a part of it is a file, not a folder",
    errno.EISDIR: "check the path: it is a folder, a file was expected",
    errno.ENAMETOOLONG: "a name in the path is longer than the file system allows (255 bytes a name); choose a "
                        "shorter one",
    errno.EFBIG: "the file is larger than the file system allows; write elsewhere",
    errno.EIO: "the device reported an I/O error; check the disk, or write elsewhere",
}
# Rust libraries (safetensors, tokenizers) report an OS error as text: "... (os error 28)"
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)|No space left on device|File name too long")


def set_debug(on: bool) -> None:
    _DEBUG["on"] = bool(on)
    # ranks started by the trainer (orchestration.launch) inherit it through the environment; a later command in the
    # same process (tests) without --debug takes it back
    if on and "DSV4_DEBUG" not in os.environ:
        os.environ["DSV4_DEBUG"] = "1"
        _DEBUG["env_set"] = True
    elif not on and _DEBUG.pop("env_set", False):
        os.environ.pop("DSV4_DEBUG", None)


def debug_enabled() -> bool:
    return _DEBUG["on"] or os.environ.get("DSV4_DEBUG", "") not in ("", "0")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _chain(exc: BaseException):
    """``exc`` and the exceptions it was raised from or during (``__cause__``, else ``__context__``), each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _os_error(exc: BaseException):
    """The OSError at the root of ``exc`` (DCP and others wrap them), if it is one a user can fix; an error of
    a Rust library that names one only in its text (``(os error 28)``) counts as that OSError."""
    for exc in _chain(exc):
        if isinstance(exc, OSError) and exc.errno in _OS_FIX:
            return exc
        m = _OS_ERROR_TEXT.search(str(exc))
        if m:
            code = (int(m.group(1)) if m.group(1) else
                    errno.ENOSPC if "No space" in m.group(0) else errno.ENAMETOOLONG)
            if code in _OS_FIX:
                return OSError(code, os.strerror(code))
    return None


_OOM_FIX = ("shrink the run: fewer tokens a micro-batch (max_tokens_per_rank, micro_batch_size), fewer rollout "
            "sequences or tokens (prompts_per_step x group_size, max_new_tokens), or more GPUs for the model "
            "(--tp, --ep, --pp); `dsv4 inspect` estimates a layout's memory per GPU")
_OOM_WHAT = re.compile(r"Tried to allocate [\d.]+ \w+\. GPU \d+ has a total capacity of [\d.]+ \w+ of which "
                       r"[\d.]+ \w+ is free")


def _out_of_memory(exc: BaseException):
    """torch's ``OutOfMemoryError`` at or under ``exc`` (by name: this module does not import torch)."""
    return next((e for e in _chain(exc)
                 if type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("torch")), None)


def one_line(exc: BaseException, *, expected: tuple) -> str:
    """The message `dsv4` prints (after ``error: ``) for ``exc``."""
    if isinstance(exc, expected):
        return str(exc).strip() or type(exc).__name__
    os_err = _os_error(exc)
    if os_err is not None:
        where = os_err.filename or ""
        reason = os_err.strerror or _first_line(os_err)
        return f"{where + ': ' if where else ''}{reason}; {_OS_FIX[os_err.errno]}"
    oom = _out_of_memory(exc)
    if oom is not None:
        what = _OOM_WHAT.search(str(oom))
        return f"the GPU ran out of memory{' (' + what.group(0) + ')' if what else ''}; {_OOM_FIX}"
    return f"unexpected {type(exc).__name__}: {_first_line(exc)} (rerun with --debug for the traceback)"
