"""Readable runs (issue #21, item 7), the launcher's side: `-q` prints only errors and the final result (the
run's lines still reach RUN_DIR/train.log), the hardware is detected and said when --hardware is not given,
and the known megatron-core warnings are filtered here and in child processes unless -v."""

import json
import logging
import subprocess
import sys
import warnings

from click.testing import CliRunner

from launchers.cli import main
from reporting import kernel_compiles


def dsv4(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_quiet_train_prints_only_the_final_result_and_still_logs_to_the_run_folder(tmp_path, monkeypatch):
    # a Triton to count on (reporting.kernel_compiles): the step rows carry the count; this CPU run compiles none
    import types
    fake = types.SimpleNamespace(runtime=types.SimpleNamespace(jit_cache_hook=None))
    monkeypatch.setattr(kernel_compiles, "_triton_knobs", lambda: fake)
    run = tmp_path / "run"
    res = dsv4("-q", "train", "--steps", "1", "--run-dir", run, "max_new_tokens=4", "export_at_end=false")
    assert res.exit_code == 0, res.output
    assert res.stdout == ""
    assert res.stderr.splitlines() == [line for line in res.stderr.splitlines() if line.startswith("run folder: ")]
    assert res.stderr.startswith(f"run folder: {run} (step 1/1  loss ")
    log = (run / "train.log").read_text()
    assert " INFO    config: train " in log and " INFO    step 1/1 " in log
    assert "metrics {" not in log                               # debug lines only with -v
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # the step's Triton compiles (reporting.kernel_compiles): a count where triton is, absent where not
    assert row["triton_compiles"] == 0 and fake.runtime.jit_cache_hook is not None


def test_quiet_and_verbose_together_is_one_line():
    res = dsv4("-q", "-v", "validate")
    assert res.exit_code == 2
    assert res.stderr == "error: -q/--quiet and -v/--verbose both given. Fix: give at most one of them\n"


def test_hardware_is_detected_and_said_unless_given():
    import torch

    want = "nvidia" if torch.cuda.is_available() else "cpu"
    res = dsv4("train", "--print-config")
    assert res.exit_code == 0, res.output
    assert f"hardware: {want} (detected" in res.stderr
    assert f'hardware = "{want}"' in res.stdout
    res = dsv4("train", "--print-config", "--hardware", "cpu")
    assert res.exit_code == 0, res.output
    assert "detected" not in res.stderr and 'hardware = "cpu"' in res.stdout
    res = dsv4("-q", "train", "--print-config")
    assert res.stderr == ""                                    # -q: not said


def test_detect_hardware_chooses_nvidia_when_torch_sees_a_gpu(monkeypatch, caplog):
    import torch

    from launchers.console import detect_hardware
    from reporting import run_log

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    monkeypatch.setattr(run_log.log, "propagate", True)
    with caplog.at_level(logging.INFO, logger="dsv4"):
        assert detect_hardware() == "nvidia"
    assert "hardware: nvidia (detected: Fake H200; --hardware chooses)" in caplog.text


_CHILD = ("import warnings; warnings.warn('Transformer Engine and Apex are not installed. Falling back.'); "
          "warnings.warn('full scope is deprecated. Use empty cuda_graph_modules.'); warnings.warn('other one')")


def test_known_warnings_are_filtered_here_and_in_child_processes_unless_shown(monkeypatch):
    from core.known_warnings import filter_known_warnings

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_warnings(show=True)                       # -v: nothing hidden
        warnings.warn("Transformer Engine and Apex are not installed. Falling back.")
        filter_known_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back.")
        warnings.warn("full scope is deprecated. Use empty cuda_graph_modules.")
        warnings.warn("other one")
    assert [str(w.message) for w in seen] == ["Transformer Engine and Apex are not installed. Falling back.",
                                              "other one"]
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True)  # inherits the env
    assert "other one" in child.stderr
    assert "Transformer Engine" not in child.stderr and "full scope" not in child.stderr


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
