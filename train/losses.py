"""Losses and rollout-vs-train diagnostics.

GRPO (per group of ``G`` samples of one prompt)::

    A_i   = (r_i - mean(r)) / (std(r) + eps)          (std over the group, unbiased=False; or no std)
    rho_t = exp(logp_t - logp_old_t)
    L_pg  = -min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A)   token-mean over all response tokens
    L_kl  = beta * k3(pi_theta || pi_ref)                 (optional, beta = kl_coef)
    k3(p || q) at x ~ p:  r = log q(x) - log p(x) (clamped to [-K, K]);  k3 = exp(r) - 1 - r

Rollout/train diagnostics (samples drawn by the rollout engine, so ``p`` = rollout policy):

* ``train_rollout_logprob_abs_diff``: per sample the token-mean of ``|logp_train - logp_rollout|``, then
  the mean over samples;
* ``train_rollout_kl``: k3 of KL(rollout || train) per token with the log-ratio clamped to
  ``[-KL_CLAMP, KL_CLAMP]`` per token, token-mean per sample, then mean over samples;
* ``rollout_entropy``: the sampled tokens' ``-logp_rollout``, aggregated alike: an unbiased estimate of the
  sampling policy's entropy, and the scale of the log-prob gap (docs/training.md#metrics-and-plots).

SFT: token-mean negative log-likelihood over response tokens. MTP: token-mean cross entropy of depth
``k``'s logits at row ``i`` against ``input_ids[i + k + 2]`` over the rows whose label is a loss token.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

KL_CLAMP = 10.0


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    r = rewards.float()
    a = r - r.mean()
    if normalize_std:
        a = a / (r.std(unbiased=False) + eps)
    return a


def zero_variance_group_frac(groups) -> float:
    """Fraction of GRPO prompt groups whose rewards are all equal (0.0 for no groups).

    Such a group has zero advantage for every sample (``group_advantages``), so it adds nothing to the
    policy loss or its gradient; a step where every group is like that does not learn at all."""
    groups = list(groups)
    if not groups:
        return 0.0
    flat = sum(1 for r in groups if bool((r == r.reshape(-1)[0]).all()))
    return flat / len(groups)


def k3(logp_sampler: torch.Tensor, logp_other: torch.Tensor, clamp: float = KL_CLAMP) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || other) for tokens drawn from the sampler."""
    r = (logp_other - logp_sampler).clamp(-clamp, clamp)
    return torch.exp(r) - 1.0 - r


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def sample_mean_diag(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> Tuple[float, ...]:
    """``[B,T]`` tensors -> sample-means of (log-prob |diff|, k3 KL(rollout||train), the rollout's -log p)."""
    diff = masked_mean((train_lp - rollout_lp).abs(), mask, dim=1)
    kl = masked_mean(k3(rollout_lp, train_lp), mask, dim=1)
    return float(diff.mean()), float(kl.mean()), float(masked_mean(-rollout_lp, mask, dim=1).mean())


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (sum over tokens of the clipped surrogate loss, clipped-token count, token count)."""
    ratio = torch.exp(logp - old_logp)
    a = adv if adv.dim() == logp.dim() else adv[:, None]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * a
    per_tok = -torch.minimum(unclipped, clipped)
    m = mask.to(per_tok.dtype)
    clip_count = ((clipped < unclipped).to(per_tok.dtype) * m).sum()
    return (per_tok * m).sum(), clip_count.detach(), m.sum()


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
              total_tokens: float, ref_logp: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
              clip_low: float = 0.2, clip_high: float = 0.2
              ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """One micro-batch's share of the step's GRPO loss: ``(loss, L_pg share, L_kl share or None, clipped count)``.

    Both terms are sums over this micro-batch's response tokens divided by ``total_tokens``, the step's
    response-token count over EVERY micro-batch of EVERY data-parallel rank. Gradients accumulate over
    micro-batches and are summed over ranks, so the step's gradient is that of the token-mean over the whole
    step, however the samples are split (a per-micro-batch or per-rank mean would weight a short micro-batch's
    tokens more)."""
    denom = max(float(total_tokens), 1.0)
    pg_sum, clipped, _n = policy_loss(logp, old_logp, adv, mask, clip_low=clip_low, clip_high=clip_high)
    pg = pg_sum / denom
    kl = None
    loss = pg
    if ref_logp is not None:
        kl = (k3(logp, ref_logp) * mask.to(logp.dtype)).sum() / denom
        loss = loss + kl_coef * kl
    return loss, pg, kl, clipped


def sft_loss_sum(logp: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    m = mask.to(logp.device, logp.dtype)
    return -(logp * m).sum(), m.sum()


def mtp_loss(mtp_logits: Optional[List[torch.Tensor]], input_ids: torch.Tensor, loss_mask: torch.Tensor
             ) -> Optional[torch.Tensor]:
    """``loss_mask [B, S-1]`` marks the next-token targets (position i predicts ids[i+1]); depth k's
    row i predicts ids[i+k+2], so its mask is ``loss_mask[:, k+1:]``. Mean over depths.

    The cross entropy runs where the logits are (the model's device: the ``[B, S, vocab]`` logits never
    travel); the scalar comes back next to ``input_ids``."""
    if not mtp_logits:
        return None
    losses = []
    for k, lg in enumerate(mtp_logits):
        n = lg.shape[1] - 1                     # rows with a label inside the sequence
        if n <= 0:
            continue
        labels = input_ids[:, k + 2:k + 2 + n].to(lg.device)
        m = loss_mask[:, k + 1:k + 1 + n].to(lg.device)
        ce = F.cross_entropy(lg[:, :n].float().reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="none")
        losses.append(masked_mean(ce.view_as(labels), m))
    return torch.stack(losses).mean().to(input_ids.device) if losses else None
