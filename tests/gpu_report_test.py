"""GPU test records (tests/gpu_report.py): the docs' GPU test table is the one the committed records give, and
the runner records each outcome of a real pytest run (run here on the CPU, on a generated test file whose
outcomes are known)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import gpu_report as G

ROOT = Path(os.path.abspath(__file__)).parent.parent
# the child finds this repository and this interpreter's packages (Bazel's runfiles put them on sys.path)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *(p for p in sys.path if p)]),
       "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_docs_table_is_the_one_the_records_give():
    doc = G.DOC.read_text(encoding="utf-8")
    expected = G.replace_table(doc, G.render_table(G.load_records()))
    assert doc == expected, ("docs/kernels-and-benchmarks.md's GPU test table is stale; "
                             "run: python -m tests.gpu_report --write-docs")


SAMPLE = textwrap.dedent('''
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_ok():
        pass

    def test_bad():
        assert 1 == 2, "one is not two"

    def test_skip():
        pytest.skip("needs a GPU")

    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False

    def test_error(broken):
        pass

    @pytest.mark.parametrize("x", [1, 2])
    def test_param(x):
        pass
''')


@pytest.fixture(scope="module")
def sample_record(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_report")
    (tmp / "test_sample.py").write_text(SAMPLE, encoding="utf-8")
    (tmp / "test_broken.py").write_text("import dsv4_no_such_module\n", encoding="utf-8")
    out = tmp / "record.json"
    proc = subprocess.run([sys.executable, "-m", "tests.gpu_report", "--record-out", str(out),
                           str(tmp / "test_sample.py"), str(tmp / "test_broken.py"), "-q", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text(encoding="utf-8")), tmp


def test_the_runner_records_every_outcome_and_exits_with_pytests_status(sample_record):
    proc, rec, tmp = sample_record
    assert proc.returncode == 1, proc.stdout + proc.stderr          # pytest's status: tests failed
    assert rec["kind"] == G.RECORD_KIND and rec["exit_status"] == 1
    assert rec["totals"] == {"passed": 3, "failed": 1, "skipped": 1, "error": 2, "xfailed": 1, "xpassed": 0}
    broken, = [t for t in rec["tests"] if "::" not in t["nodeid"]]     # a file that does not import
    assert broken["outcome"] == "error" and "dsv4_no_such_module" in broken["reason"]
    by_name = {t["nodeid"].split("::")[1]: t for t in rec["tests"] if "::" in t["nodeid"]}
    assert {n: t["outcome"] for n, t in by_name.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skip": "skipped", "test_xfail": "xfailed",
        "test_error": "error", "test_param[1]": "passed", "test_param[2]": "passed"}
    assert by_name["test_skip"]["reason"] == "needs a GPU"
    assert "one is not two" in by_name["test_bad"]["reason"]
    assert "fixture broke" in by_name["test_error"]["reason"]
    assert by_name["test_ok"]["reason"] is None
    counts = {f.rsplit("/", 1)[-1]: c for f, c in rec["files"].items()}
    assert counts["test_sample.py"]["passed"] == 3 and counts["test_sample.py"]["failed"] == 1
    assert counts["test_broken.py"]["error"] == 1 and counts["test_broken.py"]["passed"] == 0
    assert rec["command"].startswith("python -m tests.gpu_report ") and "test_sample.py" in rec["command"]


def test_the_record_names_the_machine_and_versions(sample_record):
    import torch

    _, rec, _ = sample_record
    assert rec["versions"]["torch"] == torch.__version__
    assert rec["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(rec["versions"]) == {"python", "torch", "triton", "tilelang", "pytest"}
    assert rec["machine"]["gpus"] == ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                                      if torch.cuda.is_available() else [])
    assert len(rec["date"]) == 20 and rec["date"].endswith("Z")


def test_the_plugin_loads_into_plain_pytest(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n", encoding="utf-8")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.gpu_report",
                           "--gpu-record", str(out), str(tmp_path / "test_one.py")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(out.read_text(encoding="utf-8"))
    assert rec["totals"]["passed"] == 1 and rec["command"].startswith("python -m pytest ")


def _record(date, gpus, files, torch="2.11.0+cu130", triton="3.6.0"):
    return {"kind": G.RECORD_KIND, "date": date, "machine": {"gpus": gpus}, "path": f"bench/results/gpu-tests/{date}.json",
            "versions": {"torch": torch, "triton": triton},
            "files": {f: {**dict.fromkeys(G.OUTCOMES, 0), **c} for f, c in files.items()}}


def test_the_table_keeps_the_latest_record_per_file_and_machine():
    h1, h2 = ["NVIDIA H200"], ["NVIDIA H200", "NVIDIA H200"]
    records = [
        _record("2026-12-01T10:00:00Z", h1, {"tests/kernels/test_a.py": {"passed": 5, "duration_s": 10.0}}),
        _record("2026-12-02T10:00:00Z", h1, {"tests/kernels/test_a.py": {"passed": 4, "failed": 1, "error": 2,
                                                                         "duration_s": 12.4}}),
        _record("2026-12-02T11:00:00Z", h2, {"tests/kernels/test_a.py": {"passed": 3, "skipped": 2,
                                                                         "duration_s": 3.0}}),
    ]
    table = G.render_table(records).splitlines()
    assert table[2:] == [
        "| `tests/kernels/test_a.py` | NVIDIA H200 x1 | 2026-12-02 10:00 | 4 | 1 | 0 | 2 error | 12 | 2.11.0+cu130 / 3.6.0 "
        "| [2026-12-02T10:00:00Z.json](../bench/results/gpu-tests/2026-12-02T10:00:00Z.json) |",
        "| `tests/kernels/test_a.py` | NVIDIA H200 x2 | 2026-12-02 11:00 | 3 | 0 | 2 | - | 3 | 2.11.0+cu130 / 3.6.0 "
        "| [2026-12-02T11:00:00Z.json](../bench/results/gpu-tests/2026-12-02T11:00:00Z.json) |",
    ]
    assert G.render_table([]).startswith("No GPU test record yet")


def test_a_stale_table_is_replaced_and_a_missing_marker_refused():
    doc = f"# T\n\n{G.BEGIN}\nold table\n{G.END}\n\nafter\n"
    assert G.replace_table(doc, "new") == f"# T\n\n{G.BEGIN}\nnew\n{G.END}\n\nafter\n"
    with pytest.raises(ValueError, match="needs exactly one"):
        G.replace_table("# no markers\n", "new")


def test_a_foreign_json_in_the_records_folder_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"kind": "bench"}), encoding="utf-8")
    with pytest.raises(ValueError, match="not a GPU test record"):
        G.load_records(tmp_path)


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
