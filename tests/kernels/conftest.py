"""GPU kernel tests: the `gpu` marker (they skip with the reason on a machine without CUDA)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the backend's package (triton, tilelang); skipped elsewhere")
