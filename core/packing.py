"""Dynamic batching: pack variable-length samples into THD micro-batches. Pure Python + torch.

Rules
-----
* Samples are taken **in order** and never split: a micro-batch is a contiguous run of samples,
  closed when the next sample would overflow it (greedy, order-stable, deterministic).
* Budget: a micro-batch is one packed stream split over ``cp`` context-parallel ranks, so it holds at
  most ``budget = max_tokens_per_rank * cp`` tokens **after padding**.
* Padding (documented choice): the stream, not each sample, is padded at its end to a multiple
  ``M = lcm(pad_multiple, cp)``, and to at least ``cp * min_tokens_per_rank`` tokens. The pad is a
  **segment of its own** in ``cu_seqlens`` (``has_pad_segment``), so pad rows never enter a real
  sample's window or compressed groups, and ``loss_mask()`` excludes them.

  - ``cp`` always divides the stream (CP splits it into equal contiguous slices).
  - The compressor needs no padding: THD groups are formed per segment and tails are dropped
    (see :mod:`core.thd`). ``required_pad_multiple(cp, ratios, tp)`` = ``cp * lcm(tp, max(ratios))``
    additionally makes every rank's slice a multiple of the largest ratio (compressed all-gather and
    kernel tiles come out whole) and of ``tp`` (sequence-parallel split).
  - ``required_min_tokens_per_rank(cp, ratios)`` = the largest compressor boundary width when
    ``cp > 1`` (each rank receives that many rows from its left neighbour only), else 0.

  Since padded lengths are multiples of ``M``, a sample fits iff ``len <= floor(budget / M) * M``.
* Efficiency: ``real tokens / padded tokens`` (per micro-batch and overall).

Public API
----------
* ``SampleTooLongError(ValueError)``
* ``required_pad_multiple(cp=1, ratios=(), tp=1) -> int``
* ``required_min_tokens_per_rank(cp=1, ratios=()) -> int``
* ``MicroBatch`` (frozen dataclass): ``sample_indices``, ``lengths``, ``num_real_tokens``,
  ``num_tokens`` (padded), ``num_pad_tokens``, ``cu_seqlens`` (int64, incl. the pad segment),
  ``has_pad_segment``, ``efficiency``, ``loss_mask() -> BoolTensor [num_tokens]``
* ``PackResult`` (frozen dataclass): ``micro_batches``, ``num_real_tokens``, ``num_tokens``,
  ``efficiency``
* ``pack_micro_batches(lengths, max_tokens_per_rank, *, cp=1, pad_multiple=1, min_tokens_per_rank=0)
  -> PackResult``
* ``budget_rows(n, longest, budget, min_chunks=1) -> int`` and ``GRPO_MICRO_BATCH_TOKENS``: micro-batches of
  padded rows (not packed) under a token budget, GRPO's default (``train.step_common.sample_items``)
* ``flat_samples(items, pad_id) -> dict`` and ``take_rows(flat, idx) -> dict``: GRPO's prompt groups as one
  batch of padded rows, and a micro-batch's rows of it (packed or not)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from core.thd_cp import compressor_boundary_width

__all__ = [
    "MicroBatch",
    "PackResult",
    "SampleTooLongError",
    "pack_micro_batches",
    "required_min_tokens_per_rank",
    "required_pad_multiple",
]


class SampleTooLongError(ValueError):
    """A single sample does not fit one micro-batch."""


def _pos_ratios(ratios: Iterable[int]) -> list[int]:
    return sorted({int(r) for r in ratios if int(r) > 0})


def required_pad_multiple(cp: int = 1, ratios: Iterable[int] = (), tp: int = 1) -> int:
    """``cp * lcm(tp, max(ratios))``: each CP slice a multiple of ``tp`` and of the largest ratio."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    rs = _pos_ratios(ratios)
    return cp * math.lcm(tp, rs[-1] if rs else 1)


def required_min_tokens_per_rank(cp: int = 1, ratios: Iterable[int] = ()) -> int:
    """The largest compressor boundary width if ``cp > 1`` (else 0)."""
    rs = _pos_ratios(ratios)
    return max((compressor_boundary_width(r) for r in rs), default=0) if cp > 1 else 0


@dataclass(frozen=True, eq=False)
class MicroBatch:
    sample_indices: tuple[int, ...]
    lengths: tuple[int, ...]
    num_tokens: int  # padded stream length

    @property
    def num_real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_pad_tokens(self) -> int:
        return self.num_tokens - self.num_real_tokens

    @property
    def has_pad_segment(self) -> bool:
        return self.num_pad_tokens > 0

    @property
    def cu_seqlens(self) -> Tensor:
        """int64 ``[n + 1]`` (``[n + 2]`` with the trailing pad segment)."""
        lens = list(self.lengths) + ([self.num_pad_tokens] if self.has_pad_segment else [])
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)])

    @property
    def efficiency(self) -> float:
        return self.num_real_tokens / self.num_tokens

    def loss_mask(self) -> Tensor:
        """``[num_tokens]`` True on real tokens, False on the pad segment."""
        m = torch.zeros(self.num_tokens, dtype=torch.bool)
        m[: self.num_real_tokens] = True
        return m


@dataclass(frozen=True, eq=False)
class PackResult:
    micro_batches: tuple[MicroBatch, ...]

    @property
    def num_real_tokens(self) -> int:
        return sum(mb.num_real_tokens for mb in self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def efficiency(self) -> float:
        """Real tokens / padded tokens over all micro-batches (1.0 for an empty input)."""
        return self.num_real_tokens / self.num_tokens if self.num_tokens else 1.0


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_micro_batches(lengths: Sequence[int], max_tokens_per_rank: int, *, cp: int = 1,
                       pad_multiple: int = 1, min_tokens_per_rank: int = 0) -> PackResult:
    """Greedy, order-stable packing of samples into micro-batches of at most ``max_tokens_per_rank * cp``
    padded tokens (see the module docstring). Raises ``SampleTooLongError`` for a sample that fits no
    micro-batch, ``ValueError`` for a bad configuration or sample length."""
    if cp < 1 or pad_multiple < 1 or max_tokens_per_rank < 1 or min_tokens_per_rank < 0:
        raise ValueError(
            f"need cp >= 1, pad_multiple >= 1, max_tokens_per_rank >= 1, min_tokens_per_rank >= 0; got "
            f"cp={cp}, pad_multiple={pad_multiple}, max_tokens_per_rank={max_tokens_per_rank}, "
            f"min_tokens_per_rank={min_tokens_per_rank}"
        )
    mult = math.lcm(pad_multiple, cp)
    budget = max_tokens_per_rank * cp
    min_total = min_tokens_per_rank * cp
    capacity = (budget // mult) * mult  # largest padded length that fits the budget
    if capacity == 0 or _round_up(min_total, mult) > capacity:
        raise ValueError(
            f"max_tokens_per_rank={max_tokens_per_rank} x cp={cp} = {budget} tokens cannot hold a padded "
            f"micro-batch (multiple of {mult}, at least {min_total} tokens); raise --max-tokens-per-rank"
        )
    lens = [int(x) for x in lengths]
    for i, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"sample {i} has length {n}; every sample needs >= 1 token")
        if n > capacity:
            need = -(-_round_up(n, mult) // cp)
            raise SampleTooLongError(
                f"sample {i} has {n} tokens but a micro-batch holds at most {capacity} "
                f"(max_tokens_per_rank={max_tokens_per_rank} x cp={cp}, padded to a multiple of {mult}); "
                f"samples are never split. Fix: raise --max-tokens-per-rank to at least {need}, raise --cp, "
                f"or truncate/filter samples longer than {capacity} tokens."
            )

    def close(idx: list[int]) -> MicroBatch:
        real = sum(lens[i] for i in idx)
        padded = max(_round_up(real, mult), _round_up(min_total, mult))
        return MicroBatch(sample_indices=tuple(idx), lengths=tuple(lens[i] for i in idx), num_tokens=padded)

    out: list[MicroBatch] = []
    cur: list[int] = []
    cur_tokens = 0
    for i, n in enumerate(lens):
        if cur and cur_tokens + n > capacity:
            out.append(close(cur))
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        out.append(close(cur))
    return PackResult(micro_batches=tuple(out))


# GRPO's micro-batches when neither micro_batch_size nor max_tokens_per_rank sizes them: at most this many padded
# tokens each (training option micro_batch_tokens). What it is for: every micro-batch pays a fixed cost beside its
# tokens (its forward and backward launches, every expert's weight gradient added into the fp32 buffer), so a
# step of short samples in one-group micro-batches was mostly that cost (a Flash-shaped GRPO step on an H200:
# train 1,013 ms in 8 micro-batches, 426 ms in one; docs/rollout.md#shared-weights). 8,192 is what the training
# benchmark's micro-batches of two 4,096-token rows hold on one H200 with the Flash-shaped model.
GRPO_MICRO_BATCH_TOKENS = 8192


def budget_rows(n: int, longest: int, budget: int, min_chunks: int = 1) -> int:
    """Rows per micro-batch of ``n`` rows padded to ``longest`` tokens under a ``budget`` of padded tokens: the
    largest divisor ``r`` of ``n`` with ``r x longest <= budget`` and at least ``min_chunks`` micro-batches
    (``--pp``'s schedule wants one per stage) where ``n`` allows; 1 when not even one row fits. A divisor, so
    the micro-batches are equal in rows."""
    most = min(budget // max(longest, 1), n // max(min_chunks, 1))
    return max((r for r in range(1, max(most, 1) + 1) if n % r == 0), default=1)


def take_rows(flat: dict, idx: list[int]) -> dict:
    """The rows ``idx`` of a :func:`flat_samples` batch, trimmed to their longest sample."""
    lengths, routed, picks = flat["lengths"], flat["routed"], flat.get("picks")
    Sm = max(lengths[i] for i in idx)
    return {"ids": flat["ids"][idx, :Sm], "mask": flat["mask"][idx, :Sm - 1],
            "rollout_lp": flat["rollout_lp"][idx, :Sm - 1], "adv": flat["adv"][idx],
            "routed": None if routed is None else routed[idx, :Sm], "lengths": [lengths[i] for i in idx],
            "picks": None if picks is None else picks[idx, :Sm]}


def flat_samples(items: Sequence[dict], pad_id: int) -> dict:
    """GRPO's prompt groups (``train.step_common.group_tensors``: ids, response mask, rollout log-probs,
    advantages, lengths, recorded routes and indexer picks) as one batch of rows, padded to the longest sample."""
    S = max(it["ids"].shape[1] for it in items)

    def pad(t, width, fill):
        if t.shape[1] == width:
            return t
        extra = torch.full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), fill, dtype=t.dtype)
        return torch.cat([t, extra], dim=1)

    routed = picks = None
    if all(it["routed"] is not None for it in items):
        routed = torch.cat([pad(it["routed"], S, -1) for it in items])
    if all(it.get("picks") is not None for it in items):
        picks = torch.cat([pad(it["picks"], S, -1) for it in items])
    return {"ids": torch.cat([pad(it["ids"], S, pad_id) for it in items]),
            "mask": torch.cat([pad(it["mask"], S - 1, False) for it in items]),
            "rollout_lp": torch.cat([pad(it["rollout_lp"], S - 1, 0.0) for it in items]),
            "adv": torch.cat([it["adv"] for it in items]), "routed": routed,
            "lengths": [n for it in items for n in it["lengths"]], "picks": picks}
