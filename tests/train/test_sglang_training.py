"""`dsv4 train --rollout-engine sglang` end to end on the CPU, against the fake SGLang server of
tests/train/_fake_sglang.py (SGLang itself needs a GPU and the sglang package; nothing here runs it).

* connect mode, through the CLI: `--rollout-url http://127.0.0.1:PORT` on `--hardware cpu` trains 3 GRPO
  steps: the trainer pushes its weights every step (names and shapes of its HF export; the first push equals
  the starting checkpoint, later ones change after a step that learned), the fake's samples are what it
  trains on (response tokens, seeds per prompt and sample, routing replay reported); an unreachable URL is
  one line and leaves no run folder; the choices that cannot work are refused before any work starts;
* launch mode, through ``run_training``: the trainer writes RUN_DIR/sglang_init, starts
  `python -m sglang.launch_server` on it (the fake, first on the child's PYTHONPATH), syncs the weights
  through disk, and stops the server at the end and when the run fails.

Tensor sync sends SGLang's MultiprocessingSerializer payloads, which need the sglang package; the connect
test substitutes the base64 `torch.save` stand-in the fake reads (``rollout.sglang_engine.sglang_serializer``).
"""

import json

import pytest
import torch
from click.testing import CliRunner

from core.config import preset
from core.ports import free_port
from tests.train._fake_sglang import FakeSGLang, install_fake_launcher, process_gone, spare_port
from rollout import sglang_engine
from rollout.reference_engine import sample_seed
from train.step_common import step_seed as _step_seed

CFG = preset("tiny")


def dsv4(*args):
    from launchers.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(res, code) -> str:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0]


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _shapes(folder) -> dict:
    from core.checkpoint import open_checkpoint

    return {n: list(t.shape) for n, t in open_checkpoint(folder).iter_tensors(dequantize=True)}


def test_train_connects_to_rollout_url_on_the_cpu_pushes_weights_and_trains_on_its_samples(tmp_path, monkeypatch):
    from core.checkpoint import open_checkpoint

    monkeypatch.setattr(sglang_engine, "sglang_serializer", lambda: sglang_engine.torch_b64_serialize)
    run = tmp_path / "run"
    with FakeSGLang(CFG) as fake:
        res = dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--rollout-url", fake.url,
                   "--run-dir", run, "--steps", 3, "prompts_per_step=2", "group_size=3", "max_new_tokens=4")
    assert res.exit_code == 0, res.output
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]

    # the trainer pushed its weights at the start of every step: all of them, by the names and shapes of its
    # HF export. The first push is the starting checkpoint; each later one the weights after the step before,
    # which changed them exactly when that step had a learning signal (some group's rewards differ)
    st = fake.state
    assert [v["how"] for v in st["versions"]] == ["tensors"] * 3
    exported = _shapes(run / "hf")
    assert all(v["shapes"] == exported for v in st["versions"])
    saved = json.loads((run / "train_config.json").read_text())
    start = dict(open_checkpoint(saved["model_source"]).iter_tensors(dequantize=True))
    pushed = fake.tensors
    assert all(torch.equal(pushed[0][n].float(), start[n].float()) for n in exported)
    for k in (1, 2):        # a step changed the weights exactly when it had a learning signal
        same = all(torch.equal(pushed[k][n], pushed[k - 1][n]) for n in exported)
        flat = rows[k - 1]["zero_variance_group_frac"] == 1.0
        assert same == flat and (rows[k - 1]["grad_norm"] == 0) == flat, (k, rows[k - 1])
    assert any(r["zero_variance_group_frac"] < 1.0 for r in rows[:2])      # the changing branch ran
    assert all(r["weight_sync_buckets"] >= 1 and r["weight_sync_bytes"] > 0 for r in rows)

    # it generated on the server (one request per step, the seed of every prompt and sample) and trained on
    # exactly those samples, routing replayed from the routed experts the server returned
    assert len(st["generate"]) == 3
    for step, (req, row) in enumerate(zip(st["generate"], rows), start=1):
        assert req["inputs"] == 6 and req["return_routed_experts"] is True
        assert req["seeds"] == [sample_seed(_step_seed(0, step), i, j) for i in range(2) for j in range(3)]
        assert row["response_tokens"] == sum(req["output_lengths"])
        assert row["routing_replay_match"] is not None and 0.0 <= row["routing_replay_match"] <= 1.0
        assert row["train_rollout_logprob_abs_diff"] is not None
    assert saved["run"]["rollout_url"] == fake.url and saved["run"]["rollout_engine"] == "sglang"
    assert saved["train"]["sglang_weight_sync"] == "tensors"


def test_an_unreachable_rollout_url_is_one_line_and_leaves_no_run_folder(tmp_path):
    port = free_port()   # nothing listens there
    run = tmp_path / "run"
    line = one_line_error(dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--rollout-url",
                               f"http://127.0.0.1:{port}", "--run-dir", run, "--steps", 1), code=1)
    assert f"--rollout-url http://127.0.0.1:{port}: no SGLang server answers GET /health" in line
    assert "Fix: start one there" in line and "leave --rollout-url out" in line
    assert not run.exists()


def test_rollout_url_choices_are_checked_before_any_work(tmp_path):
    url = "http://127.0.0.1:1"
    # starting a server needs a GPU target; the message names --rollout-url
    line = one_line_error(dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--print-config"), 2)
    assert "--rollout-engine sglang needs a GPU (got --hardware cpu)" in line
    assert "connect to a running sglang server with --rollout-url URL" in line
    line = one_line_error(dsv4("train", "--hardware", "cpu", "--rollout-url", url, "--print-config"), 2)
    assert "--rollout-engine reference runs in the trainer's process and cannot connect" in line
    line = one_line_error(dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--rollout-url",
                               "127.0.0.1:30000", "--print-config"), 2)
    assert "--rollout-url must be http://HOST:PORT" in line
    line = one_line_error(dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--rollout-url", url,
                               "--nproc-per-node", 2, "--print-config"), 2)
    assert "the run's 2 data-parallel ranks each own a rollout engine" in line
    line = one_line_error(dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--rollout-url", url,
                               "sglang_weight_sync=ftp", "--print-config"), 2)
    assert "sglang_weight_sync" in line

    # accepted on the CPU: the server runs elsewhere. The printed settings read back unchanged.
    res = dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", f"rollout_url={url}/",
               "sglang_weight_sync=disk", "--print-config")
    assert res.exit_code == 0, res.output
    path = tmp_path / "run.toml"
    path.write_text(res.stdout)
    assert 'rollout_url = "http://127.0.0.1:1"' in res.stdout and 'sglang_weight_sync = "disk"' in res.stdout
    again = dsv4("train", "--config", path, "--print-config")
    assert again.exit_code == 0 and again.stdout == res.stdout
    assert 'rollout_url = "none"' in dsv4("train", "--hardware", "cpu", "--print-config").stdout


# -- launch mode through the trainer, on the CPU: the plugin of tests/train/_fake_sglang.py declares the
# real adapter runnable there, and `python -m sglang.launch_server` starts the fake ---------------------------
def _launch_run(tmp_path, **overrides):
    from core.plugins import PluginHost
    from core.run_config import Choices, normalize
    from launchers import stages
    from launchers.builtin_plugins import BUILTIN_PLUGINS
    from orchestration import run_training

    modules = [m for m in BUILTIN_PLUGINS if m != "rollout.plugin"] + ["tests.train._fake_sglang"]
    host = PluginHost(modules, third_party=False)
    rc = normalize(Choices(hardware="cpu", rollout_engine="sglang", model=CFG, job="train"), host, model_name="tiny")
    assert rc.rollout_url is None and not rc.selection.hardware.gpu
    run = tmp_path / "run"
    result = run_training(rc, stages.model_checkpoint(rc), mode="grpo", steps=2, run_dir=run, progress=False,
                          prompts_per_step=2, group_size=2, max_new_tokens=4, export_at_end=False,
                          sglang_weight_sync="disk", **overrides)
    return run, result


def test_train_starts_a_server_on_the_exported_weights_syncs_through_disk_and_stops_it(tmp_path, monkeypatch):
    state_file = install_fake_launcher(tmp_path, monkeypatch)
    port = spare_port()
    # 3 s of 503s: the trainer's 0.5 s polls see at least one even on a loaded machine, where with 1 s a poll that
    # came late once saw the server ready at its first answer (health_calls 1)
    run, result = _launch_run(tmp_path, sglang_server_args="--fake-health-delay 3", sglang_port=port)
    state = json.loads(state_file.read_text())
    info = state["info"]
    assert info["argv"] == ["--model-path", str(run / "sglang_init"), "--host", "127.0.0.1", "--port", str(port),
                            "--tp-size", "1", "--trust-remote-code", "--skip-tokenizer-init",
                            "--enable-return-routed-experts", "--fake-health-delay", "3"]      # the exact command
    init = _shapes(run / "sglang_init")                 # the starting weights, in the run's publish format
    assert [v["how"] for v in state["versions"]] == [f"disk:{run / 'sglang_weights'}"] * 2
    assert all(v["shapes"] == init for v in state["versions"])
    assert len(state["generate"]) == 2 and state["health_calls"] >= 2
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["routing_replay_match"] is not None for r in rows)
    assert [r["response_tokens"] for r in rows] == [sum(g["output_lengths"]) for g in state["generate"]]
    assert "fake sglang: serving" in (run / "sglang_server.log").read_text()
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"])          # stopped at the end of the run


def test_a_failing_run_stops_the_server_it_started(tmp_path, monkeypatch):
    from rollout.sglang_engine import SGLangError

    state_file = install_fake_launcher(tmp_path, monkeypatch)
    with pytest.raises(SGLangError, match="/generate: HTTP 500.*boom"):
        _launch_run(tmp_path, sglang_server_args="--fake-fail /generate boom")
    info = json.loads(state_file.read_text())["info"]
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"])
    assert not (tmp_path / "run").exists()           # a start that fails before its first step leaves nothing
