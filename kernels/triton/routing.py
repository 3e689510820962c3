"""Triton routing of a decode step's tokens to their experts: ``kernels.reference.moe.route`` in one launch.

Why: eagerly the router of one MoE layer was about ten kernels for a few hundred bytes of output (the fp32 casts
of the tokens and of the router weight, the fp32 GEMM, ``softplus``, ``sqrt``, the bias, ``topk``, the gather,
the sum, the division and the scale), each a launch of its own in the decode step's CUDA graph. Here one program
per 16 tokens computes their gate scores (``tl.dot`` with fp32 accumulation: the products of the half-precision
operands are exact, summed in another order than cuBLAS, so within fp32 rounding; under Triton's CPU interpreter,
which multiplies bf16 tiles wrongly, the tiles go to fp32 first), takes the top ``k`` of ``scores + bias`` (hash
layers: the token's row of ``tid2eid``), and writes the renormalized, scaled weights and the experts, in
``topk``'s order (largest first; equal values: the lower expert id).

Only the rollout engine's eager decode step calls it (``kernels.reference.slots``), through the triton op table's
extra op ``route_experts``; a compiled step keeps the torch code, which Inductor fuses. No gradient. Where the
tokens are few (a decode step), the gate GEMM splits over channel ranges (:func:`split_of`) and the last program
of each token block to finish (a ticket, :mod:`kernels.triton.tickets`) sums the ranges' partial logits in order and
picks: one launch either way.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import pdl
from kernels.triton.tickets import counters, last_ticket, release

__all__ = ["launch_settings", "part_channels", "split_of", "route_experts", "route_experts_launch"]

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
MAX_EXPERTS = 512              # the scores of a program's tokens stay in registers (V4-Pro: 384 experts)
TOKENS = 16                    # tokens a program routes (tl.dot's smallest row block): the router weight is read
                               # once per 16 tokens


@triton.jit
def _gate_dot(X, W, acc, rows64, rmask, experts, emask, d_lo, d_hi, D, BD: tl.constexpr, STAGES: tl.constexpr,
              F32: tl.constexpr):
    """``acc += x[rows, d_lo:d_hi] @ w[:, d_lo:d_hi]^T`` (fp32 accumulation), ``BD`` channels a step."""
    for d0 in tl.range(d_lo, d_hi, BD, num_stages=STAGES):     # pipelined: the weight's channels streamed
        d = d0 + tl.arange(0, BD)
        dmask = d < d_hi
        x = tl.load(X + rows64[:, None] * D + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(W + experts.to(tl.int64)[:, None] * D + d[None, :], mask=emask[:, None] & dmask[None, :],
                    other=0.0)
        if F32:                  # the interpreter: tf32 holds every bf16 / fp16 value, the products are exact
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
    return acc


@triton.jit
def _pick(acc, BIAS, TABLE, IDS, WEIGHTS, IDX, rows64, rmask, experts, emask, scale, K: tl.constexpr,
          KP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr,
          RENORM: tl.constexpr):
    """From the gate's logits ``acc [BT, BE]``: the scores, the tokens' ``K`` experts and weights, stored."""
    if FUNC == 0:        # sqrt(softplus), softplus as torch's: x above 20 is its own value
        scores = tl.sqrt(tl.where(acc > 20.0, acc, tl.log(1.0 + tl.exp(tl.minimum(acc, 20.0)))))
    elif FUNC == 1:
        scores = 1.0 / (1.0 + tl.exp(-acc))
    else:
        z = tl.where(emask[None, :], acc, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    scores = tl.where(emask[None, :], scores, 0.0)
    ks = tl.arange(0, KP)                                           # the k picks, padded to a power of two
    kmask = ks < K
    picks = tl.full([BT, KP], -1, dtype=tl.int64)
    wts = tl.zeros([BT, KP], dtype=tl.float32)
    if HASH:
        tok = tl.load(IDS + rows64, mask=rmask, other=0)
        picks = tl.load(TABLE + tok[:, None] * K + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=-1)
        for j in tl.static_range(K):
            e = tl.sum(tl.where(ks[None, :] == j, picks, 0), axis=1)                       # [BT]
            wj = tl.sum(tl.where(experts[None, :].to(tl.int64) == e[:, None], scores, 0.0), axis=1)
            wts = tl.where(ks[None, :] == j, wj[:, None], wts)
    else:
        sel = tl.where(emask[None, :], scores + tl.load(BIAS + experts, mask=emask, other=0.0)[None, :],
                       float("-inf"))
        for j in tl.static_range(K):
            best = tl.max(sel, axis=1)
            e = tl.min(tl.where(sel == best[:, None], experts[None, :], BE), axis=1)    # equal values: lower id
            hit = experts[None, :] == e[:, None]
            wj = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            picks = tl.where(ks[None, :] == j, e.to(tl.int64)[:, None], picks)
            wts = tl.where(ks[None, :] == j, wj[:, None], wts)
            sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        wts = wts / tl.sum(wts, axis=1)[:, None]
    out = rows64[:, None] * K + ks[None, :]
    omask = rmask[:, None] & kmask[None, :]
    tl.store(WEIGHTS + out, wts * scale, mask=omask)
    tl.store(IDX + out, picks, mask=omask)


@triton.jit
def _route_kernel(X, W, BIAS, TABLE, IDS, WEIGHTS, IDX, T, D, E, scale,
                  K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                  STAGES: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr,
                  F32: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``i``: tokens ``[i BT, (i+1) BT)``: their gate scores over the ``E`` experts, their ``K`` experts
    and weights."""
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    experts = tl.arange(0, BE)
    emask = experts < E
    acc = _gate_dot(X, W, tl.zeros([BT, BE], dtype=tl.float32), rows64, rmask, experts, emask, 0, D, D, BD, STAGES,
                    F32)
    _pick(acc, BIAS, TABLE, IDS, WEIGHTS, IDX, rows64, rmask, experts, emask, scale, K, KP, BT, BE, FUNC, HASH,
          RENORM)


@triton.jit
def _route_part_kernel(X, W, PART, TICKETS, BIAS, TABLE, IDS, WEIGHTS, IDX, T, D, E, DPER, SPLIT, scale,
                       K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                       STAGES: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr,
                       F32: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(i, s)``: the gate logits of tokens ``[i BT, (i+1) BT)`` over channels ``[s DPER, (s+1) DPER)``,
    to ``PART[s]``, then a ticket of the token block ``i``; the program whose ticket completes the block's
    ``SPLIT`` sums the ranges' partial logits in order (the same sums on every call) and picks as
    :func:`_route_kernel`."""
    pdl.wait_prior(PDL)
    i = tl.program_id(0)
    rows = i * BT + tl.arange(0, BT)
    s = tl.program_id(1)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    experts = tl.arange(0, BE)
    emask = experts < E
    d_lo = s * DPER
    acc = _gate_dot(X, W, tl.zeros([BT, BE], dtype=tl.float32), rows64, rmask, experts, emask, d_lo,
                    tl.minimum(d_lo + DPER, D), D, BD, STAGES, F32)
    tl.store(PART + (s.to(tl.int64) * T + rows64)[:, None] * BE + experts[None, :], acc, mask=rmask[:, None])
    if last_ticket(TICKETS + i, SPLIT):
        acc = tl.zeros([BT, BE], dtype=tl.float32)
        for r in range(0, SPLIT):
            acc += tl.load(PART + (r * T + rows64)[:, None] * BE + experts[None, :], mask=rmask[:, None], other=0.0,
                           cache_modifier=".cg")
        _pick(acc, BIAS, TABLE, IDS, WEIGHTS, IDX, rows64, rmask, experts, emask, scale, K, KP, BT, BE, FUNC, HASH,
              RENORM)
        release(TICKETS + i)


def launch_settings(experts_block: int) -> dict:
    """Launch settings for ``experts_block`` (the experts, padded to a power of two): ``BD`` channels a reduction
    step, pipeline ``STAGES``, ``WARPS``. Why pipelined and wide: one program per 16 tokens streams the whole
    router weight (256 KB at the Flash-shaped model's 32 experts), and with 64-channel steps one after another
    the launch took 26 us of an eager decode step whatever the batch (four layers: 104 us at one sequence,
    ``bench/results/rollout-h200-flash-shaped-triton-eager-route-order.json``), waiting on each load in turn.
    The fastest of the sweep (``python -m bench.kernels_decode_sweep``,
    ``bench/results/kernels-decode-sweep-h200.json``, at 1, 64 and 256 tokens): 10 us at 32 experts (no
    register spills on sm_90, triton 3.6); at 256 (V4-Flash: 2 MB of weight for one program) 33 us at 8 warps with
    720 bytes spilled, where the 64-channel steps without spills took 37 us and 4 warps (31 us) spill 2 KB. At
    512 (untimed) the 32-channel steps, which compile without spills."""
    if experts_block <= 64:
        return dict(BD=512, STAGES=3, WARPS=4)
    return dict(BD=128, STAGES=3, WARPS=8) if experts_block <= 256 else dict(BD=32, STAGES=3, WARPS=8)


SPLIT_PROGRAMS = 128           # programs the split router aims at (the GPU's SMs, about)
SPLIT_MIN_CHANNELS = 256       # channels a program of the split router reads at least


def part_channels(experts_block: int) -> int:
    """Channels a reduction step of the split router's first kernel (its ranges are short, so narrower steps than
    :func:`launch_settings`' cost little): the widest that compile without register spills on sm_90 (triton 3.6,
    ptxas) at :func:`launch_settings`' warps: 128 up to 64 experts, 64 up to 256, 32 above."""
    return 128 if experts_block <= 64 else (64 if experts_block <= 256 else 32)


def split_of(tokens: int, channels: int) -> int:
    """How many channel ranges the router's gate GEMM splits into (1: the one-pass kernel). Why: one program per 16
    tokens streams the whole router weight, so a decode step of 64 tokens ran 4 programs on a GPU of 132 SMs (10 us
    at the Flash-shaped model's 32 experts, 33 us at V4-Flash's 256 with 2 MB of weight a program, about 1.3 ms of
    a V4-Flash step's 40 learned layers; ``bench/results/kernels-decode-sweep-h200.json``). Split into ranges of
    at least :data:`SPLIT_MIN_CHANNELS` channels until about :data:`SPLIT_PROGRAMS` programs run; the last program
    of each token block sums the partial logits in order and picks (at one sequence on an H200, when a second
    kernel did that, the two took 9.10 and 13.52 us over the four layers,
    ``bench/results/rollout-h200-flash-shaped-triton-profile-linear-group-head.json``)."""
    blocks = -(-tokens // TOKENS)
    return max(1, min(SPLIT_PROGRAMS // blocks, channels // SPLIT_MIN_CHANNELS))


def route_experts_launch(x, w, bias, table, ids, topk: int, route_scale: float, score_func: str, config=None):
    """The kernel on checked inputs (``x [T, d]``, ``w [E, d]`` contiguous; ``bias [E]`` fp32 for a learned
    layer, ``table [V, k]`` int64 and ``ids [T]`` int64 for a hash layer) -> ``(weights [T, k] fp32, idx [T, k]
    int64)``; ``config`` overrides keys of :func:`launch_settings` (the sweep's)."""
    T, D = x.shape
    E = w.shape[0]
    weights = torch.empty(T, topk, dtype=torch.float32, device=x.device)
    idx = torch.empty(T, topk, dtype=torch.long, device=x.device)
    if T:
        hashed = table is not None
        dummy = weights                                            # a pointer the untaken branch never reads
        BE = max(16, triton.next_power_of_2(E))
        c = {**launch_settings(BE), "SPLIT": split_of(T, D), **(config or {})}
        pick = dict(K=topk, KP=triton.next_power_of_2(topk), BT=TOKENS, BE=BE, FUNC=SCORE_FUNCS.index(score_func),
                    HASH=hashed, RENORM=score_func != "softmax")
        tables = (dummy if hashed else bias, table if hashed else dummy, ids if hashed else dummy, weights, idx)
        blocks = triton.cdiv(T, TOKENS)
        if c["SPLIT"] <= 1:
            _route_kernel[(blocks,)](x, w, *tables, T, D, E, float(route_scale), BD=c["BD"], STAGES=c["STAGES"],
                                     F32=gpu_common.interpreting(), num_warps=c["WARPS"], **pick,
                                     **pdl.launch(x.device))
        else:
            dper = triton.cdiv(D, c["SPLIT"])
            split = triton.cdiv(D, dper)
            part = torch.empty(split, T, BE, dtype=torch.float32, device=x.device)
            _route_part_kernel[(blocks, split)](x, w, part, counters(x.device, blocks), *tables, T, D, E, dper, split,
                                                float(route_scale), BD=part_channels(BE), STAGES=c["STAGES"],
                                                F32=gpu_common.interpreting(), num_warps=c["WARPS"], **pick,
                                                **pdl.launch(x.device))
    return weights, idx


def route_experts(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], table: Optional[torch.Tensor],
                  ids: Optional[torch.Tensor], topk: int, route_scale: float, score_func: str
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.moe.route`` for one token per row, without the routing seam: ``(weights [T, k] fp32,
    idx [T, k] int64)`` of ``x [T, d]`` under the router weight ``w [E, d]`` (bf16 or fp16, one dtype; CUDA):
    a learned layer's ``bias [E]`` (fp32), or a hash layer's ``table [V, k]`` (``tid2eid``, int64) and the tokens'
    ``ids`` (``table`` and ``bias`` not both). Anything else is refused with the reason."""
    op = "route_experts"
    for t, name in ((x, "x"), (w, "w")):
        gpu_common.check_op_input(op, t, name, dtypes=(torch.bfloat16, torch.float16))
    T, D = x.shape if x.dim() == 2 else (None, None)
    hashed = table is not None
    problem = None
    if D is None or w.dim() != 2 or w.shape[1] != D or w.dtype != x.dtype:
        problem = (f"x {tuple(x.shape)} {x.dtype} with w {tuple(w.shape)} {w.dtype} (needs x [T, d], w [E, d] of "
                   f"one dtype)")
    elif not 1 <= w.shape[0] <= MAX_EXPERTS or not 1 <= topk <= w.shape[0]:
        problem = f"top {topk} of {w.shape[0]} experts (needs 1 to {MAX_EXPERTS} experts, k no more)"
    elif score_func not in SCORE_FUNCS:
        problem = f"score function {score_func!r} (serves {', '.join(SCORE_FUNCS)})"
    elif hashed == (bias is not None) or (hashed and (ids is None or ids.shape != (T,) or ids.dtype != torch.long
                                                      or table.dtype != torch.long or table.shape[1] != topk)):
        problem = "a learned layer's fp32 bias [E], or a hash layer's int64 table [V, k] with int64 ids [T]"
    elif not hashed and (bias.dtype != torch.float32 or bias.shape != (w.shape[0],)):
        problem = f"bias {tuple(bias.shape)} {bias.dtype} (needs fp32 [E])"
    elif x.requires_grad or w.requires_grad:
        problem = "inputs that require a gradient (the kernel has no backward: decode only)"
    if problem is not None:
        raise gpu_common.op_refusal(op, problem)
    return route_experts_launch(x.contiguous(), w.contiguous(), None if hashed else bias.contiguous(),
                                table.contiguous() if hashed else None, ids.contiguous() if hashed else None,
                                topk, route_scale, score_func)
