"""Reading a file the user named: regular files only, a size limit, JSON nested to a bounded depth.

Why: ``config.json``, a checkpoint's index, ``--tokens``, ``--config`` and data files were read with a plain
``open().read()``. Pointed at ``/dev/zero`` that read grew to 10-11 GB before a MemoryError (or the kernel's
OOM killer); pointed at a FIFO it blocked forever with nothing printed; a 100k-deep nested JSON array raised
RecursionError, shown as "unexpected RecursionError". Here:

* :func:`open_regular` opens without blocking (``O_NONBLOCK``: a FIFO with no writer does not hang) and
  refuses anything but a regular file (FIFO, character or block device, socket, folder), naming its kind;
* :func:`read_bytes` reads at most ``limit`` bytes and refuses a larger file, naming its size and the limit,
  before the bytes are held in memory;
* :func:`load_json` adds a JSON parse whose nesting depth is bounded (:data:`MAX_JSON_DEPTH`), checked on the
  text before the parser recurses.

Every refusal is a :class:`BoundedReadError` (a :class:`core.errors.UserInputError`): one line that names the
file, what was expected and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Optional

from core.errors import UserInputError

__all__ = ["BoundedReadError", "open_regular", "read_bytes", "read_text", "load_json", "check_regular",
           "check_tree", "MAX_JSON_DEPTH", "JSON_LIMIT", "SMALL_JSON_LIMIT", "DATA_LIMIT"]

#: a config.json, an index, a state.json, a sentinel: far below this
SMALL_JSON_LIMIT = 64 << 20
#: a --tokens file or a run's JSON record
JSON_LIMIT = 1 << 30
#: a JSONL data file (read whole)
DATA_LIMIT = 4 << 30
#: deeper than any file dsv4 reads (a config nests 3 levels, a token file 2)
MAX_JSON_DEPTH = 64


class BoundedReadError(UserInputError):
    """A user-named file is not a regular file, too large, or nested too deep. ``problem``: the message without
    its fix, for a caller that words the fix itself (one "Fix:" a line)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.problem = message.split(". Fix: ")[0]


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_kind(path, mode: int, what: str) -> BoundedReadError:
    return BoundedReadError(f"{what} {path} is {_kind(mode)}, not a regular file; dsv4 reads only regular files "
                            f"there (a pipe or device could block or never end). Fix: point it to a regular file")


def check_regular(path, *, what: str = "file") -> None:
    """Refuse ``path`` unless it is a regular file (symlinks followed); never blocks. A missing file raises
    FileNotFoundError, which each caller words its own way."""
    st = os.stat(path)        # FileNotFoundError: each caller words a missing file its own way
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_kind(path, st.st_mode, what)


def check_tree(folder, *, what: str = "file", json_limit: int = SMALL_JSON_LIMIT, max_files: int = 1 << 16) -> None:
    """Refuse ``folder`` unless every entry under it (links followed, never opened) is a folder or a regular
    file, and every ``*.json`` file holds at most ``json_limit`` bytes: a checkpoint's files checked by kind
    before a library (DCP, safetensors, ``json``) opens them blocking and unbounded. At most ``max_files``."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            seen += 1
            if seen > max_files:
                raise BoundedReadError(f"{what} {folder} holds more than {max_files:,} files; it is not the "
                                       f"folder dsv4 expects there. Fix: check the path")
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise BoundedReadError(f"{what} {path} is a link to nothing. Fix: restore the file") from None
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise _refuse_kind(path, st.st_mode, what)
            if name.endswith(".json") and st.st_size > json_limit:
                raise _too_large(path, st.st_size, json_limit, what)


def open_regular(path, *, what: str = "file"):
    """A binary file object of ``path`` if it is a regular file; a FIFO, a device, a socket or a folder is
    refused (opened non-blocking, then checked on the open descriptor: no race with a swapped path). A missing
    file raises FileNotFoundError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise BoundedReadError(f"{what} {path} is a folder, not a regular file. Fix: point it to a file") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:      # a FIFO opened for writing elsewhere, or a socket
            raise BoundedReadError(f"{what} {path} is not a regular file (a socket or pipe). Fix: point it to a "
                                   f"regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_kind(path, st.st_mode, what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, *, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``; refused when it holds more than ``limit`` bytes."""
    with open_regular(path, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise _too_large(path, size, limit, what)
        data = f.read(limit + 1)      # the file may have grown since fstat
    if len(data) > limit:
        raise _too_large(path, len(data), limit, what)
    return data


def _too_large(path, size: int, limit: int, what: str) -> BoundedReadError:
    return BoundedReadError(f"{what} {path} holds {size:,} bytes or more, over the limit of {limit:,} bytes for "
                            f"such a file; it is not the file dsv4 expects there. Fix: check the path")


def read_text(path, *, limit: int, what: str = "file") -> str:
    data = read_bytes(path, limit=limit, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BoundedReadError(f"{what} {path} is not UTF-8 text ({exc}). Fix: check the path") from None


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in JSON text (strings skipped); linear, no recursion."""
    if b"[" not in data and b"{" not in data:
        return 0
    stripped = _STRINGS.sub(b'""', data) if b'"' in data else data
    depth = deepest = 0
    # only brackets matter: count them with bytes.translate-free scanning of the few bracket positions
    for m in re.finditer(rb"[\[\]{}]", stripped):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_bounded(data: bytes, *, source, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of ``data`` after its depth is checked (``source`` names it in the error)."""
    depth = json_depth(data)
    if depth > max_depth:
        raise BoundedReadError(f"{what} {source} nests JSON {depth} levels deep, more than the {max_depth} "
                               f"dsv4 accepts; it is not the file dsv4 expects there. Fix: check the path")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BoundedReadError(f"{what} {source} is not UTF-8 text ({exc})") from None


def load_json(path, *, what: str = "file", limit: int = SMALL_JSON_LIMIT,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of the regular file ``path`` (at most ``limit`` bytes, ``max_depth`` levels).
    ``json.JSONDecodeError`` propagates, so each caller keeps its own wording for malformed JSON."""
    return loads_bounded(read_bytes(path, limit=limit, what=what), source=Path(path), what=what,
                         max_depth=max_depth)


def load_json_optional(path, *, what: str = "file", limit: int = SMALL_JSON_LIMIT) -> Optional[Any]:
    """:func:`load_json`, or None when ``path`` does not exist."""
    if not os.path.lexists(path):
        return None
    return load_json(path, what=what, limit=limit)
