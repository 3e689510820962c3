"""``--overwrite`` deletes only what dsv4 wrote: the completion sentinel lists the output's files.

Why: an output folder used to count as dsv4's own as soon as it carried the completion sentinel
(``.dsv4-complete.json``), so ``convert --overwrite`` onto a folder holding an earlier output plus files the
user had put there since (notes, an evaluation, another checkpoint) replaced the whole folder and deleted
them without a word. Here the sentinel records every file the stage wrote (:func:`manifest`, relative paths,
written last, when the output is complete), and a folder is replaced only when it holds nothing else
(:func:`refuse_foreign`); otherwise the refusal lists the foreign files. A sentinel of an older version, which
did not record its files, cannot vouch for the folder's content and is refused too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

from core.errors import UserInputError

__all__ = ["SENTINEL", "OverwriteRefused", "manifest", "foreign_files", "refuse_foreign"]

SENTINEL = ".dsv4-complete.json"
_SHOWN = 8


class OverwriteRefused(UserInputError):
    """An output folder holds files dsv4 did not write there; replacing it would delete them."""


def manifest(folder) -> List[str]:
    """Every file and symlink under ``folder`` (symlinks not followed), as sorted POSIX paths relative to it;
    the sentinel itself excluded."""
    root = Path(folder)
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = (rel / name).as_posix()
            if path != SENTINEL:
                out.append(path)
    return sorted(out)


def foreign_files(folder, sentinel: dict) -> Optional[List[str]]:
    """The files under ``folder`` that the sentinel does not list; None when the sentinel lists none (an
    older version's, which cannot say)."""
    listed = sentinel.get("files")
    if not isinstance(listed, list):
        return None
    known = set(str(f) for f in listed)
    return [f for f in manifest(folder) if f not in known]


def refuse_foreign(folder, sentinel: dict, *, stage: str) -> None:
    """Raise :class:`OverwriteRefused` unless ``folder`` holds only the files its sentinel lists."""
    foreign = foreign_files(folder, sentinel)
    if foreign is None:
        raise OverwriteRefused(
            f"{stage}: {folder} was written by an earlier dsv4 that did not record its files in {SENTINEL}, so "
            f"--overwrite cannot tell its files from yours; refusing to replace it. Fix: choose another output "
            f"folder, or remove this one yourself")
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f", ... ({len(foreign)} in all)" if len(foreign) > _SHOWN else "")
        raise OverwriteRefused(
            f"{stage}: {folder} holds files dsv4 did not write there ({shown}); --overwrite replaces only dsv4's "
            f"own output and would delete them. Fix: move those files out of the folder, or choose another "
            f"output folder")
