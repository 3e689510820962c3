"""bench.convert runs end to end (tiny sizes) and writes the documented JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_cli_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "bench.convert", "--out", str(out), "--size-mb", "2",
                        "--min-seconds", "0.01"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160"))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    names = {x["converter"] for x in rows}
    assert {"mxfp4_to_fp8.cast", "fp8_to_bf16.dequant", "fp8_quantizer.publish", "nvfp4.quantize",
            "mxfp4_to_fp8.checkpoint(tiny)"} <= names
    for x in rows:
        assert set(x) >= {"converter", "device", "bytes", "seconds", "gbps", "peak_rss_mb", "date"}
        assert x["bytes"] > 0 and x["seconds"] > 0 and x["gbps"] > 0 and x["peak_rss_mb"] > 0
        assert x["device"].startswith("cpu")
    assert "mxfp4_to_fp8.cast" in r.stdout      # the rich table
