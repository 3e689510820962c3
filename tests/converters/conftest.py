"""Converter tests: the `gpu` marker (GPU tests skip with the reason on a machine without CUDA/triton)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and triton; skipped elsewhere")
