"""What each side of a multi-GPU parity test computes (the parent at world size 1 on one GPU, the NCCL
workers at world size 2+): one function per parallel layout, so both sides run the same code. Models are
built in fp32 (``dtype="fp32"``): a GPU run's default is bf16, and the stated bounds are fp32 ones."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_results(official: dict, tp: int, dev: torch.device) -> dict:
    """miles at tensor parallel ``tp``: log-probs of two batches (S 37 and 140), then one Adam step."""
    from tests.impl_miles._helpers import miles_model, miles_step, token_ids

    m = miles_model(official, tp=tp, hardware="nvidia", dtype="fp32").to(dev)
    with torch.no_grad():
        lps = {S: m.logprobs(token_ids(2, S, 200 + S).to(dev)) for S in (37, 140)}
    loss, grads, after = miles_step(m, token_ids(2, 140, 11).to(dev))
    return {"logprobs": lps, "loss": loss, "grads": grads, "after": after}


def cp_results(impl: str, official: dict, cp: int, rank: int, dev: torch.device,
               indexer_coeff: float | None = 0.1) -> dict:
    """``impl`` on a packed THD stream at context parallel ``cp`` (``rank``'s contiguous slice): all-gathered
    per-token log-probs, the summed loss (megatron: with its indexer KL loss) and the gradients summed over
    the CP group (official names)."""
    from engine.thd_attention import cp_group_info
    from tests.thd_impl._common import build, cu_seqlens, grads_official, local_slice, packed_loss, stream

    cu, ids = cu_seqlens().to(dev), stream().to(dev)
    m = build(impl, official, cp=cp, qkv_format="thd", hardware="nvidia", dtype="fp32",
              indexer_coeff=indexer_coeff if impl == "megatron" else None).to(dev)
    group = cp_group_info()[2] if cp > 1 else None
    with torch.no_grad():
        lp = _gather(m.logprobs(local_slice(ids, cp, rank), cu), cp, group)
    loss = packed_loss(m, impl, ids, cu, cp, rank)
    loss.backward()
    total = loss.detach().clone()
    if cp > 1:
        for p in m.parameters():  # a rank may route no token to an expert: its grad is None there
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        dist.all_reduce(total, group=group)
    return {"logprobs": lp, "loss": total.item(), "grads": grads_official(m)}


def _gather(t: torch.Tensor, world: int, group) -> torch.Tensor:
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


# A gradient entry passes when |got - want| <= GRAD_ATOL + GRAD_RTOL * max|want| (per tensor). The absolute
# part keeps the bound meaningful for tiny tensors: the one-element hc_head_scale has a gradient of ~1.6e-5,
# so a purely relative bound asked for ~1e-9 absolute agreement, below fp32 reduction-order noise.
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


def max_diffs(got: dict, want: dict) -> dict:
    """Largest absolute differences (log-probs, loss, each gradient relative to its own max) of two results.

    ``grad_bound_ratio``: the largest ``|got - want| / (GRAD_ATOL + GRAD_RTOL * max|want|)`` over every
    gradient entry (<= 1 passes); ``grad_max_rel`` is kept for the record."""
    lp_got, lp_want = got["logprobs"], want["logprobs"]
    if isinstance(lp_want, dict):
        lp = max((lp_got[k].cpu() - lp_want[k].cpu()).abs().max().item() for k in lp_want)
    else:
        lp = (lp_got.cpu() - lp_want.cpu()).abs().max().item()
    grad_rel = ratio = 0.0
    for name, g in want["grads"].items():
        h = got["grads"].get(name, torch.zeros_like(g)).cpu()
        scale = max(g.abs().max().item(), 1e-12)
        diff = (h - g.cpu()).abs().max().item()
        grad_rel = max(grad_rel, diff / scale)
        ratio = max(ratio, diff / (GRAD_ATOL + GRAD_RTOL * scale))
    norm = lambda grads: float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))  # noqa: E731
    return {"logprob_max_abs": lp, "loss_abs": abs(got["loss"] - want["loss"]),
            "grad_max_rel": grad_rel, "grad_bound_ratio": ratio, "grad_norm": norm(want["grads"]),
            "grad_norm_rel": abs(norm(got["grads"]) - norm(want["grads"])) / max(norm(want["grads"]), 1e-12)}
