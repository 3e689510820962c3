"""One SFT step (:func:`sft_step`): a batch of (prompt, response) pairs, the token-mean NLL on response tokens
(+ MTP, + the model's own loss term), one optimizer step. Every rank divides by the step's GLOBAL response-token
count, so the summed gradient is the token mean whatever the layout."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

from core.sequence_limits import check_sequences
from engine.pipeline import pipelined, rows_device, run_items
from reporting import profiling

from . import data as D
from .losses import mtp_loss, sft_loss_sum
from .step_common import add_to_step_sum as _add, maybe_kill, pad_batch

__all__ = ["sft_step"]


def _batch(run, step: int):
    """This data-parallel rank's sequences of ``step``: ``(ids [B, S], response-target mask [B, S-1], lengths)``;
    padding is never a target."""
    cfg, tok = run.cfg, run.tok
    seqs, masks = [], []
    for ex in run.dist.share(D.batch_for_step(run.examples, cfg.seed, step, cfg.batch_size)):
        p, r = D.encode_prompt(tok, ex.prompt), D.encode_response(tok, ex.response)
        seqs.append(p + r)
        masks.append([0] * (len(p) - 1) + [1] * len(r))   # next-token targets that are response tokens
    check_sequences([len(s) for s in seqs], run.model_config, source=f"SFT data {cfg.data or '(built-in)'}",
                    device="cuda" if torch.cuda.is_initialized() else "cpu")   # one sequence: a lower bound
    ids = pad_batch(seqs, tok.eos_token_id, cfg.pad_to_length)
    mask = torch.tensor([m + [0] * (ids.shape[1] - 1 - len(m)) for m in masks], dtype=torch.bool)
    return ids, mask, [len(q) for q in seqs]


def _micro_batch(run, ids, mask, lengths: List[int], idx: List[int]) -> dict:
    """Rows ``idx``: ``ids``, ``mask``, ``kw`` (packed: trimmed), response tokens ``n``; for a GPU model on the GPU
    without a stream sync, so log-probs, loss and sums stay there (a blocking copy synchronised each micro-batch)."""
    Sm = max(lengths[i] for i in idx) if run.packed else ids.shape[1]
    ids, mask, kw = ids[idx, :Sm], mask[idx, :Sm - 1], ({"lengths": [lengths[i] for i in idx]} if run.packed else {})
    n, dev = float(mask.sum()), rows_device(run.model, run.packed)
    if dev is not None:
        ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
    return dict(ids=ids, mask=mask, kw=kw, n=n)


def _loss(run, it, fwd, n_global: float, acc) -> torch.Tensor:
    """One micro-batch's loss: its response tokens' NLL sum / the step's response tokens, + MTP and the model's
    own term weighted by its token share; adds each term to ``acc``."""
    cfg, sub_ids, sub_mask = run.cfg, it["ids"], it["mask"]
    loss = sft_loss_sum(fwd.logprobs, sub_mask)[0] / n_global
    frac = it["n"] / n_global     # MTP and aux terms weighted by token share
    total = loss
    mtp = mtp_loss(fwd.mtp_logits, sub_ids, sub_mask) if cfg.mtp_coef > 0 else None
    if mtp is not None:
        total, acc["have_mtp"] = total + cfg.mtp_coef * mtp * frac, 1.0
        _add(acc, "mtp", mtp * frac)
    if fwd.aux_loss is not None:
        total, acc["have_aux"] = total + fwd.aux_loss * frac, 1.0
        _add(acc, "aux", fwd.aux_loss * frac)
    _add(acc, "loss", loss)
    return total


def sft_step(run, step: int) -> Dict[str, Any]:
    cfg = run.cfg
    ids, mask, lengths = _batch(run, step)
    t0 = time.perf_counter()
    run.model.train()
    with profiling.scope("zero_grad"):
        run.optim.zero_grad()
    maybe_kill(step, "train")
    n_global = max(run.dist.sum_over_dp([float(mask.sum())])[0], 1.0)
    if run.packed:                   # dynamic batching: packed THD micro-batches (core.packing)
        mbs, eff = run.micro_batches(lengths)
    else:                            # micro_batch_size rows each (one micro-batch when it is not set)
        mbs, eff = [list(range(ids.shape[0]))[rows] for rows in run.row_chunks(ids.shape[0])], None
    acc = dict(loss=0.0, mtp=0.0, aux=0.0, have_mtp=0.0, have_aux=0.0)
    items = [_micro_batch(run, ids, mask, lengths, idx) for idx in mbs]
    if pipelined():                  # --pp: megatron-core's schedule runs the items, the loss on the last stage
        run_items(run.model, items, lambda it: {"with_mtp": cfg.mtp_coef > 0}, lambda it, fwd: _loss(run, it, fwd, n_global, acc), acc)
    for k, it in enumerate(items if not pipelined() else ()):   # each adds its NLL sum / the step's tokens
        if cfg.cuda_graphs:          # the previous micro-batch's graph outputs may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        fwd = run.model.forward_train(it["ids"], with_mtp=cfg.mtp_coef > 0, **it["kw"])
        total = _loss(run, it, fwd, n_global, acc)
        with run.accumulating(k, len(mbs)):
            total.backward()
    gnorm = run.clip_and_step()
    t_train = time.perf_counter() - t0
    tokens = float(sum(lengths)) if run.packed else float(ids.numel())
    loss_g, mtp_g, aux_g, tokens = run.dist.sum_over_dp([float(acc["loss"]), float(acc["mtp"]), float(acc["aux"]),
                                                          tokens])
    row = {"loss": loss_g, "mtp_loss": mtp_g if acc["have_mtp"] else None, "grad_norm": gnorm,
           "indexer_loss": aux_g if acc["have_aux"] else None, "micro_batches": len(mbs),
           **dict.fromkeys(("reward_mean", "train_rollout_logprob_abs_diff", "train_rollout_kl", "rollout_entropy")),
           "time_rollout": 0.0, "time_logprobs": 0.0, "time_train": t_train, "time_update_weights": 0.0,
           "tokens": int(tokens), "response_tokens": int(n_global)}
    if eff is not None:
        row["packing_efficiency"] = eff
    return row
