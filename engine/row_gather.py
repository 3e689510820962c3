"""All-gather of every context-parallel rank's rows, for a loss that every rank computes whole.

Under context parallelism each rank holds a slice of a sequence's tokens; the trainer gathers the per-token
log-probs (and MTP logits, indexer picks) so that every rank computes the SAME loss from the full tensor. Its
backward therefore keeps only this rank's rows and needs no communication (train.distributed).
"""

from __future__ import annotations

import torch

__all__ = ["gather_rows"]


class _GatherRows(torch.autograd.Function):
    """All-gather every CP rank's rows (dim 0, rank order). Every rank then computes the SAME loss from the
    full tensor, so backward keeps only this rank's rows, without communication (see train.distributed)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cp: int, rank: int, group) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(parts, t, group=group)
        ctx.rank, ctx.n = rank, t.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.narrow(0, ctx.rank * ctx.n, ctx.n), None, None, None


def gather_rows(t: torch.Tensor, cp: int, rank: int, group, grad: bool = True) -> torch.Tensor:
    """``t [n, ...]`` of every CP rank -> ``[cp * n, ...]`` (identity for ``cp == 1``)."""
    if cp == 1:
        return t
    if not grad:
        with torch.no_grad():
            return _GatherRows.apply(t.detach(), cp, rank, group)
    return _GatherRows.apply(t, cp, rank, group)
