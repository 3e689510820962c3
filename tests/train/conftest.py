"""Fixtures of the training tests."""

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
