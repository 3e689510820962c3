"""Expert parallelism: routed experts split over the ranks of megatron's expert-model-parallel group.

Layout: rank ``r`` of ``ep`` holds experts ``[r*L, (r+1)*L)`` (``L = n_routed_experts / ep``) under their
GLOBAL native names (``experts.linear_fc1.weight{e}``), so a rank's names are a subset of the weight contract:
loading skips the other ranks' experts (:func:`expert_banks`), and full views gather them back
(``engine.loading.full_native_state``). Everything else is replicated; each EP rank trains on its own tokens
(the ranks form a data-parallel group), so replicated gradients are averaged over the group by the caller.

Token exchange (:class:`ExpertDispatch`): a rank's (token, slot) assignments, sorted by expert, go to the
rank owning the expert with one ``all_to_all_single`` (row counts are exchanged first: the one host
synchronisation of expert parallelism), are computed there as a grouped GEMM, and come back by the reverse
exchange. The exchange is autograd-aware: its backward is the reverse exchange, so an expert's gradient
collects every rank's tokens and each token's input gradient returns to its rank.
"""

from __future__ import annotations

import re
from typing import Iterable, List

import torch
import torch.distributed as dist

from .permute import inverse_permutation, permute_rows

__all__ = ["ExpertDispatch", "all_to_all", "expert_banks", "expert_name"]

_EXPERT = re.compile(r"^(.*\.experts\.linear_fc[12]\.weight)(\d+)$")


def expert_name(name: str):
    """``(bank prefix, global expert index)`` of a routed-expert weight's native name, else None."""
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def expert_banks(names: Iterable[str]) -> set:
    """The bank prefixes (``...experts.linear_fc1.weight``) among ``names``: a routed-expert name of one of
    these banks that a model does not hold belongs to another EP rank."""
    return {parsed[0] for parsed in map(expert_name, names) if parsed is not None}


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with ``send`` rows to each rank and ``recv`` rows from each; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    """Autograd-aware exchange of ``x``'s rows (``send[r]`` consecutive rows go to rank ``r``)."""
    return _AllToAll.apply(x, send, recv, group)


class ExpertDispatch:
    """The row exchange of one MoE forward: assignments sorted by GLOBAL expert id ``experts [N]`` go to
    the ranks owning them (``L`` experts per rank), arriving sorted by LOCAL expert id on the receiver."""

    def __init__(self, experts: torch.Tensor, experts_per_rank: int, group):
        world = dist.get_world_size(group)
        dest = torch.div(experts, experts_per_rank, rounding_mode="floor")
        send = torch.bincount(dest, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        self.group = group
        self.send, self.recv = send.tolist(), recv.tolist()   # host sync: the split sizes
        local = _exchange(experts - dest * experts_per_rank, self.send, self.recv, group)
        self.local_experts, self.order = local.sort(stable=True)   # received rows grouped by local expert
        self.inv = inverse_permutation(self.order)

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (expert-sorted) -> the rows this rank computes, grouped by local expert."""
        return permute_rows(all_to_all(rows, self.send, self.recv, self.group), self.order, self.inv)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`scatter`: computed rows back to the ranks (and order) they came from."""
        back = permute_rows(out, self.inv, self.order)         # gathers both ways (engine.permute)
        return all_to_all(back, self.recv, self.send, self.group)
