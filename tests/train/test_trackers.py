"""`dsv4 train --tracker` (reporting.trackers) on the tiny main job (GRPO, CPU): what MLflow holds, read back
through MLflow's own client, against metrics.jsonl; TensorBoard's events likewise (its own reader); the
resolved configuration as params; --resume continuing the same MLflow run; a tracker failing mid-run
(warned once, dropped, the run and metrics.jsonl complete); a missing library or a tracker that cannot
start refused in one line, leaving no run folder; the setting from a config file and its checks; wandb in
offline mode, its run's transaction log (written by wandb's own service) checked for every step's values.

MLflow's store is a ``file:`` folder in the test's tmp dir (``MLFLOW_ALLOW_FILE_STORE``: mlflow-skinny has
no database backend)."""

import json

import pytest
from click.testing import CliRunner

from core.errors import UserInputError

FAST = ("prompts_per_step=2", "group_size=2", "max_new_tokens=4")


def dsv4(*args):
    from launchers.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(res) -> str:
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0]


def rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def expected_scalars(row):
    """The scalars a tracker must hold for a metrics row, computed here from the row itself."""
    out = {}
    for k, v in row.items():
        if k == "step" or v is None or isinstance(v, (bool, str)):
            continue
        out[("time/" if k.startswith("time_") else "train/") + k] = float(v)
    return out


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "dsv4-test")
    return store


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient()
    return client, client.get_run(run_id)


def same(series, want, rel):
    """Two ``[(step, value)]`` series: the same steps, values within ``rel``."""
    assert [s for s, _ in series] == [s for s, _ in want]
    assert [v for _, v in series] == pytest.approx([v for _, v in want], rel=rel)


def history(client, run, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def test_mlflow_and_tensorboard_hold_the_metrics_of_every_step_and_resume_continues_the_run(tmp_path, mlflow_store):
    from reporting.metrics import tensorboard_scalars

    run = tmp_path / "run"
    res = dsv4("train", "--hardware", "cpu", "--tracker", "mlflow", "--tracker", "tensorboard", "--run-dir", run,
               "--steps", 2, "--lr", "3e-4", *FAST)
    assert res.exit_code == 0, res.output
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2]
    client, mrun = mlflow_run(run)
    assert mrun.info.run_name == "run" and mrun.info.status == "FINISHED"
    assert client.get_experiment(mrun.info.experiment_id).name == "dsv4-test"
    # the resolved configuration as params: dotted keys of train_config.json
    saved = json.loads((run / "train_config.json").read_text())
    params = mrun.data.params
    assert params["mode"] == "grpo" and params["steps"] == "2"
    assert float(params["train.lr"]) == 3e-4 == saved["train"]["lr"]
    assert params["run.impl"] == saved["run"]["impl"] == "miles"
    assert int(params["model_config.hidden_size"]) == saved["model_config"]["hidden_size"]
    # every scalar of every step, as metrics.jsonl has it, in MLflow and in TensorBoard
    tb = tensorboard_scalars(run)
    want = {}
    for r in got:
        for key, v in expected_scalars(r).items():
            want.setdefault(key, []).append((r["step"], v))
    assert {"train/loss", "train/grad_norm", "train/reward_mean", "time/time_train"} <= set(want)
    assert set(mrun.data.metrics) == set(want)
    for key, series in want.items():
        same(history(client, mrun, key), series, rel=1e-12)
        same(tb[key], series, rel=1e-6)                      # TensorBoard keeps float32

    # --resume (one more step) continues the same MLflow run
    res = dsv4("train", "--hardware", "cpu", "--tracker", "mlflow,tensorboard", "--run-dir", run, "--resume",
               "--steps", 3, "--lr", "3e-4", *FAST)
    assert res.exit_code == 0, res.output
    client, again = mlflow_run(run)
    assert again.info.run_id == mrun.info.run_id
    last = rows(run)[-1]
    assert last["step"] == 3
    same(history(client, again, "train/loss"), want["train/loss"] + [(3, last["loss"])], rel=1e-12)


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning_and_the_run_completes(tmp_path, mlflow_store,
                                                                                       monkeypatch):
    import mlflow

    from reporting.metrics import tensorboard_scalars

    real = mlflow.log_metrics

    def flaky(metrics, step=None, **kw):
        if step == 2:
            raise ConnectionError("tracking server went away")
        return real(metrics, step=step, **kw)

    monkeypatch.setattr(mlflow, "log_metrics", flaky)
    run = tmp_path / "run"
    res = dsv4("train", "--hardware", "cpu", "--tracker", "mlflow,tensorboard", "--run-dir", run, "--steps", 3,
               *FAST)
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if "--tracker mlflow failed" in ln]
    assert len(warnings) == 1 and "step 2" in warnings[0] and "tracking server went away" in warnings[0], res.stderr
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2, 3]                   # metrics.jsonl: every step
    client, mrun = mlflow_run(run)
    same(history(client, mrun, "train/loss"), [(1, got[0]["loss"])], rel=1e-12)
    assert [s for s, _ in tensorboard_scalars(run)["train/loss"]] == [1, 2, 3]   # the other tracker goes on
    assert (run / "hf").is_dir()                                   # the run finished: its export is written


def test_a_tracker_whose_library_is_missing_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch):
    from reporting import trackers

    monkeypatch.setitem(trackers._PACKAGES, "mlflow", ("dsv4_no_such_module", "mlflow"))
    run = tmp_path / "run"
    res = dsv4("train", "--hardware", "cpu", "--tracker", "mlflow", "--run-dir", run, "--steps", 1)
    line = one_line_error(res)
    assert "--tracker mlflow" in line and "pip install mlflow" in line
    assert not run.exists()
    with pytest.raises(UserInputError, match="--tracker mlflow: .*Fix: pip install mlflow"):   # the library entry point refuses too
        from core.config import preset
        from orchestration import run_training

        from ._impl_helpers import run_config

        run_training(run_config("miles", preset("tiny")), "tiny", mode="sft", steps=1, run_dir=run,
                     tracker=("mlflow",), progress=False, train_impl="reference")
    assert not run.exists()


def test_a_tracker_that_cannot_start_its_run_stops_the_start_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)   # MLflow refuses a file store without it
    run = tmp_path / "run"
    res = dsv4("train", "--hardware", "cpu", "--tracker", "mlflow", "--run-dir", run, "--steps", 1, *FAST)
    line = one_line_error(res)
    assert line.startswith("error: --tracker mlflow could not start its run (MlflowException:"), line
    assert not run.exists()


def test_tracker_none_from_a_config_file_writes_metrics_jsonl_only(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[train]\ntracker = ["none"]\nsave_every = 5\n')
    run = tmp_path / "run"
    res = dsv4("train", "--hardware", "cpu", "--config", cfg, "--run-dir", run, "--steps", 1, "--mode", "sft",
               "batch_size=2")
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in rows(run)] == [1]
    assert not (run / "tb").exists() and not (run / "trackers.json").exists()
    assert json.loads((run / "train_config.json").read_text())["train"]["tracker"] == ["none"]


@pytest.mark.parametrize("value", [(), ("tensorboard", "tensorboard"), ("none", "mlflow"), ("comet",), "mlflow"])
def test_bad_tracker_lists_are_refused_naming_the_choices(value):
    from core.config import ConfigError
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="'tracker' \\(--tracker\\).*tensorboard, wandb, mlflow, none"):
        TrainConfig(tracker=value)


def test_print_config_shows_the_trackers_of_the_command_line():
    res = dsv4("train", "--hardware", "cpu", "--tracker", "mlflow,tensorboard", "--tracker", "wandb", "--print-config")
    assert res.exit_code == 0, res.output
    assert 'tracker = ["mlflow", "tensorboard", "wandb"]' in res.stdout.splitlines()
    res = dsv4("train", "--hardware", "cpu", "--print-config")
    assert 'tracker = ["tensorboard"]' in res.stdout.splitlines()


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb without a server: offline mode, its settings and cache folders in the test's tmp dir."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")        # the log then holds no printed step lines
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_PROJECT", "dsv4-test")


def wandb_log(run_dir, run_id):
    """The bytes of the wandb run ``run_id``'s transaction log(s) (``run-ID.wandb``, protobuf records written
    by wandb's own service; one file per start of the run, so a resumed run has two)."""
    logs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert logs, sorted(p.name for p in (run_dir / "wandb").iterdir())
    return logs, b"".join(p.read_bytes() for p in logs)


def json_text(value: float) -> bytes:
    """A history value as wandb stores it (``value_json``: the value's JSON text)."""
    return json.dumps(value).encode()


def test_wandb_offline_holds_every_step_and_the_configuration_and_resume_continues_its_run(tmp_path,
                                                                                          wandb_offline):
    """wandb writes its run (offline: its service's transaction log in RUN_DIR/wandb); the log holds every
    scalar name, each step's fractional values as the JSON text wandb stores a history value as, and the resolved
    configuration; --resume continues the run with the same id (trackers.json)."""
    run = tmp_path / "run"
    res = dsv4("train", "--hardware", "cpu", "--tracker", "wandb", "--run-dir", run, "--steps", 2, *FAST)
    assert res.exit_code == 0, res.output
    assert "--tracker wandb failed" not in res.output
    run_id = json.loads((run / "trackers.json").read_text())["wandb"]
    logs, data = wandb_log(run, run_id)
    assert len(logs) == 1
    first = rows(run)
    assert [r["step"] for r in first] == [1, 2]
    for row in first:
        for key, value in expected_scalars(row).items():
            assert key.encode() in data, key
            if value != int(value) and key != "train/wall_time":    # a fraction: the JSON text is distinctive
                assert json_text(value) in data, (key, value)
    for key in ("max_new_tokens", "group_size", "prompts_per_step"):   # config keys, set from the command line
        assert key.encode() in data

    res = dsv4("train", "--hardware", "cpu", "--tracker", "wandb", "--run-dir", run, "--resume", "--steps", 3,
               *FAST)
    assert res.exit_code == 0, res.output
    assert json.loads((run / "trackers.json").read_text())["wandb"] == run_id
    logs, data = wandb_log(run, run_id)
    assert len(logs) == 2                      # the same run id, started again
    last = rows(run)[-1]
    assert last["step"] == 3 and json_text(last["grad_norm"]) in logs[-1].read_bytes()
