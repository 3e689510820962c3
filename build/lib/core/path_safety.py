"""Path rules that keep a command's reads and writes where the user pointed it.

Why: a checkpoint folder is data from anywhere. Its index (or DCP metadata)
names the files to read, and a file name can be a symlink: a shard that
resolves outside the checkpoint folder was followed, so a crafted checkpoint
could make ``dsv4`` read (and report on) any file the user can read. And an
output location that is, contains or sits inside one of the command's inputs
was overwritten with ``--overwrite``, inputs and unrelated files included.

* :func:`inside_folder` resolves a member file (symlinks included) and
  refuses it unless it lies inside the resolved folder.
* :func:`refuse_overlap` refuses an output that is, contains or sits inside
  any input (all compared as resolved paths), before anything is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

from core.errors import UserInputError

__all__ = ["PathSafetyError", "inside_folder", "refuse_overlap"]


class PathSafetyError(UserInputError):
    """A path escapes its folder, or an output overlaps an input."""


def _real(p) -> Path:
    return Path(os.path.realpath(os.path.abspath(os.fspath(p))))


def inside_folder(folder, name: str, *, what: str = "file") -> Path:
    """``folder / name`` if it resolves (symlinks followed) to a path inside ``folder``; else raise."""
    root = _real(folder)
    target = _real(Path(folder) / name)
    if target != root and root in target.parents:
        return Path(folder) / name
    raise PathSafetyError(f"{Path(folder) / name}: {what} resolves to {target}, outside the folder {root}; "
                          f"refusing to follow it (a checkpoint's files must lie inside its folder)")


def refuse_overlap(out, inputs: Iterable[Optional[os.PathLike]], *, out_option: str = "--out") -> None:
    """Refuse an output that is, contains or sits inside one of ``inputs`` (None entries are skipped)."""
    o = _real(out)
    for inp in inputs:
        if inp is None:
            continue
        i = _real(inp)
        if o == i:
            how = "is"
        elif o in i.parents:
            how = "contains"
        elif i in o.parents:
            how = "sits inside"
        else:
            continue
        raise PathSafetyError(f"{out_option} {out} {how} the input {inp}; writing there would destroy the "
                              f"input. Fix: choose an output folder outside the inputs")
