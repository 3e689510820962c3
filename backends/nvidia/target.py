"""The NVIDIA hardware target: CUDA devices and NCCL process groups.

Everything a GPU run needs before a model is built happens in ``setup`` and ``init_process_group``,
called explicitly by the job (as on the CPU target, ``backends/cpu/target.py``):

* ``setup()``: fp32 matmuls and convolutions stay full fp32 (TF32 off: ``torch.backends.cuda.matmul.
  allow_tf32 = False``, ``torch.backends.cudnn.allow_tf32 = False``), so an fp32 run matches the CPU
  reference to fp32 rounding; bf16 / fp16 work is unaffected. Sets ``CUDA_DEVICE_MAX_CONNECTIONS=1``
  (megatron-core's requirement for overlapping TP communication) if unset. No megatron-core shim is
  needed on a CUDA host (triton is real there).
* ``init_process_group(rank, world_size, tp=, cp=, ep=, port=, seed=, master_addr=, local_rank=)``: binds
  this process to ``cuda:LOCAL_RANK``, starts an NCCL process group and megatron's model-parallel groups,
  and seeds megatron's CUDA RNG tracker (``model_parallel_cuda_manual_seed``).

Linear layers are plain torch / megatron-core ones: Transformer Engine is not used by this target (FP8
training of the linears through it is not built).
"""

import os
from typing import Optional

import torch



def unavailable_reason() -> Optional[str]:
    """None when a CUDA device is visible, else why not."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


class NvidiaTarget:
    """One CUDA device per local rank; ranks talk over NCCL."""

    distributed_backend = "nccl"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cuda", local_rank)

    def setup(self) -> None:
        """TF32 off for fp32 matmuls / convolutions; ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (idempotent)."""
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    def init_process_group(self, rank: int = 0, world_size: int = 1, *, tp: int = 1, cp: int = 1, ep: int = 1,
                           pp: int = 1,
                           port: Optional[int] = None, seed: int = 1234, master_addr: Optional[str] = None,
                           local_rank: Optional[int] = None, store=None):
        """NCCL process group plus megatron's model-parallel groups for this rank (idempotent for the
        same world); returns this rank's layout (``engine.layout``). ``MASTER_PORT`` comes from ``port`` or the environment (world size 1: an in-memory store);
        ``MASTER_ADDR`` from ``master_addr``, the environment, or this machine. The device is
        ``cuda:local_rank`` (default: ``LOCAL_RANK``, else ``rank % device_count``)."""
        import torch.distributed as dist

        self.setup()
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"the nvidia target cannot run here: {reason}")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        local = local_rank
        torch.cuda.set_device(local)
        from megatron.core import tensor_parallel

        from engine.layout import initialize

        if not dist.is_initialized():
            os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            if store is None and world_size == 1 and port is None:
                store = dist.HashStore()   # one process (MASTER_PORT set or not): no TCP port to race for
            if port is not None:
                os.environ["MASTER_PORT"] = str(port)
            elif "MASTER_PORT" not in os.environ and store is None:
                raise ValueError("NvidiaTarget.init_process_group: pass port= (or set MASTER_PORT) "
                                 "for world_size > 1")
            if store is not None:      # the ranks met on it already (orchestration.dist_env.rendezvous)
                dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                        device_id=self.device(local))
            else:
                dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=self.device(local))
        layout = initialize(tp, pp=pp, cp=cp, ep=ep)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return layout

    def destroy_process_group(self) -> None:
        import torch.distributed as dist

        from engine.layout import destroy

        destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
