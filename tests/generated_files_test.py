"""The generated test matrix and README table match the combination table."""

import os
from pathlib import Path

from core.combinations import supported_combinations
from launchers import generated
from launchers.builtin_plugins import make_host

ROOT = Path(os.path.abspath(__file__)).parent.parent
REGENERATE = "bazel run //launchers:dsv4 -- combinations --write-bzl tests/combinations.bzl --write-readme README.md"


def _host():
    return make_host(third_party=False)


def _combos():
    return supported_combinations(_host())


def test_bazel_matrix_is_current():
    current = (ROOT / "tests" / "combinations.bzl").read_text(encoding="utf-8")
    assert current == generated.combinations_bzl(_combos()), f"tests/combinations.bzl is stale; run: {REGENERATE}"


def test_readme_tables_are_current():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    expected = generated.replace_readme_tables(readme, _combos(), _host())
    assert readme == expected, f"README.md's generated tables are stale; run: {REGENERATE}"


def test_cli_doc_equals_the_help_of_every_command():
    from launchers.cli import main

    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert doc == generated.replace_cli_reference(doc, main), (
        "docs/cli.md's option reference differs from `dsv4 COMMAND --help`; run: "
        "python -m launchers.cli_doc docs/cli.md")


def test_cli_doc_reference_holds_each_help_text():
    """The generated reference is the help text itself: every option of every command, as `--help` says it."""
    import click

    from launchers.cli import main

    text = generated.cli_reference_markdown(main)
    ctx = click.Context(main, info_name="dsv4")
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert f"### `dsv4 {name} " in text
        for param in command.params:
            if isinstance(param, click.Option) and param.help:
                assert " ".join(param.help.split()).replace("|", "\\|") in text, (name, param.name)


def test_matrix_has_cpu_rows_for_both_implementations():
    cpu = {(c.impl, c.kernel_backend) for c in _combos() if not c.gpu}
    assert cpu == {("miles", "none"), ("megatron", "none")}


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
