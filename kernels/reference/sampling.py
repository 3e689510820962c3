"""The rule of the GPU backends' sampler kernels (``kernels/triton/sampling.py``), in torch: their oracle.

One token per row from ``softmax(logits / T)`` over the whole vocabulary: ``lse`` of ``logits / T``; each
probability ``p = exp(logit / T - lse)`` in fp32; the float64 mass of each block of ``block`` entries; the block
whose running mass holds ``u x`` the row's mass; inside it the entry whose running mass (on top of the earlier
blocks') holds it; where rounding puts the target at or past the end, the last block (entry) with mass. The
token's log-probability is ``logit / T - lse``. That is ``rollout.reference_engine.draw_index``'s rule applied to
``exp(log_softmax(logits / T))``, with ``lse`` summed in another order than ``log_softmax``'s.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["draw_tokens"]


def draw_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, block: int
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [N] long, log-probs [N] fp32)`` drawn from ``softmax(logits / temperature)`` by the uniforms ``u [N]``
    with blocks of ``block`` entries (module docstring), on ``logits``' device."""
    x = logits.float() if temperature == 1.0 else logits.float() / temperature
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    p = (x - lse).exp()
    n, v = p.shape
    pad = (-v) % block
    tot = torch.nn.functional.pad(p, (0, pad)).view(n, -1, block).sum(-1, dtype=torch.float64)
    upto = tot.cumsum(-1)
    target = u.to(p.device, torch.float64)[:, None] * upto[:, -1:]
    idx = torch.arange(tot.shape[1], device=p.device)
    blk = torch.minimum(torch.searchsorted(upto, target, right=True),
                        torch.where(tot > 0, idx, 0).amax(-1, keepdim=True))
    before = torch.where(blk > 0, upto.gather(-1, (blk - 1).clamp(min=0)), 0.0)
    cols = blk * block + torch.arange(block, device=p.device)
    pb = torch.where(cols < v, p.gather(-1, cols.clamp(max=v - 1)), 0.0)
    run = pb.double().cumsum(-1) + before
    j = torch.minimum(torch.searchsorted(run, target, right=True),
                      torch.where(pb > 0, torch.arange(block, device=p.device), 0).amax(-1, keepdim=True))
    tok = (blk * block + j).squeeze(-1)
    return tok, (x.gather(-1, tok[:, None]) - lse).squeeze(-1)
