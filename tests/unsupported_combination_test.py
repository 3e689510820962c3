"""One unsupported combination fails at parse time with its exact message.

The case (arguments and message) comes from tests/unsupported_cases.bzl.
"""

import subprocess
import sys

from tests.bzl_data import load_bzl
from tests.runner import param

CASES = {case["name"]: case for case in load_bzl("unsupported_cases.bzl")["UNSUPPORTED_CASES"]}
CASE = CASES[param("case")]


def test_validate_exits_2_with_the_exact_message():
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.cli", "validate", *CASE["args"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: {CASE['message']}\n"
    assert proc.stdout == ""


def test_the_main_job_refuses_it_before_doing_any_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launchers.cli", *CASE["args"]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "DSV4_CACHE": str(tmp_path)},
    )
    assert proc.returncode == 2
    # the main job is a training job: its own refusals (e.g. the trainer's parallel limits) may come first
    assert proc.stderr.startswith("error: ") and proc.stderr.endswith(f"{CASE['message']}\n")
    assert list(tmp_path.iterdir()) == []  # nothing was prepared


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
