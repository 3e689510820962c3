"""What the SFT and GRPO steps share: the kill test hook, sample seeds, padding, and GRPO's sample regrouping
into micro-batches.

Why a module of its own: the steps (:mod:`train.sft`, :mod:`train.grpo`) and the loop (:mod:`train.trainer`) all
use these, and none of them may import another's module around a circle.

Test hook: ``DSV4_TRAIN_KILL_AT="STEP:PHASE"`` (PHASE in rollout, logprobs, train, update_weights, checkpoint)
SIGKILLs the process at that point of that step (:func:`maybe_kill`).
"""

from __future__ import annotations

import os
import signal
from typing import Dict, List, Optional

import torch

from core.errors import UserInputError
from engine.pipeline import pipelined
from rollout.replay import batch_indexer_picks

from .losses import group_advantages

KILL_ENV = "DSV4_TRAIN_KILL_AT"


def maybe_kill(step: int, phase: str) -> None:
    want = os.environ.get(KILL_ENV)
    if want and want == f"{step}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def add_to_step_sum(acc: Dict, key: str, value: torch.Tensor) -> None:
    """A running sum of the step's loss terms, kept on the device (read once, after the optimizer step: no host
    synchronisation per micro-batch); floats under ``--pp``, whose schedule broadcasts the sums."""
    acc[key] = acc[key] + (float(value) if pipelined() else value.detach())


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of ``step`` (each sample's seed follows it and the prompt's index in the step)."""
    return (seed * 1_000_003 + step * 65_537 + 11) % (2 ** 63)


def pad_batch(seqs: List[List[int]], pad: int, length: Optional[int] = None) -> torch.Tensor:
    """Rows padded with ``pad`` to the longest sequence, or to ``length`` (``pad_to_length``)."""
    L = max(len(s) for s in seqs)
    if length is not None:
        if L > length:
            raise UserInputError(f"a sequence of {L} tokens (prompt + response) is longer than pad_to_length="
                                 f"{length}. Fix: raise pad_to_length to {L} or more, or shorten the data")
        L = length
    return torch.tensor([s + [pad] * (L - len(s)) for s in seqs], dtype=torch.long)


def group_tensors(run, samples, rewards: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One prompt group's samples as padded tensors: ids, response mask, rollout log-probs, routed experts (for
    replay), advantages, lengths."""
    c, cfg = run.model_config, run.cfg
    P = len(samples[0].prompt_ids)
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    # true_on_policy: the shape the engine drew every token with (rollout.reference_engine, ReferenceEngine._generate_lockstep)
    ids = pad_batch(seqs, run.tok.eos_token_id, P + cfg.max_new_tokens if cfg.true_on_policy else None)
    S = ids.shape[1]
    mask = torch.zeros(len(samples), S - 1, dtype=torch.bool)
    rollout_lp = torch.zeros(len(samples), S - 1)
    routed = None
    if cfg.routing_replay and all(s.routed_experts is not None for s in samples):
        routed = torch.full((len(samples), S, c.n_layers, c.n_activated_experts), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        R = len(s.response_ids)
        mask[i, P - 1:P - 1 + R] = True
        rollout_lp[i, P - 1:P - 1 + R] = s.logprobs.float()
        if routed is not None:
            re = s.routed_experts
            routed[i, :re.shape[0]] = re
    adv = group_advantages(rewards, normalize_std=cfg.normalize_adv_std)
    return {"ids": ids, "mask": mask, "rollout_lp": rollout_lp, "routed": routed, "adv": adv,
            "lengths": [len(q) for q in seqs], "picks": batch_indexer_picks(samples, S) if cfg.indexer_replay else None}


# GRPO's micro-batches when neither micro_batch_size nor max_tokens_per_rank sizes them: at most this many padded
# tokens each (training option micro_batch_tokens). What it is for: every micro-batch pays a fixed cost beside its
# tokens (its forward and backward launches, every expert's weight gradient added into the fp32 buffer), so a
# step of short samples in one-group micro-batches was mostly that cost (a Flash-shaped GRPO step on an H200:
# train 1,013 ms in 8 micro-batches, 426 ms in one; docs/rollout.md). 8,192 is what the training benchmark's
# micro-batches of two 4,096-token rows hold on one H200 with the Flash-shaped model.
GRPO_MICRO_BATCH_TOKENS = 8192


def budget_rows(n: int, longest: int, budget: int, min_chunks: int = 1) -> int:
    """Rows per micro-batch of ``n`` rows padded to ``longest`` tokens under a ``budget`` of padded tokens: the
    largest divisor ``r`` of ``n`` with ``r x longest <= budget`` and at least ``min_chunks`` micro-batches
    (``--pp``'s schedule wants one per stage) where ``n`` allows; 1 when not even one row fits. A divisor, so
    the micro-batches are equal in rows."""
    most = min(budget // max(longest, 1), n // max(min_chunks, 1))
    return max((r for r in range(1, max(most, 1) + 1) if n % r == 0), default=1)


def sample_items(run, items):
    """The groups' samples regrouped into micro-batches across groups (in order; rows padded to the longest
    sample of their micro-batch): ``micro_batch_size`` rows each, else as many as fit ``micro_batch_tokens``
    padded tokens (:func:`budget_rows`, :data:`GRPO_MICRO_BATCH_TOKENS` when unset)."""
    flat = flat_samples(items, run.tok.eos_token_id)
    n = flat["ids"].shape[0]
    size = run.cfg.micro_batch_size
    if size is None:
        from engine.layout import current

        size = budget_rows(n, max(flat["lengths"]), run.cfg.micro_batch_tokens or GRPO_MICRO_BATCH_TOKENS,
                           min_chunks=current().pp)
    return [_rows(flat, list(range(n))[i:i + size]) for i in range(0, n, size)]


def packed_items(run, items):
    """The groups' samples regrouped into packed micro-batches (core.packing, in order, never split):
    ``(items, packing efficiency)``; each item's rows are trimmed to its longest sample."""
    flat = flat_samples(items, run.tok.eos_token_id)
    mbs, eff = run.micro_batches(flat["lengths"])
    return [_rows(flat, idx) for idx in mbs], eff


def _rows(flat, idx: List[int]):
    """The rows ``idx`` of a flat batch, trimmed to their longest sample."""
    lengths, routed, picks = flat["lengths"], flat["routed"], flat.get("picks")
    Sm = max(lengths[i] for i in idx)
    return {"ids": flat["ids"][idx, :Sm], "mask": flat["mask"][idx, :Sm - 1],
            "rollout_lp": flat["rollout_lp"][idx, :Sm - 1], "adv": flat["adv"][idx],
            "routed": None if routed is None else routed[idx, :Sm], "lengths": [lengths[i] for i in idx],
            "picks": None if picks is None else picks[idx, :Sm]}


def flat_samples(items, pad_id: int):
    """Every group's rows in one batch, padded to the longest sample."""
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
