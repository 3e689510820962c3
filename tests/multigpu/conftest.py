"""Multi-GPU tests: the `multigpu` marker (they skip with the reason unless 2+ CUDA devices are visible).

NVLink multicast stays off (the lent machines' rule: it can take a shared host's GPUs out of service);
the variables are set here so that the spawned ranks inherit them."""

import os

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)


def pytest_configure(config):
    config.addinivalue_line("markers", "multigpu: needs 2+ CUDA GPUs of one host (NCCL); skipped elsewhere")
