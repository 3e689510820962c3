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
from core.packing import GRPO_MICRO_BATCH_TOKENS, budget_rows, flat_samples, take_rows
from engine.layout import current
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


def sample_items(run, items):
    """The groups' samples regrouped into micro-batches across groups, in order (:func:`core.packing.take_rows`:
    rows trimmed to the longest sample of their micro-batch): ``micro_batch_size`` rows each, else as many as fit
    ``micro_batch_tokens`` padded tokens (:func:`core.packing.budget_rows`; 8,192 when unset)."""
    flat = flat_samples(items, run.tok.eos_token_id)
    n, size = flat["ids"].shape[0], run.cfg.micro_batch_size
    if size is None:
        size = budget_rows(n, max(flat["lengths"]), run.cfg.micro_batch_tokens or GRPO_MICRO_BATCH_TOKENS,
                           min_chunks=current().pp)
    return [take_rows(flat, list(range(n))[rows]) for rows in run.row_chunks(n, size)]


def packed_items(run, items):
    """The groups' samples regrouped into packed micro-batches (core.packing, in order, never split):
    ``(items, packing efficiency)``; each item's rows are trimmed to its longest sample."""
    flat = flat_samples(items, run.tok.eos_token_id)
    mbs, eff = run.micro_batches(flat["lengths"])
    return [take_rows(flat, idx) for idx in mbs], eff
