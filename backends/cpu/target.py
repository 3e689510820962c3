"""The CPU hardware target: device, process group and megatron-core shims.

Everything a CPU run needs before a model is built happens in ``setup`` and
``init_process_group``, called explicitly by the job (never as a side effect
of importing a model): megatron-core's CPU shims (see megatron_shims.py) and a
gloo process group with megatron's parallel state.
"""

import torch


class CpuTarget:
    """Runs on the host CPU; several ranks talk over gloo."""

    distributed_backend = "gloo"
    # local ranks fork from a server that imported the shims and megatron-core once (orchestration.local_workers)
    local_worker_start = "forkserver"
    worker_preload = ("backends.cpu.worker_preload",)

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def setup(self) -> None:
        """Make megatron-core importable and usable on the CPU (idempotent)."""
        from backends.cpu.megatron_shims import apply_megatron_cpu_shims

        apply_megatron_cpu_shims()

    def init_process_group(self, rank: int = 0, world_size: int = 1, *, tp: int = 1, cp: int = 1, ep: int = 1,
                           pp: int = 1,
                           port: int | None = None, seed: int = 1234, master_addr: str | None = None,
                           local_rank: int | None = None, store=None):
        """gloo process group plus megatron's model-parallel groups for this rank (``MASTER_ADDR``: the
        argument, the environment, or this machine; ``store``: the c10d store the ranks met on, if any); returns
        this rank's layout (``engine.layout``)."""
        import os

        from backends.cpu.megatron_shims import init_cpu_process_group

        self.setup()
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        return init_cpu_process_group(rank, world_size, tp=tp, pp=pp, cp=cp, ep=ep, port=port, seed=seed, master_addr=addr,
                                      store=store)

    def destroy_process_group(self) -> None:
        """Tear down megatron's parallel groups and the gloo process group (the nvidia target's counterpart)."""
        from backends.cpu.megatron_shims import destroy_cpu_process_group

        destroy_cpu_process_group()
