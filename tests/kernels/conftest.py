"""GPU kernel tests: the `gpu` marker (they skip with the reason on a machine without CUDA)."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the backend's package (triton, tilelang); skipped elsewhere")


@pytest.fixture
def needs_backend(backend):
    """Skip the case (with the reason) when CUDA or the backend's package is missing."""
    from ._backends import missing

    reason = missing(backend)
    if reason:
        pytest.skip(reason)
