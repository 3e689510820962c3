"""The MoE dispatch's row moves as gathers both ways: no atomic adds, one rounding, the same bits every run.

Why: the routed experts' dispatch copies each token's row to its ``k`` expert slots with
``x.index_select(0, order // k)``, whose backward is ``index_add_``: on CUDA ``k`` atomic bf16 additions into
every token's gradient row (3.3 ms of the Flash-shaped training step on one H200, its ``index_add_`` under "moe
permute/unpermute" in bench/results/train-cli-h200-flash-shaped-seq4096-mhc-launch.json), ``k`` roundings to bf16
per element, in the order the atomics land.
The combine put the expert outputs back in (token, slot) order with ``zeros_like(out).index_copy(0, order,
out)``: a zero fill that the copy then overwrites. Since ``order`` is a permutation of the ``T*k`` assignments,
its inverse ``inv`` (``inv[order[j]] = j``) turns every direction into a gather:

* ``expand_to_slots(x, order, inv, k)``: ``rows[j] = x[order[j] // k]``; backward
  ``dx = drows[inv].view(T, k, d).sum(1)`` (the ``k`` slots of a token summed in fp32, rounded once);
* ``permute_rows(src, idx, inv_idx)``: ``src[idx]`` for a permutation ``idx``; backward ``dsrc = dy[inv_idx]``.
"""

from __future__ import annotations

import torch

__all__ = ["inverse_permutation", "expand_to_slots", "permute_rows"]


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[j]] = j`` (a scatter of unique indices: no atomics, no host sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _ExpandToSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        by_slot = grad.index_select(0, inv)                   # (token, slot) order
        return by_slot.view(-1, ctx.k, grad.shape[-1]).sum(dim=1), None, None, None


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, idx, inv_idx):
        ctx.save_for_backward(inv_idx)
        return src.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        (inv_idx,) = ctx.saved_tensors
        return grad.index_select(0, inv_idx), None, None


def expand_to_slots(x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """``x [T, d]`` -> ``[T*k, d]``, row ``j`` = ``x[order[j] // k]`` (``order`` a permutation of ``T*k``
    assignments numbered ``token * k + slot``, ``inv`` its inverse); the backward gathers (module docstring)."""
    return _ExpandToSlots.apply(x, order, inv, k)


def permute_rows(src: torch.Tensor, idx: torch.Tensor, inv_idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` for a permutation ``idx`` of ``src``'s rows (``inv_idx`` its inverse); backward ``dy[inv_idx]``."""
    return _PermuteRows.apply(src, idx, inv_idx)
