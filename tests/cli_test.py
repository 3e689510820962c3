"""The launcher's behaviour: shared options, honest stages, paths, help."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from launchers import stages
from launchers.cli import main


def invoke(*args, **kw):
    return CliRunner().invoke(main, list(args), **kw)


def test_options_after_the_subcommand_override_those_before():
    result = invoke("--impl", "megatron", "validate", "--json", "--impl", "miles")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["impl"] == "miles"
    result = invoke("--impl", "megatron", "validate", "--json")
    assert json.loads(result.stdout)["impl"] == "megatron"
    assert json.loads(result.stdout)["qkv_format"] == "thd"


def test_validate_probes_the_machine_unless_told_not_to():
    assert invoke("validate", "--no-probe", "--hardware", "nvidia").exit_code == 0
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the probe would pass")
    result = invoke("validate", "--hardware", "nvidia")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --hardware nvidia is not usable on this machine: ")


def test_every_subcommand_documents_the_shared_options():
    for name in main.commands:
        result = invoke(name, "--help")
        assert result.exit_code == 0, name
        for option in ("--impl", "--kernel-backend", "--quant", "--hardware", "--tp", "--cp", "--qkv-format"):
            assert option in result.output, (name, option)


def test_relative_paths_resolve_against_the_users_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert stages.user_path("ckpt") == tmp_path / "ckpt"
    assert stages.user_path("/abs/ckpt") == Path("/abs/ckpt")
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY")
    assert stages.user_path("ckpt") == Path(os.getcwd()) / "ckpt"


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)


# ---------------------------------------------------------------- refusals: one line, with its fix
def _fail_calls_without_fix():
    """The literal messages of launchers/cli.py's refusals (``_fail(...)`` calls) that carry no ``Fix:``."""
    import ast

    import launchers.cli as cli

    tree = ast.parse(Path(cli.__file__).read_text(encoding="utf-8"))
    missing, literal = [], 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_fail":
            message = node.args[0]
            if isinstance(message, (ast.Constant, ast.JoinedStr)):
                literal += 1
                text = "".join(v.value for v in ast.walk(message) if isinstance(v, ast.Constant) and isinstance(v.value, str))
                if "Fix:" not in text:
                    missing.append((node.lineno, text))
    return literal, missing


def test_every_written_refusal_of_the_launcher_names_its_fix():
    literal, missing = _fail_calls_without_fix()
    assert literal >= 10            # the walk finds the launcher's refusals
    assert not missing, missing


REFUSED = [
    ("-q", "-v", "plugins"),
    ("plugins", "-q", "-v"),
    ("train", "learning_rate=1e-3", "--print-config"),
    ("train", "num_steps=3", "--print-config"),
    ("train", "global_batch_size=8", "--print-config"),
    ("train", "rollout_batch_size=4", "--print-config"),
    ("train", "grup_size=4", "--print-config"),
    ("train", "no_such_key=1", "--print-config"),
    ("train", "--resume", "--print-config"),
    ("train", "--ray-address", "auto", "--print-config"),
    ("prepare", "--preset", "tiny"),
    ("prepare", "--hf-revision", "main", "--out", "x"),
    ("prepare", "--hf-repo", "a/b", "--seed", "1"),
]


@pytest.mark.parametrize("args", REFUSED, ids=" ".join)
def test_each_refusal_is_one_line_with_its_fix(args):
    result = invoke(*args)
    assert result.exit_code == 2, (args, result.output)
    lines = result.stderr.strip().splitlines()      # (an info line such as the detected hardware may come first)
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:], result.stderr
    assert "Fix: " in errors[0], errors[0]


def test_other_trainers_names_are_refused_with_dsv4s():
    for theirs, ours in (("learning_rate", "lr"), ("num_steps", "steps"), ("rollout_batch_size", "prompts_per_step"),
                         ("num_generations", "group_size")):
        err = invoke("train", f"{theirs}=1", "--print-config").stderr
        assert f"did you mean {ours!r}?" in err and f"Fix: write {ours}=..." in err, err


def test_hardware_nvidia_without_a_gpu_names_its_fix():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the probe would pass")
    result = invoke("validate", "--hardware", "nvidia")
    assert result.exit_code == 2
    assert "Fix: run on a machine with that hardware" in result.stderr and "--hardware cpu" in result.stderr


@pytest.mark.parametrize("flag", ["--debug", "-q", "-v"])
def test_output_flags_after_the_subcommand(flag):
    result = invoke("validate", "--json", flag)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["impl"] == "miles"


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path):
    """A failure is one line without --debug, the traceback with it, before or after the subcommand."""
    args = ("plot", str(tmp_path))            # a folder without metrics.jsonl
    plain = invoke(*args)
    assert plain.exit_code == 1 and plain.stderr.startswith("error: "), plain.output
    try:
        for where in (("--debug", *args), (*args, "--debug")):
            result = invoke(*where)
            assert isinstance(result.exception, FileNotFoundError), (where, result.output)
    finally:
        from launchers.errors import set_debug

        set_debug(False)
