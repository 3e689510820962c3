"""Multi-GPU tests: the `multigpu` marker (they skip with the reason unless 2+ CUDA devices are visible)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "multigpu: needs 2+ CUDA GPUs of one host (NCCL); skipped elsewhere")
