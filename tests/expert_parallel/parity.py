"""What each side of an expert-parallel parity test computes, for any EP size (1 = the reference run).

Four sequences of 140 tokens (past the 128 window; every path of the tiny model runs). At EP size 1 one
process takes them all; at EP size ``ep`` rank ``r`` takes sequences ``r, r+ep, ...`` (the EP ranks form a
data-parallel group), holds ``1/ep`` of every layer's experts, and assignments travel by all-to-all. Each
rank's loss is its tokens' share of the mean next-token NLL over ALL the sequences, so summing the replicated
parameters' gradients over the ranks gives the EP-1 gradient; experts' gradients are complete on their owner
(the exchange's backward)."""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQS, SEQ_LEN = 4, 140


def ep_results(impl: str, official: dict, ep: int, rank: int, dev: torch.device, hardware: str = "cpu",
               dtype: str = "fp32") -> dict:
    """``{"logprobs" [SEQS, S-1] (all ranks'), "loss" (summed over ranks), "grads" (official names, full)}``,
    in ``dtype`` (fp32 by default, also on a GPU, whose run default is bf16: the parity bounds are fp32's)."""
    from engine.layout import current as parallel_layout
    from tests.impl_miles._helpers import token_ids
    from tests.thd_impl._common import build, grads_official

    ids = token_ids(SEQS, SEQ_LEN, 21).to(dev)
    mine = ids[rank::ep]                                   # [SEQS / ep, S]
    m = build(impl, official, ep=ep, qkv_format="bshd" if impl == "miles" else "thd", hardware=hardware,
              dtype=dtype).to(dev)
    n_all = SEQS * (SEQ_LEN - 1)
    if impl == "miles":
        logits = m(mine)[:, :-1]
    else:
        b, S = mine.shape
        cu = torch.arange(0, b + 1, device=dev) * S
        logits = m(mine.reshape(-1), cu).view(b, S, -1)[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, mine[:, 1:, None]).squeeze(-1)   # [b, S-1]
    loss = -lp.sum() / n_all
    loss.backward()
    total, lps = loss.detach().clone(), lp.detach()
    if ep > 1:
        group = parallel_layout().group("ep")
        for name, p in m.named_parameters():
            if p.requires_grad and not getattr(p, "expert_parallel", False):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        dist.all_reduce(total, group=group)
        parts = [torch.empty_like(lps) for _ in range(ep)]
        dist.all_gather(parts, lps.contiguous(), group=group)
        lps = torch.stack(parts, dim=1).reshape(SEQS, -1)   # rank r held sequences r, r+ep, ...
    from core.weight_contract import native_to_hf
    from engine.loading import full_native_state
    from tests.thd_impl._common import TINY

    state = dict(native_to_hf(full_native_state(m).items(), TINY))   # every rank's experts, gathered
    return {"logprobs": lps, "loss": total.item(), "grads": grads_official(m), "state": state,
            "local_experts": sum(1 for n, _ in m.named_parameters() if ".experts.linear_fc1.weight" in n)}
