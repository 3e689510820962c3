"""Reads the plain-data .bzl files of tests/ (lists of struct(...)) from Python.

Those files hold only literals and struct() calls, so evaluating them with
struct=dict gives the same data Bazel sees: one source for both sides.
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(os.path.abspath(__file__)).parent


def load_bzl(name: str) -> dict:
    source = (TESTS_DIR / name).read_text(encoding="utf-8")
    scope: dict = {"struct": dict, "__builtins__": {}}
    exec(compile(source, name, "exec"), scope)  # noqa: S102 - plain data file of this repo
    return {k: v for k, v in scope.items() if k.isupper()}
