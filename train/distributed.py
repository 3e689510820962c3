"""Context-parallel (CP) training: one local process per CP rank (gloo on the CPU).

Design (``run_training`` with ``run_config.cp > 1``):

* :func:`train.trainer.spawn_training` starts ``cp`` processes with ``torch.multiprocessing.spawn`` (like
  ``launchers.scoring.score_packed``); each is set up by the run's hardware target
  (``init_process_group(rank, cp, tp=1, cp=cp, port=...)``), builds the model, loads the same weights
  and runs the same loop. Every rank feeds its contiguous slice of each packed micro-batch
  (:meth:`train.model.ImplTrainModel.forward_train` with ``lengths``).
* Log-probs (and MTP logits) of the local rows are all-gathered so that every rank computes the SAME
  full loss; the gather's backward keeps only this rank's rows, so each rank's parameter gradients are
  its tokens' share and the implementations' autograd-aware CP collectives carry the cross-rank terms.
  :meth:`CpGroup.all_reduce_grads` SUMS the replicated parameters' gradients over the CP group, which
  gives exactly the cp=1 gradient (a parameter no rank touched keeps ``grad None``, as with cp=1).
* Rank 0 alone owns the rollout engine and all file I/O (run config, metrics, checkpoints, export);
  the rollout samples are broadcast to the other ranks (``broadcast_object_list``).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist


class CpGroup:
    """This process's place in the CP group (``cp == 1``: a no-op stand-in)."""

    def __init__(self, cp: int = 1, rank: int = 0, group: Any = None):
        self.cp, self.rank, self.group = cp, rank, group

    @classmethod
    def current(cls) -> "CpGroup":
        """From megatron's parallel state (set up by the hardware target); cp 1 without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        from engine.thd_attention import cp_group_info

        return cls(*cp_group_info())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.cp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.cp > 1:
            dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_reduce_grads(self, params: List[torch.nn.Parameter]) -> None:
        """Sum the gradients over the CP group (each rank holds its tokens' share)."""
        if self.cp == 1 or not params:
            return
        have = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        dist.all_reduce(have, group=self.group)
        for p, h in zip(params, have.tolist()):
            if h == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)


def needs_spawn(run_config) -> bool:
    """True when ``run_config`` asks for CP and this process is not already one of its ranks."""
    if run_config is None or int(getattr(run_config, "cp", 1)) <= 1:
        return False
    from engine.thd_attention import cp_group_info

    return not (dist.is_available() and dist.is_initialized() and cp_group_info()[0] == int(run_config.cp))


def pad_rule(model_config, cp: int) -> tuple:
    """``(pad_multiple, min_tokens_per_rank)`` of a packed stream for this model and CP size."""
    from core.packing import required_min_tokens_per_rank, required_pad_multiple

    ratios = [r for r in (model_config.compress_ratios or ()) if r]
    return required_pad_multiple(cp, ratios), required_min_tokens_per_rank(cp, ratios)


def pack(lengths: List[int], model_config, cp: int, max_tokens_per_rank: Optional[int]):
    """``core.packing.pack_micro_batches`` with the model's pad rule; ``None`` budget = one micro-batch."""
    from core.packing import pack_micro_batches

    mult, min_rank = pad_rule(model_config, cp)
    if max_tokens_per_rank is None:
        m = mult * cp
        max_tokens_per_rank = -(-(sum(lengths) + m) // cp) + m + min_rank
    return pack_micro_batches(lengths, int(max_tokens_per_rank), cp=cp, pad_multiple=mult,
                              min_tokens_per_rank=min_rank)
