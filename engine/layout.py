"""The run's parallel layout: one object per rank with every parallel size, this rank's place and its groups.

Why: the tensor-parallel size used to travel twice, through the run's configuration and back through about forty
reads of megatron-core's ``parallel_state`` globals spread over the implementations, the MoE, the trainer and the
optimizer (and ``engine.runtime`` checked that the two agreed). Now the hardware target's
``init_process_group`` calls :func:`initialize` right after the process group exists: it starts megatron-core's
model-parallel state (which megatron-core's own layers keep reading) and builds the one
:class:`ParallelLayout` of this rank from it, which the target returns and every product module reads
(:func:`current`). This is the only product module that touches ``megatron.core.parallel_state``
(``tests/imports_test.py`` holds the rest to it).

Sizes: ``world = dp x tp x cp x pp``; expert parallel runs inside data parallel (``ep`` divides ``dp``), its
expert-data-parallel group the ranks that hold the same experts; ``vp`` virtual pipeline stages per pipeline rank
(``dsv4 train --vpp``, set by :func:`interleave` after the groups exist: it needs no group of its own). A process
that never joined a process group has the one-rank layout (:data:`SINGLE`: every size 1, no groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["ParallelLayout", "SINGLE", "initialize", "interleave", "current", "destroy"]


@dataclass(frozen=True)
class ParallelLayout:
    """Every parallel size of the run, this rank's index in each, and the process groups (None in a one-rank
    layout; a group of one rank is None too for the sizes that are 1 only when the process has no groups)."""

    rank: int = 0
    world: int = 1
    tp: int = 1
    tp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    vp: int = 1                 # virtual pipeline stages (model chunks) per pipeline rank: engine.pipeline
    dp: int = 1
    dp_rank: int = 0
    etp: int = 1                # expert tensor parallel (megatron's; 1: expert parallelism runs alone)
    etp_rank: int = 0
    groups: "Optional[LayoutGroups]" = field(default=None, repr=False, compare=False)

    @property
    def distributed(self) -> bool:
        """Whether this rank is in a process group with megatron-core's model-parallel state."""
        return self.groups is not None

    def group(self, name: str):
        """The process group ``name`` (a :class:`LayoutGroups` field), None in a one-rank layout."""
        return None if self.groups is None else getattr(self.groups, name)


@dataclass(frozen=True)
class LayoutGroups:
    """The torch.distributed process groups of a rank (megatron-core's, read once)."""

    tp: Any
    cp: Any
    tp_cp: Any                  # the ranks that share samples: tensor x context parallel of one data-parallel rank
    dp: Any                     # data parallel without context parallel
    dp_cp: Any                  # data parallel with context parallel (the replicated parameters' gradients)
    ep: Any
    expert_dp: Any              # the ranks that hold the same experts (expert gradients)
    etp: Any
    pp: Any
    tp_pp: Any                  # megatron's model-parallel group: the stages of one data-parallel rank, x tensor


SINGLE = ParallelLayout()
_STATE: dict = {"layout": None}


def initialize(tp: int = 1, *, pp: int = 1, cp: int = 1, ep: int = 1) -> ParallelLayout:
    """Start megatron-core's model-parallel state over the process group that exists now (the hardware target's
    ``init_process_group``; idempotent for the same sizes) and build this rank's layout from it, once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("engine.layout.initialize needs a process group: the hardware target's "
                           "init_process_group starts it first")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep)
    layout = _read(ps, dist)
    want = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    have = {k: getattr(layout, k) for k in want}
    if have != want:
        raise ValueError(f"the process's model-parallel state has {have}, and this rank asks for {want}: one "
                         f"process takes one layout (destroy the process group before starting another)")
    _STATE["layout"] = layout
    return layout


def _read(ps, dist) -> ParallelLayout:
    groups = LayoutGroups(
        tp=ps.get_tensor_model_parallel_group(), cp=ps.get_context_parallel_group(),
        tp_cp=ps.get_tensor_and_context_parallel_group(), dp=ps.get_data_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True), ep=ps.get_expert_model_parallel_group(),
        expert_dp=ps.get_expert_data_parallel_group(), etp=ps.get_expert_tensor_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(), tp_pp=ps.get_model_parallel_group())
    return ParallelLayout(
        rank=dist.get_rank(), world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        groups=groups)


def interleave(vp: int) -> ParallelLayout:
    """This rank's layout with ``vp`` virtual pipeline stages per pipeline rank (``--vpp``; 1: none), after
    :func:`initialize`. megatron-core's parallel state is not told: its virtual-rank global would make its
    ``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` answer for one chunk in every module that reads them,
    and the interleaved schedule (``engine.pipeline``) takes ``vp`` and the chunk explicitly."""
    import dataclasses

    layout = current()
    if vp > 1 and layout.pp < 2:
        raise ValueError(f"--vpp {vp} interleaves pipeline stages, and this rank's layout has --pp {layout.pp}. "
                         f"Fix: add --pp 2 (or more), or drop --vpp")
    if layout is not SINGLE:
        _STATE["layout"] = layout = dataclasses.replace(layout, vp=vp)
    return layout


def current() -> ParallelLayout:
    """This rank's layout (built by :func:`initialize`), or the one-rank layout in a process without one."""
    return _STATE["layout"] or SINGLE


def destroy() -> None:
    """Tear down megatron-core's model-parallel state and forget the layout (the hardware target's
    ``destroy_process_group``, before the process group goes)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    _STATE["layout"] = None
