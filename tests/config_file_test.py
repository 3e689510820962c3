"""`dsv4 train --config FILE [KEY=VALUE ...]` (issue #21, item 6): every TrainConfig field is a key (generated
from the dataclass), a TOML file drives a short CPU run end to end, the run folder's train_config.json
reloads to the same TrainConfig, the precedence is defaults < file < command-line options < KEY=VALUE, and a
bad key or value is one line naming it (the nearest valid key for a misspelling)."""

import dataclasses
import json
import tomllib
import types
import typing

import pytest
from click.testing import CliRunner

from launchers import config_file
from launchers.cli import full_train_cmd, main, train_cmd
from train.trainer import TrainConfig

FIELDS = dataclasses.fields(TrainConfig)
HINTS = typing.get_type_hints(TrainConfig)


def dsv4(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def printed_config(*args) -> dict:
    res = dsv4("train", "--print-config", *args)
    assert res.exit_code == 0, res.output
    return tomllib.loads(res.stdout)


def one_line_error(res, code=2) -> str:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0]


def _changed(tp, default):
    """A value of type ``tp`` other than ``default``, or None when the type is not one we can vary."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if default is not None:
            return None                                   # an optional field with a value: None differs
        return _changed(inner[0], None)
    if tp is bool:
        return not default
    if tp is int:
        return (default or 0) + 3
    if tp is float:
        return (default or 0.0) + 0.25
    if tp is str:
        return (default or "") + "x"
    if origin is typing.Literal:
        return next((a for a in args if a != default), default)
    if tp in (tuple, list) or origin in (tuple, list):
        container = tuple if tuple in (tp, origin) else list
        if args and not (len(args) == 2 and args[1] is Ellipsis):
            return container(_changed(a, None) for a in args)
        if args:
            return container([_changed(args[0], None)] * 2)
        return container(x / 2 for x in default) if default else container((1, 2))
    return default


def _text(value) -> str:
    """``value`` as a KEY=VALUE argument writes it."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)):
        return ",".join(_text(x) for x in value)
    return config_file._toml_value(value)


@pytest.mark.parametrize("command", (train_cmd, full_train_cmd), ids=("train", "full-train"))
def test_every_train_config_field_is_a_key_parsed_by_its_type(command):
    keys = config_file.settings(command)
    for field in FIELDS:
        assert keys[field.name].train_field, field.name
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        value = _changed(HINTS[field.name], default)
        got = config_file.resolve(command, config=None, cli={}, overrides=[f"{field.name}={_text(value)}"])
        assert got == {field.name: value}, (field.name, value, got)
    # the run's choices and the job's options are keys too (generated from the command's options)
    assert {"impl", "kernel_backend", "quant", "hardware", "dtype", "tp", "cp", "ep", "model", "mode", "steps",
            "run_dir", "resume"} <= set(keys)
    assert "compile" not in keys and "config" not in keys and "print_config" not in keys


@dataclasses.dataclass(frozen=True)
class _Grown(TrainConfig):
    """TrainConfig with fields added later (as another change adds batch sizes and sampling knobs)."""

    micro_batch_size: typing.Optional[int] = None
    global_batch_size: int = 8
    stop_strings: typing.Tuple[str, ...] = ()
    top_k: int = -1


def test_a_field_added_to_train_config_is_a_key_without_edits(monkeypatch):
    monkeypatch.setattr(config_file, "train_config_type", lambda: _Grown)
    got = config_file.resolve(train_cmd, config=None, cli={}, overrides=[
        "micro_batch_size=2", "global_batch_size=16", "stop_strings=</s>,###", "top_k=20"])
    assert got == {"micro_batch_size": 2, "global_batch_size": 16, "stop_strings": ("</s>", "###"), "top_k": 20}
    cfg = printed_config("micro_batch_size=2", "top_k=20")["train"]
    assert (cfg["micro_batch_size"], cfg["global_batch_size"], cfg["stop_strings"], cfg["top_k"]) == (2, 8, [], 20)
    assert "unknown key 'top_kk'" in one_line_error(dsv4("train", "top_kk=3"))


def test_print_config_lists_every_field_and_reads_back_unchanged(tmp_path):
    printed = printed_config()
    train = printed["train"]
    assert {f.name for f in FIELDS} <= set(train) | set(printed["run"])
    path = tmp_path / "all.toml"
    path.write_text(dsv4("train", "--print-config").stdout)
    assert printed_config("--config", path) == printed
    values = config_file.resolve(train_cmd, config=path, cli={}, overrides=[])
    assert TrainConfig(**{f.name: values[f.name] for f in FIELDS}) == TrainConfig()


def test_precedence_defaults_file_options_key_value(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('impl = "megatron"\nlr = 0.1\n\n[train]\ngroup_size = 3\nsteps = 5\n')
    cfg = printed_config("--config", path)
    assert (cfg["run"]["impl"], cfg["train"]["lr"], cfg["train"]["group_size"], cfg["train"]["steps"]) == \
        ("megatron", 0.1, 3, 5)
    assert cfg["train"]["seed"] == 0                                   # not in the file: the default
    cfg = printed_config("--config", path, "--lr", "0.2", "--impl", "miles")
    assert (cfg["run"]["impl"], cfg["train"]["lr"]) == ("miles", 0.2)  # options given win over the file
    res = dsv4("--impl", "miles", "train", "--print-config", "--config", path)
    assert tomllib.loads(res.stdout)["run"]["impl"] == "miles"         # ... also before the subcommand
    cfg = printed_config("--config", path, "--lr", "0.2", "lr=0.3", "group-size=6", "impl=megatron")
    assert (cfg["run"]["impl"], cfg["train"]["lr"], cfg["train"]["group_size"]) == ("megatron", 0.3, 6)


@pytest.mark.parametrize("content, args, words", [
    ("grup_size = 3\n", (), ("unknown key 'grup_size'", "did you mean 'group_size'?", "--print-config")),
    ("[trian]\nlr = 1.0\n", (), ("unknown section [trian]", "did you mean [train]?")),
    ("lr = 'fast'\n", (), ("key 'lr' = 'fast'", "expected a number")),
    ("lr = \n", (), ("not valid TOML",)),
    ("", ("stepz=2",), ("unknown key 'stepz'", "did you mean 'steps'?")),
    ("", ("mode=rl",), ("key 'mode' = 'rl'", "'rl' is not one of 'sft', 'grpo'")),
    ("", ("routing_replay=maybe",), ("key 'routing_replay' = 'maybe'", "expected true or false")),
    ("", ("lr",), ("unexpected argument 'lr'", "KEY=VALUE")),
])
def test_a_bad_key_or_value_is_one_line_naming_it(tmp_path, content, args, words):
    path = tmp_path / "run.toml"
    path.write_text(content)
    line = one_line_error(dsv4("train", "--config", path, *args, "--run-dir", tmp_path / "r"))
    for w in words:
        assert w in line, line
    assert not (tmp_path / "r").exists()


def test_a_missing_or_unknown_kind_of_file_is_one_line(tmp_path):
    assert "no such file" in one_line_error(dsv4("train", "--config", tmp_path / "nope.toml"))
    (tmp_path / "run.yaml").write_text("lr: 1\n")
    assert "use a .toml or .json file" in one_line_error(dsv4("train", "--config", tmp_path / "run.yaml"))


def test_a_toml_file_drives_a_cpu_run_and_the_saved_config_reloads(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nimpl = "miles"\nhardware = "cpu"\n\n'
                    '[train]\nmode = "grpo"\nsteps = 5\nprompts_per_step = 2\ngroup_size = 3\n'
                    'max_new_tokens = 4\nlr = 2e-4\nbetas = [0.8, 0.9]\nsave_every = 1\nkeep_last = 1\n'
                    'export_at_end = false\n')
    run = tmp_path / "run"
    res = dsv4("train", "--config", path, "--run-dir", run, "steps=2", "temperature=0.9")
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]                          # steps=2 wins over the file's 5
    assert all(0.0 <= r["zero_variance_group_frac"] <= 1.0 for r in rows)
    saved = json.loads((run / "train_config.json").read_text())
    want = TrainConfig(prompts_per_step=2, group_size=3, max_new_tokens=4, lr=2e-4, betas=(0.8, 0.9),
                       save_every=1, keep_last=1, export_at_end=False, temperature=0.9)
    assert saved["train"] == want.to_json()
    assert (saved["run"]["impl"], saved["run"]["hardware"]) == ("miles", "cpu")

    # the resolved configuration is printed at the start; the step lines keep their phase timings
    assert "config: train seed=0 lr=0.0002" in res.stderr
    assert "[rollout " in res.stderr and " s/step  ETA " in res.stderr
    # ... and the same lines are in the run folder's log file
    log = (run / "train.log").read_text()
    assert "config: run   impl=miles" in log and "config: train seed=0 lr=0.0002" in log
    steps = [ln for ln in log.splitlines() if " INFO    step " in ln]
    assert [ln.split(" INFO    ")[1].split()[1] for ln in steps] == ["1/2", "2/2"]
    assert all("[rollout " in ln and "zero-var groups " in ln for ln in steps)

    # the saved config loads back as a config: the same TrainConfig and choices, in a new run
    again = tmp_path / "again"
    res = dsv4("train", "--config", run / "train_config.json", "--run-dir", again, "steps=1")
    assert res.exit_code == 0, res.output
    resaved = json.loads((again / "train_config.json").read_text())
    assert resaved["train"] == saved["train"] and resaved["mode"] == saved["mode"]
    assert resaved["run"] == saved["run"]
    values = config_file.resolve(train_cmd, config=run / "train_config.json", cli={}, overrides=[])
    assert TrainConfig(**{f.name: values[f.name] for f in FIELDS}) == want


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
