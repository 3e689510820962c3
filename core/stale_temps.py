"""Remove the temporary folders that writers killed with ``kill -9`` left behind.

Why: every writer here (native checkpoints, HF checkpoints, training
checkpoints, staged outputs) assembles its result in a hidden sibling folder
named ``.<name>.<kind>-<pid>-<hex>`` and renames it into place. A writer killed
before the rename leaves that folder, and nothing removed it: disks filled up
with copies of half-written checkpoints. The next writer into the same parent
calls :func:`remove_stale`, which deletes such folders whose writer process is
gone (its pid is not running on this host). A folder of a live writer is left
alone, so concurrent writers are safe. (On a file system shared by several
hosts a pid says nothing about another host; staged outputs are serialized by
their lock there, see :mod:`converters.staging`.)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import List

__all__ = ["remove_stale", "stale_temporaries"]

_TEMP = re.compile(r"^\..+\.(?:tmp|old|stage)-(\d+)-[0-9a-f]{4,}$")


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs on this host (signal 0; one we may not signal runs too)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temporaries(parent) -> List[Path]:
    """Hidden temp / aside folders in ``parent`` whose writer process no longer runs."""
    p = Path(parent)
    if not p.is_dir():
        return []
    out = []
    for child in p.iterdir():
        m = _TEMP.match(child.name)
        if m and child.is_dir() and not child.is_symlink() and not pid_alive(int(m.group(1))):
            out.append(child)
    return sorted(out)


def remove_stale(parent) -> List[Path]:
    """Delete :func:`stale_temporaries` of ``parent``; returns what was removed."""
    gone = stale_temporaries(parent)
    for child in gone:
        shutil.rmtree(child, ignore_errors=True)
    return gone
