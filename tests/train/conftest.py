"""Fixtures of the training tests."""

import shutil
import tempfile

import pytest
import torch


@pytest.fixture(autouse=True)
def _two_threads():
    """At most two intra-op threads per test (the CI machine has two cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped elsewhere")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module (4 logical CPUs, no dashboard, a short session folder under /tmp:
    Ray's socket paths have a length limit): its GCS address, for ``--ray-address``."""
    import ray

    folder = tempfile.mkdtemp(prefix="dsv4ray", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=folder, configure_logging=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
