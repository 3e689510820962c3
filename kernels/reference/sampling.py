"""How the rollout engine draws a token: inverse-CDF sampling with float64 sums in blocks (:func:`draw_index`, the
engine's sampler ``rollout.reference_engine.sample_tokens`` calls it), and the same rule from the logits without
the distribution's tensor (:func:`draw_tokens`), in torch: the oracle of the GPU backends' sampler kernels
(``kernels/triton/sampling.py``).

:func:`draw_tokens`: one token per row from ``softmax(logits / T)`` over the whole vocabulary: ``lse`` of
``logits / T``; each probability ``p = exp(logit / T - lse)`` in fp32; :func:`draw_index` on them; the token's
log-probability ``logit / T - lse``. That is the engine's torch sampler on ``exp(log_softmax(logits / T))``, with
``lse`` summed in another order than ``log_softmax``'s.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["CDF_BLOCK", "draw_index", "running_sum", "draw_tokens", "draw_record", "stop_hits", "tempered"]

#: Entries per block of the draw's first level (the blocks' float64 masses).
CDF_BLOCK = 1024


def draw_index(probs: torch.Tensor, u: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """``probs [N, V]`` (non-negative, not normalized), uniforms ``u [N]`` -> ``[N]`` long: the index whose
    interval of the running mass holds ``u x`` the row's mass, with float64 sums in two levels: the mass of each
    block of ``block`` entries (:data:`CDF_BLOCK`), their running sum to find the block, then the running sum
    inside that block alone (on top of the earlier blocks' mass). Why: the running sum of a whole 129,280-entry row in float64
    (a float64 copy of the probabilities, a scan, the index of the last entry with mass) was about a third of a
    millisecond of a 64-sequence decode step on an H200 (``bench/results/rollout-h200-flash-shaped-triton-compile-
    mix-finish.json``); here the row goes to float64 once, for the blocks' sums, and one block is scanned. Never an
    index without mass: where rounding puts the target at or past the end of a block's (or the row's) running sum,
    the draw takes the last entry (block) with mass. The same float64 sums in another order as one running sum (the
    draws of a row stay the same on every path: all sample through here)."""
    n, v = probs.shape
    B = block
    full = v // B
    parts = [probs[:, :full * B].reshape(n, full, B).sum(-1, dtype=torch.float64)] if full else []
    if v > full * B:
        parts.append(probs[:, full * B:].sum(-1, dtype=torch.float64, keepdim=True))
    totals = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]           # [N, blocks]
    upto = running_sum(totals)                                                 # mass through each block
    target = u.to(probs.device, torch.float64)[:, None] * upto[:, -1:]
    blk = torch.searchsorted(upto, target, right=True)
    blk = torch.minimum(blk, _last_with_mass(totals))
    before = torch.where(blk > 0, upto.gather(-1, (blk - 1).clamp(min=0)), 0.0)  # mass of the earlier blocks
    cols = blk * B + torch.arange(B, device=probs.device)                          # [N, B]
    p = torch.where(cols < v, probs.gather(-1, cols.clamp(max=v - 1)), 0.0).double()
    j = torch.searchsorted(running_sum(p) + before, target, right=True)
    return (blk * B + torch.minimum(j, _last_with_mass(p))).squeeze(-1)


def running_sum(x: torch.Tensor) -> torch.Tensor:
    """The running sum along the last dim (one place, so a test can stand in a parallel scan's rounding)."""
    return x.cumsum(-1)


def _last_with_mass(p: torch.Tensor) -> torch.Tensor:
    """``[N, 1]``: the last index along ``p [N, M]``'s rows whose entry is above 0 (0 for a row without one)."""
    return torch.where(p > 0, torch.arange(p.shape[-1], device=p.device), 0).amax(-1, keepdim=True)


def draw_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, block: int = CDF_BLOCK
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [N] long, log-probs [N] fp32)`` drawn from ``softmax(logits / temperature)`` by the uniforms ``u [N]``
    with blocks of ``block`` entries (module docstring), on ``logits``' device."""
    x = tempered(logits, temperature)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    tok = draw_index((x - lse).exp(), u, block)
    return tok, (x.gather(-1, tok[:, None]) - lse).squeeze(-1)


def draw_record(logits: torch.Tensor, u: torch.Tensor, ids: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor,
                logps: torch.Tensor, last: torch.Tensor, rows: torch.Tensor, stops: torch.Tensor, temperature: float,
                block: int = CDF_BLOCK) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's draw and the engine's records of it (``rollout.reference_engine``'s loop): each row ``r`` of
    ``logits [N, V]`` is sample ``ids[r]``'s next token, its index in the sample ``t[r] + 1``. ``t`` moves on by one
    in place; :func:`draw_tokens` at the uniforms ``u[ids, t]`` (``u [samples, steps]`` float64); the token and its
    log-probability written to ``tokens[ids, t]`` and ``logps[ids, t]``, and the token to ``last[rows]`` (the slot
    that feeds it next). Returns ``(tokens [N], log-probs [N], flags [N])`` (``flags``: bool, whether each token is
    one of ``stops`` [S] int64). The torch contract of the GPU backends' one-launch record (``kernels/triton/sampling.py``)."""
    t.add_(1)
    tok, lp = draw_tokens(logits, u[ids, t], temperature, block)
    tokens[ids, t] = tok
    logps[ids, t] = lp
    last[rows] = tok
    return tok, lp, stop_hits(tok, stops)


def stop_hits(tok: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """``torch.isin(tok, stops)`` for drawn tokens ``tok [N]`` and the stop ids ``stops [S]``, without waiting for
    the GPU: on CUDA ``torch.isin`` synchronized the stream three times a call (seen on an H100 with
    ``torch.cuda.set_sync_debug_mode``), so every decode step of the rollout engine waited for the one before;
    ``N x S`` comparisons instead (a step's few tokens against a few stop ids). The engine's stop test and
    :func:`draw_record`'s flags."""
    return (tok[:, None] == stops[None, :]).any(-1)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32; at temperature 1 the logits as they are (the same values: a pass over
    ``[N, V]`` fp32 less)."""
    return logits.float() if temperature == 1.0 else logits.float() / temperature
