"""One GRPO step as its named phases, each a function of the run (:class:`train.trainer._Run`):

    sync       the trained weights into the rollout engine (export -> publish -> load -> check; or shared in
               place with the built-in engine in this process: rollout.shared_weights)
    rollout    P prompts x G samples each on the leader's engine (temperature / top-p), broadcast to its ranks
    reward     each sample's reward, the groups' tensors and advantages, regrouped into micro-batches
    logprobs   the reference policy's log-probs when kl_coef > 0; the old log-probs by a no-grad pass of the
               training model (routing replayed) only where :func:`recomputes_old_logprobs`, else the update's
               own forward gives them (one optimizer step per batch: the same policy)
    train      clipped policy loss (+ k3 KL penalty, + MTP loss, + the model's own term), one optimizer step;
               the rollout-vs-train diagnostics (:class:`RolloutGap`) from whichever forward gave the old log-probs

With ``async_rollout`` the rollout of step k+1 is sent right after step k's weight sync and runs while step k
computes log-probs and trains; step k takes its own batch (in flight since step k-1) before its sync, so it trains
one step off-policy (:mod:`rollout.async_rollout`; metric ``rollout_policy_lag``). Every phase adds its metrics to
the step's row ``out``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

from engine.pipeline import forward_items, pipelined, rows_device, run_items
from reporting import profiling
from rollout.phase_clock import timing_metrics
from rollout.reference_engine import SamplingParams
from rollout.replay import routing_match
from rollout.weight_sync import sync_weights

from . import data as D
from .losses import grpo_loss, mtp_loss, sample_mean_diag, zero_variance_group_frac
from .model import TrainForward, full_view
from .step_common import add_to_step_sum as _add, group_tensors, maybe_kill, packed_items, sample_items, step_seed

__all__ = ["grpo_step", "sync_phase", "rollout_phase", "reward_phase", "logprobs_phase", "train_phase"]


def grpo_step(run, step: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    t_step = time.perf_counter()
    # async rollout: this step's batch, in flight since the previous step's sync, is taken before this step's
    # sync (the engine is never updated while it generates); None for a run's (or a resumed run's) first step
    taken = run.rollouts.take(step) if run.rollouts is not None else None
    sync_phase(run, step, out)
    t0 = time.perf_counter()
    batch, groups = rollout_phase(run, step, taken, out, t_step)
    rewards, items = reward_phase(run, batch, groups, out, t0)
    items = [on_model_device(run, it) for it in items]
    gap = logprobs_phase(run, step, items, out)
    train_phase(run, step, items, rewards, gap, out, t_step)
    return out


def sync_phase(run, step: int, out: Dict[str, Any]) -> None:
    """update_weights: every rank takes part in gathering the full weights; each leader's engine loads them."""
    cfg = run.cfg
    maybe_kill(step, "update_weights")
    run.model.eval()
    # a sharing engine reads this rank's own tensors (whole on every rank: rollout.shared_weights.weight_sync_mode)
    sharer = run.weight_sync.sharer
    view = run.model if sharer is not None else full_view(run.model, run.dist)
    if run.dist.is_leader and getattr(run.engine, "reads_trainer_weights", False):
        # no sync: the engine computes with this very module (rollout.reference_engine.TrainModuleEngine)
        run.engine.version = step
        out.update(time_update_weights=0.0, weight_check_ok=None, weight_sync_bytes=0, weight_sync_shared_bytes=0,
                   weight_sync_buckets=0, weight_quant_max_rel_err=0.0)
    elif run.dist.is_leader:
        if sharer is not None:                # the engine computes with the trainer's memory (rollout.shared_weights)
            rep = sharer.sync(view, version=step, check=cfg.check_weights)
        else:
            rep = sync_weights(view, run.engine, version=step, scheme=run.publish_format,
                               engine_dtype=run.dtype, max_bucket_bytes=cfg.max_bucket_bytes,
                               check=cfg.check_weights, lossless=cfg.true_on_policy)
        if rep.check is not None and not rep.check.ok:
            raise RuntimeError("weight sync check failed:\n" + rep.check.summary())
        out.update(time_update_weights=rep.seconds, weight_check_ok=None if rep.check is None else rep.check.ok,
                   weight_sync_bytes=rep.bytes, weight_sync_shared_bytes=rep.shared_bytes,
                   weight_sync_buckets=rep.buckets, weight_quant_max_rel_err=rep.max_quant_rel_err)


def step_prompts(run, step: int):
    """This data-parallel rank's examples of ``step``, their encoded prompts and the index of its first prompt in
    the step (sample seeds follow it, whatever the layout)."""
    batch = run.dist.share(D.batch_for_step(run.examples, run.cfg.seed, step, run.cfg.prompts_per_step))
    return batch, [D.encode_prompt(run.tok, ex.prompt) for ex in batch], run.dist.dp_rank * len(batch)


def generate(run, step: int, version: int, *, in_background: bool = False):
    """Generate the batch of ``step`` on the leader's engine (which holds weights ``version``): now, or issued to
    the async pipeline (:mod:`rollout.async_rollout`)."""
    cfg = run.cfg
    _batch, prompts, first = step_prompts(run, step)
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, (run.tok.eos_token_id,), cfg.top_k)
    kw = dict(n=cfg.group_size, seed=step_seed(cfg.seed, step), first_prompt=first)
    if in_background:
        return run.rollouts.issue(step, version, prompts, params, **kw)
    return run.engine.generate(prompts, params, **kw)


def rollout_phase(run, step: int, taken, out: Dict[str, Any], t_step: float):
    """This data-parallel rank's prompts, on its leader's engine (broadcast to its TP x CP ranks); each sample's
    seed is a function of (seed, step, the prompt's index in the step), whatever the layout. Returns the rank's
    examples and their sample groups."""
    maybe_kill(step, "rollout")
    t0 = time.perf_counter()
    batch, _prompts, _first = step_prompts(run, step)
    groups = None
    if run.dist.is_leader:
        if taken is None:             # generated now, from the weights just loaded
            groups, version = generate(run, step, step), step
            wait = time.perf_counter() - t0
        else:
            groups, version, wait = taken
        out.update(rollout_policy_lag=step - version, time_rollout_wait=wait)
        if run.cfg.colocate:
            run.engine.release_memory()
        # what the engine holds and its generate's phases, asked before the next batch (actors answer in order)
        out.update(run.engine_memory())
        out.update(timing_metrics(run.engine))
        if run.rollouts is not None and step < run.steps:   # the next batch, from the weights just loaded
            generate(run, step + 1, step, in_background=True)
            out["at_next_rollout_issued"] = time.perf_counter() - t_step
    groups, lag = run.dist.broadcast_from_leader((groups, out.get("rollout_policy_lag")))
    out["rollout_policy_lag"] = lag
    out.update(run.memory_phase_start())
    return batch, groups


def reward_phase(run, batch, groups, out: Dict[str, Any], t_rollout: float):
    """Each sample's reward (its prompt's rule on the decoded response), each group's tensors and advantages
    (``time_rollout`` ends here, counted from ``t_rollout``), regrouped into the micro-batches the next phases run
    (packed, ``micro_batch_size`` rows, or as many rows as fit ``micro_batch_tokens``; one prompt group each
    under ``true_on_policy``, the shape its engine drew with): ``(rewards per group, micro-batch items)``."""
    rewards, items = [], []
    for ex, samples in zip(batch, groups):
        r = []
        for s in samples:
            body = s.response_ids[:-1] if s.finish_reason == "stop" else s.response_ids
            r.append(D.compute_reward(D.decode_response(run.tok, s.response_ids), body, ex.reward))
        r = torch.tensor(r)
        rewards.append(r)
        items.append(group_tensors(run, samples, r))
    out["time_rollout"] = time.perf_counter() - t_rollout
    if run.packed:                   # dynamic batching: micro-batches of samples across groups
        items, out["packing_efficiency"] = packed_items(run, items)
    elif not run.cfg.true_on_policy:  # micro-batches across groups: micro_batch_size samples, or a token budget
        items = sample_items(run, items)
    out["micro_batches"] = len(items)
    return rewards, items


def on_model_device(run, it: dict) -> dict:
    """``it`` with its response-token count ``n``, its rows on :func:`~engine.pipeline.rows_device`."""
    it, dev = dict(it, n=float(it["mask"].sum())), rows_device(run.model, run.packed)
    if dev is None:
        return it
    keys = [k for k in ("ids", "mask", "rollout_lp", "routed", "adv", "picks") if it.get(k) is not None]
    return {**it, **{k: it[k].to(dev, non_blocking=True) for k in keys}}


def _forward_kw(run, item) -> Dict[str, Any]:
    kw = {"lengths": item["lengths"]} if run.packed else {}
    if item.get("picks") is not None:            # indexer_replay: the engine's indexer picks
        kw["indexer_replay"] = item["picks"]
    return kw


def recomputes_old_logprobs(run) -> bool:
    """Whether the old log-probs come from a no-grad pass of their own before the update (``logprobs`` phase).

    A GRPO step takes ONE optimizer step over its batch, so the policy that scores the old log-probs is the one the
    update's forward runs: that forward's log-probs, detached, are the old ones (the PPO ratio is exactly 1 and its
    gradient is ``adv * grad log p``), and a second forward over the batch is pure cost, about a fifth of a
    Flash-shaped step. The pass stays where something needs it: ``recompute_old_logprobs=true`` (a user's choice,
    e.g. to compare), ``true_on_policy`` (its contract is the recomputation equal to the rollout, bit for bit) and
    ``--pp`` (the update's loss runs on the last stage only)."""
    return bool(run.cfg.recompute_old_logprobs or run.cfg.true_on_policy or pipelined())


class RolloutGap:
    """The train/rollout diagnostics of a step's items (log-prob |diff|, k3 KL and the rollout's entropy per sample,
    routing- and indexer-replay agreement) from the forward that gave the old log-probs. :meth:`add` keeps only its
    detached outputs (the update's loop never stalls); :meth:`report` sums them over data parallel into the row."""

    def __init__(self):
        self.kept: List[tuple] = []

    def add(self, it: dict, fwd: TrainForward) -> None:
        self.kept.append((it, fwd.logprobs.detach(), fwd.routing_used, fwd.indexer_replay))

    def report(self, run, out: Dict[str, Any]) -> float:
        """The step's metrics into ``out``; returns the step's sample count (over data parallel)."""
        sums, matches, ix = [0.0, 0.0, 0.0, 0.0], [], [0, 0]
        for it, lp, used, replayed in self.kept:
            d, k, h = sample_mean_diag(lp, it["rollout_lp"], it["mask"])
            n = it["ids"].shape[0]
            sums = [sums[0] + n, sums[1] + d * n, sums[2] + k * n, sums[3] + h * n]
            if it["routed"] is not None:
                matches.append(routing_match(used, it["routed"]))
            if replayed is not None:   # (own picks = recorded, replayed rows)
                ix = [ix[0] + replayed[0], ix[1] + replayed[1]]
        n_samples, diff_sum, kl_sum, entropy_sum, match_sum, match_n, ix_same, ix_rows = run.dist.sum_over_dp([
            *sums, float(sum(matches)), float(len(matches)), float(ix[0]), float(ix[1])])
        out.update(train_rollout_logprob_abs_diff=diff_sum / n_samples, train_rollout_kl=kl_sum / n_samples,
                   rollout_entropy=entropy_sum / n_samples)
        out["routing_replay_match"] = (match_sum / match_n) if match_n else None
        if run.cfg.indexer_replay:  # fraction of replayed (position, CSA layer) rows the trainer's own indexer picked alike
            out["indexer_replay_match"] = (ix_same / ix_rows) if ix_rows else None
        return n_samples


def logprobs_phase(run, step: int, items: List[dict], out: Dict[str, Any]) -> RolloutGap:
    """The reference policy's log-probs of every item (``kl_coef > 0``) and, where :func:`recomputes_old_logprobs`,
    the old ones with their rollout diagnostics; returns the step's diagnostics (filled here, or by the update's
    forward in :func:`train_phase`)."""
    maybe_kill(step, "logprobs")
    cfg = run.cfg
    t0 = time.perf_counter()
    gap = RolloutGap()
    recompute = recomputes_old_logprobs(run)
    with torch.no_grad():
        def kw(it):
            return dict(routing_replay=it["routed"], temperature=cfg.temperature)
        fwds = [TrainForward(lp, None, used) for lp, used in forward_items(run.model, items, kw)] \
            if pipelined() else [None] * len(items)       # --pp: through the stages, on every stage
        refs = [lp for lp, _ in forward_items(run.ref_model, items, kw)] if pipelined() and run.ref_model is not None \
            else None
        for i, (it, fwd) in enumerate(zip(items, fwds)):
            if recompute:
                fwd = fwd or run.model.forward_train(it["ids"], routing_replay=it["routed"],
                                                     temperature=cfg.temperature, **_forward_kw(run, it))
                it["old"] = fwd.logprobs
                gap.add(it, fwd)
            if refs is not None:
                it["ref"] = refs[i]
            elif run.ref_model is not None:
                it["ref"] = run.ref_model.logprobs(it["ids"], routing_replay=it["routed"],
                                                   temperature=cfg.temperature, **_forward_kw(run, it))
    out["time_logprobs"] = time.perf_counter() - t0
    return gap


def _item_loss(run, it, fwd, total_tokens: float, acc: Dict[str, float]):
    """One micro-batch's loss: clipped policy loss, + k3 KL to the reference, + MTP, + the model's own term,
    each divided by the step's GLOBAL response-token count (gradients are summed); adds each term to ``acc``."""
    cfg = run.cfg
    loss, pg_term, kl_term, clipped = grpo_loss(
        fwd.logprobs, it["old"], it["adv"], it["mask"], total_tokens=total_tokens, ref_logp=it.get("ref"),
        kl_coef=cfg.kl_coef, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    _add(acc, "pg", pg_term)
    _add(acc, "clip", clipped)
    frac = it["n"] / max(total_tokens, 1.0)
    if kl_term is not None:
        _add(acc, "kl", kl_term)
    if cfg.mtp_coef > 0:
        m = mtp_loss(fwd.mtp_logits, it["ids"], it["mask"])
        if m is not None:
            loss = loss + cfg.mtp_coef * m * frac
            _add(acc, "mtp", m * frac)
    if fwd.aux_loss is not None:     # implementation's own term (indexer KL), token-weighted
        loss, acc["have_aux"] = loss + fwd.aux_loss * frac, 1.0
        _add(acc, "aux", fwd.aux_loss * frac)
    _add(acc, "loss", loss)
    return loss


def train_phase(run, step: int, items: List[dict], rewards: List[torch.Tensor], gap: RolloutGap,
                out: Dict[str, Any], t_step: float) -> None:
    """The policy update over every micro-batch (gradients accumulated), one optimizer step, the step's metrics.
    Items without old log-probs (:func:`recomputes_old_logprobs` false) take them from this forward, detached, and
    add its diagnostics to ``gap``."""
    maybe_kill(step, "train")
    cfg = run.cfg
    t0 = time.perf_counter()
    run.model.train()
    with profiling.scope("zero_grad"):
        run.optim.zero_grad()
    total_tokens = run.dist.sum_over_dp([sum(it["n"] for it in items)])[0]
    acc = dict(loss=0.0, pg=0.0, kl=0.0, clip=0.0, mtp=0.0, aux=0.0, have_aux=0.0)
    if pipelined():                  # --pp: megatron-core's schedule, the loss on the last stage
        run_items(run.model, items, lambda it: dict(routing_replay=it["routed"], temperature=cfg.temperature,
                                                    with_mtp=cfg.mtp_coef > 0),
                  lambda it, fwd: _item_loss(run, it, fwd, total_tokens, acc), acc)
    for i, it in enumerate(items if not pipelined() else ()):
        fwd = run.model.forward_train(it["ids"], routing_replay=it["routed"], temperature=cfg.temperature,
                                      with_mtp=cfg.mtp_coef > 0, **_forward_kw(run, it))
        if "old" not in it:            # the update's own forward scores the old policy: one optimizer step
            it["old"] = fwd.logprobs.detach()
            gap.add(it, fwd)
        loss = _item_loss(run, it, fwd, total_tokens, acc)
        with run.accumulating(i, len(items)):
            loss.backward()
    gnorm = run.clip_and_step()
    out["time_train"] = time.perf_counter() - t0
    out["at_train_end"] = time.perf_counter() - t_step
    out.update(run.memory_phase_end())
    n_samples = gap.report(run, out)
    loss_acc, pg_acc, kl_acc, mtp_acc, aux_acc, clip_acc, tokens = run.dist.sum_over_dp([
        *(float(acc[k]) for k in ("loss", "pg", "kl", "mtp", "aux", "clip")),
        float(sum(it["ids"].numel() for it in items))])
    allr = torch.tensor(run.dist.gather_over_dp(torch.cat(rewards).tolist()))
    zero_var_groups, n_groups = run.dist.sum_over_dp([zero_variance_group_frac(rewards) * len(rewards),
                                                      float(len(rewards))])
    out.update(loss=loss_acc, pg_loss=pg_acc, kl_loss=kl_acc if run.ref_model is not None else None,
               mtp_loss=mtp_acc if cfg.mtp_coef > 0 else None, grad_norm=gnorm,
               indexer_loss=aux_acc if acc["have_aux"] else None,
               pg_clipfrac=clip_acc / max(total_tokens, 1.0), reward_mean=float(allr.mean()),
               zero_variance_group_frac=zero_var_groups / max(n_groups, 1.0),
               reward_std=float(allr.std(unbiased=False)), response_len_mean=total_tokens / n_samples,
               tokens=int(tokens), response_tokens=int(total_tokens))
