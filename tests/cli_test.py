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
