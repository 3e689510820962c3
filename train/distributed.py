"""The trainer's ranks: data, tensor, context and expert parallel groups, and how work splits over them.

Layout (``world = dp x tp x cp x pp``, cp 1 with pp; checked at parse time by the combination table's
``train-layout`` rule): the hardware target builds this rank's layout (``engine.layout``), and
:class:`ParallelGroups` is the trainer's view of it:

* **data parallel** (``dp``): each data-parallel rank trains on its own share of the step's samples (SFT
  sequences, GRPO prompt groups: contiguous chunks, so the global order is the same for every layout).
  Losses are normalized by the step's GLOBAL token count and gradients are SUMMED over data parallel, so the
  update equals the one-rank update (:mod:`train.optim`).
* **expert parallel** (``ep``): runs inside data parallel (megatron's expert-model-parallel groups): the routed
  experts are split over ``ep`` data-parallel ranks, whose tokens travel to their expert's rank and back
  (``engine.expert_parallel``); expert gradients are summed over the expert-data-parallel group.
* **tensor and context parallel** (``tp``, ``cp``; the "model-parallel" ranks of one data-parallel rank): every
  rank of the group sees the same samples (generated once, by the group's leader, and broadcast). Context
  parallel splits each packed (THD) micro-batch contiguously; log-probs are all-gathered so that every CP rank
  computes the SAME full loss, the gather's backward keeps only this rank's rows, and the replicated
  parameters' gradients are summed over the CP group too (megatron's data-parallel-with-context group).

The leader of each data-parallel rank (tensor- and context-parallel rank 0) owns a rollout engine; global rank 0
alone does file I/O (run config, metrics, export), except checkpoints, which every rank writes its share of
(:mod:`train.checkpointing`).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist


class ParallelGroups:
    """This process's place in the run's layout (one process: every size 1, no communication)."""

    def __init__(self, *, rank: int = 0, world: int = 1, dp: int = 1, dp_rank: int = 0, tp: int = 1,
                 tp_rank: int = 0, cp: int = 1, cp_rank: int = 0, ep: int = 1, groups: Optional[dict] = None,
                 pp: int = 1, pp_rank: int = 0):
        self.rank, self.world = rank, world
        self.dp, self.dp_rank, self.tp, self.tp_rank = dp, dp_rank, tp, tp_rank
        self.cp, self.cp_rank, self.ep, self.pp, self.pp_rank = cp, cp_rank, ep, pp, pp_rank
        self._groups = groups or {}

    @classmethod
    def of(cls, layout) -> "ParallelGroups":
        """The trainer's view of this rank's layout (``engine.layout.ParallelLayout``, built by the hardware
        target); all ones on one rank."""
        if layout.world == 1:
            return cls()
        # the ranks sharing samples: tensor x context parallel, or tensor x pipeline parallel (--pp: cp 1)
        share = layout.group("tp_pp") if layout.pp > 1 else layout.group("tp_cp")
        groups = {"dp": layout.group("dp"), "cp": layout.group("cp"), "tp_cp": share}
        return cls(rank=layout.rank, world=layout.world, dp=layout.dp, dp_rank=layout.dp_rank, tp=layout.tp,
                   tp_rank=layout.tp_rank, cp=layout.cp, cp_rank=layout.cp_rank, ep=layout.ep, groups=groups,
                   pp=layout.pp, pp_rank=layout.pp_rank)

    @classmethod
    def current(cls) -> "ParallelGroups":
        """Of this process's layout (``engine.layout.current``); all ones without a process group."""
        from engine.layout import current

        return cls.of(current())

    # -- roles -------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes the run folder."""
        return self.rank == 0

    @property
    def is_leader(self) -> bool:
        """Tensor- and context-parallel rank 0 of its data-parallel rank: owns a rollout engine."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == 0

    def share(self, items: Sequence) -> list:
        """This data-parallel rank's contiguous share of the step's ``items`` (the count divides evenly:
        checked when the run starts, :func:`check_divisible`)."""
        n = len(items) // self.dp
        return list(items[self.dp_rank * n:(self.dp_rank + 1) * n])

    # -- communication -------------------------------------------------------
    def broadcast_world(self, obj):
        """Global rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_from_leader(self, obj):
        """The leader's ``obj`` on every rank of its tensor x context group (the ranks sharing samples)."""
        if self.tp * self.cp * self.pp == 1:
            return obj
        group = self._groups["tp_cp"]
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def sum_over_dp(self, values: List[float]) -> List[float]:
        """Elementwise sum of per-rank floats over data parallel (fp64 on the CPU: exact for counts)."""
        if self.dp == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=collective_device())
        dist.all_reduce(t, group=self._groups["dp"])
        return t.tolist()

    def gather_over_dp(self, values: List[float]) -> List[float]:
        """Every data-parallel rank's list (equal lengths), concatenated in rank order."""
        if self.dp == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=collective_device())
        parts = [torch.empty_like(t) for _ in range(self.dp)]
        dist.all_gather(parts, t, group=self._groups["dp"])
        return torch.cat(parts).tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def checkpoint_group(self):
        """The group that torch.distributed.checkpoint coordinates a sharded save over (every rank): a gloo
        group, because DCP exchanges its plans as Python objects, which NCCL would first copy to the GPU; the
        default group when that is gloo already. Created on first use, so every rank must call it together
        (checkpoint saves are collective)."""
        if self.world == 1:
            return None
        if "checkpoint" not in self._groups:
            self._groups["checkpoint"] = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._groups["checkpoint"]



def collective_device() -> torch.device:
    """Where this process's collectives take their tensors: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_divisible(groups, mode: str, cfg) -> None:
    """The step's samples split evenly over data parallel: one error naming the key and the fix. ``groups``: a
    :class:`ParallelGroups` or a RunConfig (``dp``, ``world``, ``tp``, ``cp``)."""
    from core.errors import UserInputError

    key, n = ("batch_size", cfg.batch_size) if mode == "sft" else ("prompts_per_step", cfg.prompts_per_step)
    if n % groups.dp:
        raise UserInputError(f"{key}={n} does not split over {groups.dp} data-parallel ranks "
                             f"(world {groups.world} / tp {groups.tp} / cp {groups.cp}). Fix: use a multiple of "
                             f"{groups.dp} for {key}, or fewer ranks.")


def check_virtual_stages(run_config, mode: str, cfg) -> None:
    """``--vpp``: megatron-core's interleaved schedule needs at least ``--pp`` micro-batches per step on each
    data-parallel rank; refused before any rank starts (``engine.pipeline`` refuses such a step too)."""
    from core.errors import UserInputError

    pp, dp, mbs = run_config.pp, run_config.dp, cfg.micro_batch_size
    if getattr(run_config, "vpp", 1) <= 1 or cfg.max_tokens_per_rank is not None:
        return
    rows = cfg.batch_size // dp if mode == "sft" else cfg.prompts_per_step // dp * cfg.group_size
    # grpo: a group each under true_on_policy, else at least --pp where the rows allow (core.packing.budget_rows)
    n = -(-rows // mbs) if mbs else (1 if mode == "sft" else
                                     cfg.prompts_per_step // dp if cfg.true_on_policy else min(rows, pp))
    if n < pp:
        fix = f"set micro_batch_size={rows // pp} or less" if rows >= pp else f"give each rank {pp} or more samples"
        raise UserInputError(f"--vpp {run_config.vpp} runs megatron-core's interleaved schedule, which needs at least "
                             f"--pp {pp} micro-batches per step on each data-parallel rank, and this run's steps "
                             f"have {n}. Fix: {fix}, or drop --vpp.")


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


__all__: List[Any] = ["ParallelGroups", "check_divisible", "collective_device", "pad_rule", "pack"]
