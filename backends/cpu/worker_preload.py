"""Imported by the forkserver that CPU ranks are forked from (``orchestration.local_workers``): the megatron-core CPU
shims, then the imports every rank makes, once for all of them. torch is held to one intra-op thread here, so
no OpenMP pool exists to be forked; each rank sets its own thread count (``orchestration.launch.init_rank``)."""

import torch

torch.set_num_threads(1)

from backends.cpu.megatron_shims import apply_megatron_cpu_shims  # noqa: E402

apply_megatron_cpu_shims()

import megatron.core  # noqa: E402,F401
import megatron.core.tensor_parallel  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
