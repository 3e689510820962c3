"""Each built-in backend package on its own: records, factories, behaviour.

Bazel runs this once per backend package (tests/BUILD.bazel), each target
depending on that package and core only, which also proves the package builds
without any other backend.
"""

import importlib

import pytest

from core.plugins import PluginHost
from core.records import AXES
from tests.runner import param

PACKAGE = param("package")
PLUGIN_MODULE = f"{PACKAGE}.plugin"


@pytest.fixture(scope="module")
def host():
    return PluginHost([PLUGIN_MODULE], third_party=False)


@pytest.fixture(scope="module")
def records(host):
    return [r for axis in AXES for r in host.records(axis)]


def test_the_package_registers_records_by_itself(records):
    assert records, f"{PLUGIN_MODULE} registered nothing"
    for record in records:
        assert record.provider == "dsv4"
        assert record.description and len(record.description) < 160


def test_the_package_imports_no_other_backend():
    import sys

    importlib.import_module(PLUGIN_MODULE)
    others = {"backends.miles", "backends.megatron", "backends.nvidia", "backends.rocm", "backends.cpu"} - {PACKAGE}
    assert not [m for m in sys.modules if any(m == o or m.startswith(o + ".") for o in others)]


def test_factories_import_and_behave_as_documented(records):
    for record in records:
        factory = record.load()
        if PACKAGE in ("backends.miles", "backends.megatron"):
            # model building is tested against the reference in tests/impl_*
            assert factory.__name__ == "build_model" and factory.__module__ == f"{PACKAGE}.impl"
        elif PACKAGE == "backends.cpu":
            import torch

            assert factory().device() == torch.device("cpu")
            assert factory.distributed_backend == "gloo"
        elif PACKAGE in ("backends.nvidia", "backends.rocm"):
            assert factory.distributed_backend == "nccl"


def test_availability_probe_matches_this_machine(records):
    import torch

    for record in records:
        reason = record.unavailable_reason()
        if record.name == "nvidia":
            assert (reason is None) == (torch.version.cuda is not None and torch.cuda.is_available())
        elif record.name == "rocm":
            assert (reason is None) == (getattr(torch.version, "hip", None) is not None and torch.cuda.is_available())
        else:
            assert reason is None


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
