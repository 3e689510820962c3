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
extra op ``route_experts``; a compiled step keeps the torch code, which Inductor fuses. No gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels import gpu_common

__all__ = ["launch_settings", "route_experts", "route_experts_launch"]

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
MAX_EXPERTS = 512              # the scores of a program's tokens stay in registers (V4-Pro: 384 experts)
TOKENS = 16                    # tokens a program routes (tl.dot's smallest row block): the router weight is read
                               # once per 16 tokens


@triton.jit
def _route_kernel(X, W, BIAS, TABLE, IDS, WEIGHTS, IDX, T, D, E, scale,
                  K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                  STAGES: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr,
                  F32: tl.constexpr):
    """Program ``i``: tokens ``[i BT, (i+1) BT)``: their gate scores over the ``E`` experts, their ``K`` experts
    and weights."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    experts = tl.arange(0, BE)
    emask = experts < E
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for d0 in tl.range(0, D, BD, num_stages=STAGES):      # pipelined: one program streams the whole weight
        d = d0 + tl.arange(0, BD)
        dmask = d < D
        x = tl.load(X + rows64[:, None] * D + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(W + experts.to(tl.int64)[:, None] * D + d[None, :], mask=emask[:, None] & dmask[None, :],
                    other=0.0)
        if F32:                  # the interpreter: tf32 holds every bf16 / fp16 value, the products are exact
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
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
        c = {**launch_settings(BE), **(config or {})}
        _route_kernel[(triton.cdiv(T, TOKENS),)](
            x, w, dummy if hashed else bias, table if hashed else dummy, ids if hashed else dummy, weights, idx, T, D,
            E, float(route_scale), K=topk, KP=triton.next_power_of_2(topk), BT=TOKENS, BE=BE,
            BD=c["BD"], STAGES=c["STAGES"], FUNC=SCORE_FUNCS.index(score_func), HASH=hashed,
            RENORM=score_func != "softmax", F32=gpu_common.interpreting(), num_warps=c["WARPS"])
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
