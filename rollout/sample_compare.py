"""Which log-probabilities of two engines' samples can be compared, and how far apart they are there.

Two engines that draw from the same model with the same seed (one with a kernel backend's ops, one with the
reference ops) should give the same tokens with nearly the same log-probabilities. Two things end a fair
comparison of a sample, and neither is a fault of either engine: a differing token (from there on the two
log-probabilities are of two different tokens, and the two samples of two different prefixes), and a routing flip,
a position where two routers' top-k scores tied within rounding and the engines picked different experts (a
legitimate difference of two correct implementations that moves the log-probability by a few hundredths: under
the CPU interpreter at 20 sequences 0.034 and 0.016 nats, each exactly at a flip, 1e-3 or less everywhere else).

Used by the GPU test of the decode step's kernels (``tests/kernels/test_decode_step_kernels_gpu.py``) and by
``bench.logprob_kernels``, which asks which kernel moves the log-probabilities.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["first_differing_token", "same_routing_upto", "comparable_upto", "logprob_gap"]


def first_differing_token(a, b) -> Optional[int]:
    """The index of the first response token where samples ``a`` and ``b`` differ (where the shorter one ended,
    if one is the other's start), or ``None``."""
    x, y = a.response_ids, b.response_ids
    i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return None if i == len(x) == len(y) else i


def same_routing_upto(a, b) -> int:
    """How many of the samples' first log-probabilities saw the same expert picks in both engines: response token
    ``i`` is scored at position ``P - 1 + i`` (``P`` the prompt's length), after every position up to it was
    routed (``Sample.routed_experts``, recorded by both engines)."""
    n = min(len(a.response_ids), len(b.response_ids))
    P = len(a.prompt_ids)
    common = P - 1 + n                      # the positions both routed
    flips = (a.routed_experts[:common] != b.routed_experts[:common]).flatten(1).any(1).nonzero().flatten()
    return n if flips.numel() == 0 else max(0, int(flips[0]) - P + 1)


def comparable_upto(a, b) -> int:
    """How many of the samples' first log-probabilities score the same token after the same routing."""
    return _comparable(first_differing_token(a, b), same_routing_upto(a, b))


def _comparable(same: Optional[int], routed: int) -> int:
    return routed if same is None else min(routed, same)      # routed <= the shorter sample's length


def logprob_gap(got: Sequence[Sequence], want: Sequence[Sequence]) -> dict:
    """Over two engines' ``generate`` outputs (per prompt, per sample): ``max`` (nats, over the comparable
    positions), ``at`` (``[prompt, sample, position]`` of that max, ``None`` if nothing compared), ``compared``
    and ``total`` positions, and ``differing`` / ``flipped``: samples with a differing token / a routing flip."""
    out = dict(max=0.0, at=None, compared=0, total=0, differing=0, flipped=0)
    for p, (ga, gb) in enumerate(zip(got, want, strict=True)):
        for s, (a, b) in enumerate(zip(ga, gb, strict=True)):
            same, routed = first_differing_token(a, b), same_routing_upto(a, b)
            upto = _comparable(same, routed)
            out["differing"] += same is not None
            out["flipped"] += routed < min(len(a.response_ids), len(b.response_ids))
            if upto:
                diff = (a.logprobs[:upto].float() - b.logprobs[:upto].float()).abs()
                i = int(diff.argmax())
                if float(diff[i]) > out["max"] or out["at"] is None:
                    out["max"], out["at"] = float(diff[i]), [p, s, i]
            out["compared"] += upto
            out["total"] += len(a.response_ids)
    return out
