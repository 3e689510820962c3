"""Atomic writes of single files: readers see the old content or the new one, never a torn file.

The new content goes to a temporary file beside the destination (same folder, so the rename stays on one
file system), which is flushed and fsynced, renamed over the destination (``os.replace``), and then the
folder is fsynced so that the rename itself survives a crash. On an error the temporary file is removed; a
killed process leaves at most a hidden ``.NAME.<pid>-<hex>.tmp`` beside the destination. The file is
created with the process's usual permissions (``0o666`` less the umask).

* :func:`write_text_atomically` / :func:`write_bytes_atomically`: the whole content at once;
* :func:`atomic_path`: a context manager yielding the temporary path, for writers that want a path
  (``torch.save``, ``safetensors.save_file``, a stream of lines);
* :func:`atomic_folder`: the same for a folder: filled under a hidden ``.NAME.tmp-<pid>-<hex>`` sibling and
  swapped into place (an existing folder is moved aside to ``.NAME.old-<pid>-<hex>`` and removed), so a
  reader sees the old folder or the new one (what ``core.stale_temps`` cleans after a kill);
* :func:`fsync_dir`: fsync a folder (after renaming something into it).

Staged outputs with a lock and a sentinel are ``converters/staging.py``'s.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["atomic_folder", "atomic_path", "fsync_dir", "fsync_file", "write_bytes_atomically",
           "write_text_atomically"]


def fsync_dir(path: PathLike) -> None:
    """fsync the folder ``path`` (its entries: a rename into it, a new file; a file path works too). A file
    system that cannot (some network or FUSE mounts refuse to open or fsync a folder) is skipped silently."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    """fsync one file's data; an error is raised (the data must be on disk before a rename publishes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; write the new content there. When the block ends
    without an error the file is fsynced and renamed over ``path`` and the folder fsynced; on an error (or
    if nothing was written there) ``path`` is untouched and the temporary file removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomically(path: PathLike, data: bytes) -> Path:
    """Replace ``path``'s content with ``data`` atomically (see the module); returns ``path``."""
    with atomic_path(path) as tmp, open(tmp, "xb") as f:
        f.write(data)
    return Path(path)


def write_text_atomically(path: PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Replace ``path``'s content with ``text`` atomically (see the module); returns ``path``."""
    return write_bytes_atomically(path, text.encode(encoding))


@contextmanager
def atomic_folder(path: PathLike) -> Iterator[Path]:
    """Yield a new, empty temporary folder beside ``path``; fill it. When the block ends without an error it
    replaces ``path`` (an existing folder is moved aside, then removed) and the parent is fsynced; on an
    error the temporary folder is removed and ``path`` is untouched."""
    path = Path(path)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = path.parent / f".{path.name}.old-{tag}"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
