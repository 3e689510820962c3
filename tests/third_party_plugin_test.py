"""Third-party plugins and the installed console script, in real environments.

The example distribution (examples/dsv4_example_plugin) is pip-installed into a
temporary folder; its entry point must then be discovered by `dsv4 plugins
--json`, selectable, and subject to the combination table. The repo itself is
pip-installed the same way to check that its `dsv4` console script is the same
program as `python -m launchers.dsv4` (what `bazel run //launchers:dsv4` runs).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RUNFILES_ROOT = Path(os.path.abspath(__file__)).parent.parent
EXAMPLE = RUNFILES_ROOT / "examples" / "dsv4_example_plugin"
REPO_PACKAGES = ("core", "backends", "kernels", "converters", "engine", "launchers", "orchestration", "reporting", "rollout", "train")


def _pip_install(source: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True,
        timeout=300,
    )


def _copy_tree(src: Path, dst: Path) -> Path:
    """Copy out of the (read-only, symlinked) runfiles tree so pip can build."""
    shutil.copytree(src, dst, symlinks=False, ignore=shutil.ignore_patterns("BUILD.bazel", "__pycache__"))
    return dst


def _dsv4(args, pythonpath, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    env.pop("DSV4_NO_THIRD_PARTY_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "launchers.cli", *args], capture_output=True, text=True, env=env, timeout=120, **kw)


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    work = tmp_path_factory.mktemp("plugin")
    _pip_install(_copy_tree(EXAMPLE, work / "src"), work / "site")
    return work / "site"


def _base_path():
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] or [str(RUNFILES_ROOT)]


def test_installed_plugin_is_listed_with_its_distribution(plugin_site):
    proc = _dsv4(["plugins", "--json", "--no-probe"], [plugin_site, *_base_path()])
    assert proc.returncode == 0, proc.stderr
    kernels = {e["name"]: e for e in json.loads(proc.stdout)["kernel_backend"]}
    assert kernels["example-ref"]["distribution"] == "dsv4-example-plugin"
    assert kernels["example-ref"]["capabilities"] == {"deterministic": False, "dtypes": None, "hardware": ["cpu"],
                                                     "impls": ["miles"], "attention_head_dims": None,
                                                     "attention_heads_multiple": 1}
    assert kernels["none"]["distribution"] == "dsv4"


def test_installed_plugin_can_be_selected(plugin_site):
    proc = _dsv4(["validate", "--json", "--kernel-backend", "example-ref"], [plugin_site, *_base_path()])
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert config["kernel_backend"] == "example-ref"
    assert config["providers"]["kernel_backend"] == "dsv4-example-plugin"


def test_installed_plugin_obeys_the_combination_table(plugin_site):
    proc = _dsv4(["validate", "--impl", "megatron", "--kernel-backend", "example-ref"], [plugin_site, *_base_path()])
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: --kernel-backend example-ref does not serve --impl megatron (it serves: miles). "
        "Fix: use --impl miles, or with --impl megatron on cpu choose --kernel-backend none.\n"
    )
    proc = _dsv4(["validate", "--kernel-backend", "example-ref", "--hardware", "nvidia"], [plugin_site, *_base_path()])
    assert proc.returncode == 2
    assert "--kernel-backend example-ref does not run on --hardware nvidia (it runs on: cpu)." in proc.stderr


def test_plugin_is_invisible_when_third_party_plugins_are_disabled(plugin_site):
    proc = _dsv4(["--no-third-party-plugins", "plugins", "--json", "--no-probe"], [plugin_site, *_base_path()])
    assert proc.returncode == 0, proc.stderr
    assert "example-ref" not in {e["name"] for e in json.loads(proc.stdout)["kernel_backend"]}


def test_console_script_is_the_same_program(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for package in REPO_PACKAGES:
        _copy_tree(RUNFILES_ROOT / package, src / package)
    shutil.copy(RUNFILES_ROOT / "pyproject.toml", src / "pyproject.toml")
    shutil.copy(RUNFILES_ROOT / "README.md", src / "README.md")
    site = tmp_path / "site"
    _pip_install(src, site)
    script = site / "bin" / "dsv4"
    assert script.exists()
    env = {**os.environ, "PYTHONPATH": str(site)}
    args = ["validate", "--json", "--impl", "megatron"]
    installed = subprocess.run([str(script), *args], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    from_repo = _dsv4(args, _base_path())
    assert installed.stdout == from_repo.stdout
    # and the installed copy really is the one running
    where = subprocess.run(
        [sys.executable, "-c", "import launchers.cli as c; print(c.__file__)"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert where.stdout.strip().startswith(str(site))


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
