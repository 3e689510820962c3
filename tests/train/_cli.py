"""`dsv4 train` as a user starts it, in a subprocess of its own (the multi-rank, Ray and async-rollout tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a launcher's environment the child must not inherit (it would join that job instead of starting its own)
_JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


def train_cli(run_dir, *args, env=None, check: bool = True, timeout: float = 900,
              command: str = "train") -> subprocess.CompletedProcess:
    """``python -m launchers.dsv4 train --hardware cpu --run-dir RUN_DIR ARGS...`` from the repository root
    (``command``: ``full-train`` instead); ``check``: assert it exited 0 (the end of its stderr in the message)."""
    from tests.cli_process import run_module

    args = [command, "--hardware", "cpu", "--run-dir", str(run_dir), *args]
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in _JOB_ENV:
        full_env.pop(key, None)
    proc = run_module("launchers.dsv4", args, cwd=ROOT, env=full_env, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics_rows(run_dir) -> list:
    """The run folder's metrics.jsonl rows."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
