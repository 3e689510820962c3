"""Triton draw of one token per row from ``softmax(logits / T)`` over the whole vocabulary (top-p 1, no top-k):
the rollout engine's sampler (``kernels.reference.sampling.draw_index``'s rule) in three kernels that read the fp32
logits twice, never writing a ``[rows, vocab]`` tensor.

Why: the torch sampler of a decode step runs ``log_softmax`` (one program per row: 30 us for the single row of a
one-sequence step on an H200), ``exp``, the blocks' float64 sums and about twenty small kernels after them, five
passes over ``[rows, 129,280]`` fp32 at 64 sequences (about 170 us of a 3.5 ms compiled step,
``bench/results/rollout-h200-flash-shaped-triton-compile-expert-order.json``; the sampler runs eagerly after the
step's graph, in compiled and eager engines alike).

The rule is :func:`kernels.reference.sampling.draw_tokens`' (torch, the oracle of the tests): ``lse`` of
``logits / T``; each probability ``p = exp(logit / T - lse)`` in fp32; the float64 mass of each block of ``block``
entries; the block
whose running mass holds ``u x`` the row's mass; inside it the entry whose running mass (on top of the earlier
blocks') holds it; where rounding puts the target at or past the end, the last block (entry) with mass. The
token's log-probability is ``logit / T - lse``. The same rule as ``draw_index`` on ``exp(log_softmax(...))``, with
``lse`` summed in another order than torch's ``log_softmax`` (a probability differs in its last bit at most).

Kernels: (1) per row and block, the block's max and sum of exponentials (many programs per row, also for one
row); (2) per row and block, the row's ``lse`` from (1)'s partials and the block's float64 mass; (3) per row, the
running sums of the blocks' masses and of the chosen block's probabilities (``tl.cumsum`` in float64), the draw and
its log-probability.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import pdl

__all__ = ["draw_tokens", "draw_record"]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _block_stats_kernel(L, M, S, temperature, V, NB, SCALED: tl.constexpr, B: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(row, b)``: block ``b``'s max of ``logits / T`` (base 2) and sum of ``exp2(x - max)``."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * B + tl.arange(0, B)
    x = tl.load(L + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if SCALED:
        x = x / temperature
    x2 = x * LOG2E
    m = tl.maximum(tl.max(x2, 0), -3.0e38)      # finite: a block of -inf logits (no mass) sums to 0, not NaN
    s = tl.sum(tl.where(cols < V, tl.exp2(x2 - m), 0.0), 0)
    tl.store(M + row * NB + b, m)
    tl.store(S + row * NB + b, s)


@triton.jit
def _row_lse(M, S, row, NB, NBP: tl.constexpr):
    blocks = tl.arange(0, NBP)
    m = tl.load(M + row * NB + blocks, mask=blocks < NB, other=-3.0e38)
    s = tl.load(S + row * NB + blocks, mask=blocks < NB, other=0.0)
    mx = tl.max(m, 0)
    return (mx + tl.log2(tl.sum(s * tl.exp2(m - mx), 0))) * LN2


@triton.jit
def _block_mass_kernel(L, M, S, LSE, TOT, temperature, V, NB, SCALED: tl.constexpr, B: tl.constexpr,
                       NBP: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(row, b)``: the row's ``lse`` and block ``b``'s float64 sum of ``exp(logit / T - lse)``."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    lse = _row_lse(M, S, row, NB, NBP)
    cols = b * B + tl.arange(0, B)
    x = tl.load(L + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
    if SCALED:
        x = x / temperature
    p = tl.where(cols < V, tl.exp(x - lse), 0.0)
    tl.store(TOT + row * NB + b, tl.sum(p.to(tl.float64), 0))
    if b == 0:
        tl.store(LSE + row, lse)


# The sizes are not specialized on (divisible by 16, equal to 1): the engine's probe of draw_record (a row of the
# model's vocabulary, 3 steps, one stop id; rollout.engine_ops.record_choice) compiles the variant every decode step
# runs, whatever its number of steps and stop ids. A first decode step compiled its own variant in the middle of a
# timed call (7.28 ms a step against 1.52 on a fresh H100; bench/results/rollout-h100-flash-shaped-triton-b1-fresh.json)
@triton.jit(do_not_specialize=["V", "NB", "STEPS", "NSTOPS"])
def _draw_kernel(L, LSE, TOT, U, TOK, LP, temperature, V, NB, IDS, TCUR, TOKENS, LOGPS, LAST, ROWS, STEPS, STOPS,
                 NSTOPS, FLAGS, SCALED: tl.constexpr, B: tl.constexpr, NBP: tl.constexpr, RECORD: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    """Program ``row``: the block, then the entry, whose running float64 mass holds ``u x`` the row's mass.
    ``RECORD`` (:func:`draw_record`): the uniform is ``U[IDS[row], TCUR[row] + 1]`` (``STEPS`` a row), and the
    program writes the token and its log-probability there in ``TOKENS`` and ``LOGPS``, the token to
    ``LAST[ROWS[row]]``, ``TCUR[row] + 1`` back to ``TCUR``, and to ``FLAGS[row]`` whether the token is one of the
    ``NSTOPS`` ids at ``STOPS``."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, NBP)
    tot = tl.load(TOT + row * NB + blocks, mask=blocks < NB, other=0.0)
    upto = tl.cumsum(tot, 0)                                              # mass through each block
    if RECORD:
        step = tl.load(TCUR + row) + 1                                    # the draw's index in its sample
        at = tl.load(IDS + row) * STEPS + step                            # the sample's entry of this draw
        u = tl.load(U + at)
    else:
        u = tl.load(U + row)
    target = u * tl.max(upto, 0)                                          # the row's mass: the last running sum
    blk = tl.sum((upto <= target).to(tl.int32), 0)                        # searchsorted, right
    blk = tl.minimum(blk, tl.max(tl.where(tot > 0, blocks, 0), 0))        # never a block without mass
    before = tl.sum(tl.where(blocks == blk - 1, upto, 0.0), 0)            # the earlier blocks' mass
    lse = tl.load(LSE + row)
    j = tl.arange(0, B)
    cols = blk * B + j
    x = tl.load(L + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
    if SCALED:
        x = x / temperature
    p = tl.where(cols < V, tl.exp(x - lse), 0.0)
    run = tl.cumsum(p.to(tl.float64), 0) + before
    pick = tl.sum((run <= target).to(tl.int32), 0)
    pick = tl.minimum(pick, tl.max(tl.where(p > 0, j, 0), 0))            # never an entry without mass
    tok = blk * B + pick
    lp = tl.load(L + row * V + tok).to(tl.float32)
    if SCALED:
        lp = lp / temperature
    tl.store(TOK + row, tok.to(tl.int64))
    tl.store(LP + row, lp - lse)
    if RECORD:
        tl.store(TOKENS + at, tok.to(tl.int64))
        tl.store(LOGPS + at, lp - lse)
        tl.store(LAST + tl.load(ROWS + row), tok.to(tl.int64))
        tl.store(TCUR + row, step)
        hit = tok < 0                                                     # False, as the token's type
        for i in range(0, NSTOPS):
            hit = hit | (tok.to(tl.int64) == tl.load(STOPS + i))
        tl.store(FLAGS + row, hit)


def draw_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, block: int
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [N] long, log-probs [N] fp32)`` drawn from ``softmax(logits / temperature)`` by the uniforms
    ``u [N]`` (float64) with blocks of ``block`` entries (a power of two): ``logits [N, V]`` fp32 on CUDA (or
    under ``TRITON_INTERPRET=1``). Anything else is refused with the reason."""
    op = "draw_tokens"
    _check_logits(op, logits, temperature, block)
    if u.shape != logits.shape[:1] or u.dtype != torch.float64:
        raise gpu_common.op_refusal(op, f"logits {tuple(logits.shape)} with u {tuple(u.shape)} {u.dtype} (needs "
                                        f"logits [N, V] and float64 u [N])")
    return _launch(logits, u.contiguous(), temperature, block, None)


def draw_record(logits: torch.Tensor, u: torch.Tensor, ids: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor,
                logps: torch.Tensor, last: torch.Tensor, rows: torch.Tensor, stops: torch.Tensor, temperature: float,
                block: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.reference.sampling.draw_record``: :func:`draw_tokens` at the uniforms ``u[ids, t + 1]`` (``u
    [samples, steps]`` float64), with the engine's records of the draw in its last kernel: ``t`` (int64 ``[N]``)
    moved on by one in place, the token and its log-probability written to ``tokens[ids, t]`` (int64) and
    ``logps[ids, t]`` (fp32, both ``[samples, steps]``), the token to ``last[rows]`` (int64), and whether it is one
    of ``stops`` (int64) returned as a third output (bool ``[N]``). Why: the engine's decode loop ran those as
    seven launches of torch between two replays of the step's graph (the index arithmetic, the uniforms' gather,
    three indexed writes, the stop test's two), each a gap of its own at one sequence. Anything else is refused
    with the reason."""
    op = "draw_record"
    _check_logits(op, logits, temperature, block)
    N = logits.shape[0]
    problem = None
    if u.dim() != 2 or u.dtype != torch.float64 or not u.is_contiguous():
        problem = f"u {tuple(u.shape)} {u.dtype} (needs contiguous float64 [samples, steps])"
    elif any(x.shape != (N,) or x.dtype != torch.long for x in (ids, t, rows)):
        problem = "ids, t and rows of one int64 entry a row of the logits"
    elif tokens.shape != u.shape or logps.shape != u.shape or tokens.dtype != torch.long or \
            logps.dtype != torch.float32 or not (tokens.is_contiguous() and logps.is_contiguous()):
        problem = "tokens (int64) and logps (fp32), contiguous and shaped like u"
    elif last.dim() != 1 or last.dtype != torch.long or last.stride(0) != 1:
        problem = "last: a dense int64 vector"
    elif stops.dim() != 1 or stops.dtype != torch.long:
        problem = "stops: an int64 vector"
    elif any(x.device != logits.device for x in (u, ids, t, tokens, logps, last, rows, stops)):
        problem = "every tensor on the logits' device"
    elif not all(x.is_contiguous() for x in (ids, t, rows, stops)):
        problem = "contiguous ids, t, rows and stops"
    if problem is not None:
        raise gpu_common.op_refusal(op, problem)
    flags = torch.empty(N, dtype=torch.bool, device=logits.device)   # every row's program writes its flag
    tok, lp = _launch(logits, u, temperature, block,
                      (ids, t, tokens, logps, last, rows, u.shape[1], stops, stops.numel(), flags))
    return tok, lp, flags


def _check_logits(op: str, logits: torch.Tensor, temperature: float, block: int) -> None:
    gpu_common.check_op_input(op, logits, "logits", dtypes=(torch.float32,))
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise gpu_common.op_refusal(op, f"logits {tuple(logits.shape)} (needs logits [N, V])")
    if block < 16 or block & (block - 1) or not temperature > 0:
        raise gpu_common.op_refusal(op, f"blocks of {block} at temperature {temperature} (needs a power-of-two "
                                        f"block of at least 16 and a positive temperature)")


def _launch(logits, u, temperature: float, block: int, record):
    """The three kernels on checked inputs; ``record``: ``(ids, t, tokens, logps, last, rows, steps, stops,
    stop count, flags)`` for :func:`draw_record`, else None."""
    N, V = logits.shape
    dev = logits.device
    tok = torch.empty(N, dtype=torch.long, device=dev)
    lp = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return tok, lp
    logits = logits.contiguous()
    nb = triton.cdiv(V, block)
    nbp = triton.next_power_of_2(nb)
    m = torch.empty(N, nb, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    tot = torch.empty(N, nb, dtype=torch.float64, device=dev)
    lse = torch.empty(N, dtype=torch.float32, device=dev)
    scaled, t = temperature != 1.0, float(temperature)
    _block_stats_kernel[(N, nb)](logits, m, s, t, V, nb, SCALED=scaled, B=block, num_warps=4,
                                 **pdl.launch(logits.device))
    _block_mass_kernel[(N, nb)](logits, m, s, lse, tot, t, V, nb, SCALED=scaled, B=block, NBP=nbp, num_warps=4,
                                **pdl.launch(logits.device))
    rec = record or (tok,) * 6 + (0, tok, 0, tok)       # pointers the kernel never reads without RECORD
    _draw_kernel[(N,)](logits, lse, tot, u, tok, lp, t, V, nb, *rec, SCALED=scaled, B=block, NBP=nbp,
                       RECORD=record is not None, num_warps=4, **pdl.launch(logits.device))
    return tok, lp
