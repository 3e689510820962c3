"""The hash layers' routing table ``tid2eid`` read from a checkpoint: every id an expert, no expert twice in a row.

Why: ``tid2eid[token]`` lists the ``n_activated_experts`` routed experts a token of a hash layer goes to. A table
with ids 99 or -1 (outside ``0 .. n_routed_experts - 1``) reached the model's expert indexing and failed there
as "unexpected RuntimeError/ValueError" (or, on a GPU, as a device-side assert); a row naming one expert twice
was accepted and silently changed the log-probabilities (that expert's output counted twice). Every reader of
a checkpoint (HF shards, HF slices, native checkpoints) passes the table through :func:`check_tid2eid` before
it reaches a model.
"""

from __future__ import annotations

import torch

from core.errors import UserInputError

__all__ = ["RoutingTableError", "is_tid2eid", "check_tid2eid"]


class RoutingTableError(UserInputError):
    """A ``tid2eid`` table names experts that do not exist, or one expert twice for a token."""


def is_tid2eid(name: str) -> bool:
    return name.split("@", 1)[0].endswith("tid2eid")


def check_tid2eid(name: str, t: torch.Tensor, n_experts: int, *, where) -> torch.Tensor:
    """``t`` when every entry is in ``[0, n_experts)`` and no row repeats an id; else raise, naming the tensor,
    the first bad row and the fix."""
    if t.is_floating_point() or t.dim() != 2 or t.numel() == 0:
        return t                            # dtype and shape are the weight contract's to refuse
    fix = "the checkpoint's routing table is damaged; re-convert or re-download the checkpoint"
    bad = (t < 0) | (t >= n_experts)
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0, 0])
        raise RoutingTableError(f"{where}: tensor '{name}' row {row} holds expert id(s) "
                                f"{sorted(set(t[row][bad[row]].tolist()))[:4]} outside 0 .. {n_experts - 1} "
                                f"(n_routed_experts = {n_experts}); {fix}")
    s, _ = torch.sort(t.to(torch.int64), dim=1)
    dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
    if bool(dup.any()):
        row = int(dup.nonzero()[0, 0])
        raise RoutingTableError(f"{where}: tensor '{name}' row {row} names an expert twice ({t[row].tolist()}); "
                                f"each token must go to {t.shape[1]} distinct experts; {fix}")
    return t
