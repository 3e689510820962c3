"""Every unsupported combination fails at parse time with its exact message.

The cases (arguments and message) come from tests/unsupported_cases.bzl; each is a test of its own here
(``-k CASE`` runs one). Every case runs as ``dsv4 validate ARGS`` and as the main job, each a fork of the
preloaded CLI (tests/cli_process.py) with the exit code and both streams exactly as a user sees them. What
a fork cannot show is a warning printed while the preloaded modules are imported: the same modules for every
case, so the first case also runs both commands in fresh interpreters (``DSV4_TEST_FRESH_CLI``), whose
stderr must be the message alone too.
"""

import os

import pytest

from tests.bzl_data import load_bzl
from tests.cli_process import FRESH_ENV, run_cli

CASES = load_bzl("unsupported_cases.bzl")["UNSUPPORTED_CASES"]
FRESH = CASES[0]["name"]


def _env(case, **extra):
    return {**({FRESH_ENV: "1"} if case["name"] == FRESH else {}), **extra}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_validate_exits_2_with_the_exact_message(case):
    proc = run_cli("validate", *case["args"], env=_env(case), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: {case['message']}\n"
    assert proc.stdout == ""


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_main_job_refuses_it_before_doing_any_work(case, tmp_path):
    proc = run_cli(*case["args"], env=_env(case, DSV4_CACHE=str(tmp_path)), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    # the main job is a training job: its own refusals (e.g. the trainer's parallel limits) may come first
    assert proc.stderr.startswith("error: ") and proc.stderr.endswith(f"{case['message']}\n"), proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was prepared, no run folder written


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
