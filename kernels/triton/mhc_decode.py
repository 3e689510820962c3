"""The mHC pre and the norm after it in one launch for a decode step's few tokens: the extra ops ``hc_pre_norm``
and ``hc_head_norm`` (the head's collapse and the model's final norm, the same kernel without the residual
coefficients).

    y, post, comb = hc_pre_norm(x, fn, scale, base, norm_eps, hc_eps, iters, weight, eps)
                  = (rms_norm(u, weight, eps), post, comb)  where  u, post, comb = hc_pre(x, fn, scale, ...)

Why: a site of the eager decode step (a layer's attention and its MoE, each behind an mHC pre) ran four kernels
before the sublayer: the split mixing GEMM, the sum of its partials, the coefficients with ``u``, and the norm
(``kernels.triton.mhc``, ``kernels.triton.norm``). At one sequence they took about 5.1, 2.0, 6.7 and 1.8 us a
site on an H100, each of them a launch that reads a few kilobytes and waits on the one before
(``bench/results/rollout-h100-flash-shaped-triton-profile-linear-group.json``): latency, not bandwidth. Here the
programs of the split GEMM each write their partial and take a ticket (an atomic counter); the program that
takes the last ticket has every partial and does the rest alone: their sum, the coefficients and the Sinkhorn
loop, ``u`` and its norm. It then sets the counter back to 0 for the next launch (one counter per device,
:mod:`kernels.triton.tickets`). One program reads all of
``u``'s streams, so this plan serves up to ``max_tokens`` tokens. Above it (a decode step of many sequences) the op
is two launches: ``kernels.triton.mhc``'s split mixing GEMM writes its partials, then :func:`_rows_kernel` runs
the same tail once a token, one program each (their sum, the coefficients, ``u`` and its norm), where the sum, the
coefficients with ``u`` and the norm were three launches more (``rows`` off keeps them, for the sweep's A/B): on
one H100 a Flash site took 12.6 us at 64 tokens against 20.56, and 25.57 against 31.99 at 256
(``bench/results/kernels-decode-sweep-h100-mhc-rows.json``). All are this backend's kernels, the same op for the
same inputs, chosen by the token count alone (a CUDA graph holds one plan).
In the H100's one-sequence step the 9 launches took 109.11 us where the three split kernels had taken 124.28 and
the norms 23.18, and the step 1.673 ms against 1.708 without the op
(``bench/results/rollout-h100-flash-shaped-triton-profile-hc-pre-norm.json``,
``bench/results/rollout-h100-flash-shaped-triton-ablate-hc-pre-norm.json``).

Where one token's streams fit the registers (``tail_plan``: a Flash site's four 4,096-wide streams), the last
program asks for them and the norm's weight before it sums the partials, so those loads overlap the sum and the
Sinkhorn loop, and keeps ``u`` in registers for the norm; before, it wrote ``u`` in two steps and read it back. On
one H100 a launch took 9.44 us against 10.6 for the best settings of the two-step tail, and the step's 9 launches
98.6 us against 108.27 (``python -m bench.kernels_decode_sweep --only mhc``,
``bench/results/kernels-decode-sweep-h100-mhc-one-pass.json``;
``bench/results/rollout-h100-flash-shaped-triton-one-pass.json``,
``bench/results/rollout-h100-flash-shaped-triton-profile-s38.json``). Of the 9.44 us, the 19 Sinkhorn iterations
after the first take about 2.3 (the same launch with one iteration: 7.1 us): a serial chain of two shuffles and a
division a step in the one program.

The math is the reference's (``kernels.reference.mhc.hc_pre``, then ``kernels.reference.layers.rms_norm`` on ``u``
rounded to the streams' dtype); the partials are those of ``kernels.triton.mhc``'s split GEMM (fp32, ``tf32x3``),
summed in a fixed order (the same outputs on every replay).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.triton import mhc, mhc_checks, norm
from kernels.triton import pdl
from kernels.triton.mhc import coefficients, mix_partial, mix_sums
from kernels.triton.tickets import counters, last_ticket, release

__all__ = ["hc_pre_norm", "hc_head_norm", "moe_combine_post", "tail_plan", "PRE_NORM_CONFIG"]

# programs: the split GEMM's programs (whole BK chunks of K each); BT: tl.dot's row step (the tokens, padded);
# max_tokens: the most tokens the one-program tail takes; rows: above it, the split GEMM and a program a token
# (_rows_kernel; off, for the sweep's A/B: the split GEMM's sum, the coefficients with u and the norm, two launches
# more); split_BT, split_BK: the tokens and channels a step of a program of that split GEMM takes (64 tokens at 32
# channels took a Flash site of 256 tokens in 17.62 us against 24.84 at 16 x 64, 64 tokens in 11.23 against 12.58,
# 4 in 10.41 against 10.94 on one H100, bench/results/kernels-decode-sweep-h100-mhc-rows-split.json; 64 channels at
# 64 tokens spill 352 bytes of registers in ptxas for sm_90);
# one_pass: the tail holds u in registers where the
# streams fit (tail_plan; off: always the u loop); TAIL_ELEMENTS: the streams' values one step of the tail's u loop
# loads (BD = TAIL_ELEMENTS / (tokens x streams), so two tokens' four 4,096-wide streams are four steps)
PRE_NORM_CONFIG = dict(programs=128, BT=16, BK=64, warps=4, stages=2, max_tokens=gpu_common.PRE_NORM_MAX_TOKENS,
                       one_pass=True, rows=True, split_BT=64, split_BK=32)
TAIL_ELEMENTS = 8192
# the most streams' values (tokens x streams x d, padded) the tail holds at once: up to this it loads them all before
# the partials' sum and keeps u in registers (one token's four 4,096-wide streams: 64 registers a thread of bf16)
ONE_PASS_ELEMENTS = 16384
# the lines of the mapping a program of the split GEMM asks L2 for before it waits (with PDL): 4 lines of 32 fp32,
# the 128 columns a program reads of a Flash-shaped site's 16,384 (128 programs)
FN_LINES = tl.constexpr(4)

@triton.jit
def _tail(PART, SSP, MIXS, SCALE, BASE, X, W, Y, POST, COMB, T, K, SPLIT, n, d, norm_eps, hc_eps, iters, eps, t0,
          HAS_RES: tl.constexpr, TB: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr,
          SB: tl.constexpr, ONE_PASS: tl.constexpr = False):
    """Tokens ``t0 .. t0 + TB``: the partials' sum (:func:`kernels.triton.mhc.mix_sums`), the coefficients
    (:func:`kernels.triton.mhc.coefficients`), then ``u`` rounded to ``Y``'s dtype and its weighted RMS norm (the
    last program's work in :func:`_pre_norm_kernel`, a program's in :func:`_rows_kernel`). ``ONE_PASS`` (``BD``
    covers ``d``): the streams and the norm's weight are asked for first, so that their loads overlap the sum and
    the Sinkhorn loop, and ``u`` stays in registers; else ``u`` is written to ``Y`` in ``BD`` steps and read back
    for the norm."""
    t = t0 + tl.arange(0, TB)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    if ONE_PASS:
        jj = tl.arange(0, NP)
        dd = tl.arange(0, BD)
        dmask = dd < d
        xs = tl.load(X + t64[:, None, None] * (n * d) + jj[None, :, None] * d + dd[None, None, :],
                     mask=tmask[:, None, None] & (jj < n)[None, :, None] & dmask[None, None, :], other=0.0)
        w = tl.load(W + dd, mask=dmask, other=0.0).to(tl.float32)
    mix, _ = mix_sums(PART, SSP, T, K, SPLIT, norm_eps, t, TB, MP, SB)
    tl.store(MIXS + t64[:, None] * MP + m[None, :], mix, mask=tmask[:, None])
    tl.debug_barrier()                                   # the coefficients read MIXS back in another layout
    pre, j, tj = coefficients(MIXS, SCALE, BASE, POST, COMB, t, tmask, n, hc_eps, iters, True, HAS_RES, NP, MP)
    if ONE_PASS:
        u = tl.sum(pre[:, :, None] * xs.to(tl.float32), 1).to(Y.dtype.element_ty).to(tl.float32)
        r = tl.rsqrt(tl.sum(u * u, 1) / d + eps)
        y = u * r[:, None]                               # rounded to fp32 first, as the reference
        tl.store(Y + t64[:, None] * d + dd[None, :], (y * w[None, :]).to(Y.dtype.element_ty),
                 mask=tmask[:, None] & dmask[None, :])
    else:
        _u_norm_in_steps(X, W, Y, pre, t64, tmask, tj, j, n, d, eps, TB, BD)


@triton.jit
def _u_norm_in_steps(X, W, Y, pre, t64, tmask, tj, j, n, d, eps, TB: tl.constexpr, BD: tl.constexpr):
    """``u`` of the streams that do not fit the registers at once: written to ``Y`` in ``BD`` steps, then read back
    for its weighted norm, written over it."""
    xrow = X + t64[:, None, None] * (n * d) + j[None, :, None] * d
    sq = tl.zeros([TB], dtype=tl.float32)
    for d0 in range(0, d, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < d
        x = tl.load(xrow + dd[None, None, :], mask=tj[:, :, None] & dmask[None, None, :], other=0.0)
        u = tl.sum(pre[:, :, None] * x.to(tl.float32), 1).to(Y.dtype.element_ty)
        uf = u.to(tl.float32)
        sq += tl.sum(uf * uf, 1)
        tl.store(Y + t64[:, None] * d + dd[None, :], u, mask=tmask[:, None] & dmask[None, :])
    r = tl.rsqrt(sq / d + eps)
    tl.debug_barrier()                                   # the norm reads u back in another layout
    for d0 in range(0, d, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < d
        ym = tmask[:, None] & dmask[None, :]
        u = tl.load(Y + t64[:, None] * d + dd[None, :], mask=ym, other=0.0).to(tl.float32)
        w = tl.load(W + dd, mask=dmask, other=0.0).to(tl.float32)
        y = u * r[:, None]                               # rounded to fp32 first, as the reference
        tl.store(Y + t64[:, None] * d + dd[None, :], (y * w[None, :]).to(Y.dtype.element_ty), mask=ym)


@triton.jit
def _mapping_lines(FN, M, K, KPER, s, MP: tl.constexpr):
    """Pointers ``[MP, FN_LINES]`` to the 128-byte lines (32 fp32 columns) of the mapping ``FN [M, K]``'s columns
    ``[s KPER, (s + 1) KPER)`` that program ``s`` reads (rows past ``M`` repeat the last, columns past the range its
    last: a prefetch of an address twice costs nothing)."""
    m = tl.minimum(tl.arange(0, MP), M - 1)
    c = s * KPER + tl.minimum(tl.arange(0, FN_LINES) * 32, KPER - 1)
    return FN + m.to(tl.int64)[:, None] * K + c[None, :]


@triton.jit
def _pre_norm_kernel(X, FN, PART, SSP, MIXS, TICKET, SCALE, BASE, W, Y, POST, COMB, T, K, M, KPER, SPLIT, n, d,
                     norm_eps, hc_eps, iters, eps, HAS_RES: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     MP: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, TB: tl.constexpr,
                     NP: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr, ONE_PASS: tl.constexpr = False,
                     PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """Program ``s``: columns ``[s * KPER, (s + 1) * KPER)`` of the mixing GEMM into ``PART[s]``, ``SSP[s]``
    (:func:`kernels.triton.mhc.mix_partial`), then a ticket; the last ticket runs :func:`_tail`. ``PREFETCH``: its
    columns of the mapping ``FN`` asked of L2 before it waits on the kernel before it."""
    pdl.wait_prior_after_prefetch(PDL, PREFETCH, _mapping_lines(FN, M, K, KPER, tl.program_id(0), MP))
    s = tl.program_id(0)
    mix_partial(X, FN, PART, SSP, T, K, M, KPER, 0, s, BT, BK, MP, PREC, STAGES)
    if last_ticket(TICKET, SPLIT):
        _tail(PART, SSP, MIXS, SCALE, BASE, X, W, Y, POST, COMB, T, K, SPLIT, n, d, norm_eps, hc_eps, iters, eps, 0,
              HAS_RES, TB, MP, NP, BD, SB, ONE_PASS)
        release(TICKET)


@triton.jit
def _rows_kernel(PART, SSP, MIXS, SCALE, BASE, X, W, Y, POST, COMB, T, K, SPLIT, n, d, norm_eps, hc_eps, iters,
                 eps, HAS_RES: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr,
                 ONE_PASS: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program ``t``: token ``t``'s :func:`_tail` from the partials of ``kernels.triton.mhc``'s split mixing GEMM
    (the plan above ``max_tokens``: every token's sum, coefficients, ``u`` and norm at once, one program each)."""
    pdl.wait_prior(PDL)
    _tail(PART, SSP, MIXS, SCALE, BASE, X, W, Y, POST, COMB, T, K, SPLIT, n, d, norm_eps, hc_eps, iters, eps,
          tl.program_id(0), HAS_RES, 1, MP, NP, BD, SB, ONE_PASS)


def tail_plan(T: int, n: int, d: int, config: Optional[dict] = None) -> tuple:
    """``(one_pass, BD)`` of the tail for ``T`` tokens of ``n`` streams of ``d``: all of ``d`` in registers where the
    streams fit ``ONE_PASS_ELEMENTS`` (and ``one_pass`` is on), else ``BD`` columns a step of ``TAIL_ELEMENTS``."""
    cfg = {**PRE_NORM_CONFIG, **(config or {})}
    tb, np_, dp = triton.next_power_of_2(T), mhc_checks.padded(n), triton.next_power_of_2(d)
    if cfg["one_pass"] and tb * np_ * dp <= ONE_PASS_ELEMENTS:
        return True, dp
    return False, min(dp, max(16, TAIL_ELEMENTS // (tb * np_)))


def _outputs(x2, n, d, MP, has_res):
    """Both plans' ``(mixs [T, MP] scratch, y [T, d], post [T, n], comb [T, n, n])`` (``post``, ``comb`` empty
    without ``has_res``) for the tokens of ``x2``."""
    T, dev = x2.shape[0], x2.device
    mixs = torch.empty(T, MP, dtype=torch.float32, device=dev)
    y = torch.empty(T, d, dtype=x2.dtype, device=dev)
    post = torch.empty(T, n if has_res else 0, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n if has_res else 0, n, dtype=torch.float32, device=dev)
    return mixs, y, post, comb


def _launch(x2, fn, scale, base, weight, n, d, norm_eps, hc_eps, iters, eps, has_res, cfg):
    """One launch of :func:`_pre_norm_kernel` on ``x2 [T, n d]`` (T <= max_tokens) -> ``(y [T, d], post, comb)``."""
    T, K = x2.shape
    M = fn.shape[0]
    MP, NP = gpu_ops.mix_width(M), mhc_checks.padded(n)
    dev = x2.device
    bk = cfg["BK"]
    kper = triton.cdiv(triton.cdiv(K, cfg["programs"]), bk) * bk
    split = triton.cdiv(K, kper)
    part = torch.empty(split, T, MP, dtype=torch.float32, device=dev)
    ssp = torch.empty(split, T, dtype=torch.float32, device=dev)
    mixs, y, post, comb = _outputs(x2, n, d, MP, has_res)
    tb = triton.next_power_of_2(T)
    one_pass, bd = tail_plan(T, n, d, cfg)
    sb = mhc.partials_a_load(split, tb, MP)
    _pre_norm_kernel[(split,)](x2, fn, part, ssp, mixs, counters(dev, 1), scale, base, weight, y,
                               post if has_res else mixs, comb if has_res else mixs, T, K, M, kper, split, n, d,
                               float(norm_eps), float(hc_eps), int(iters), float(eps), HAS_RES=has_res,
                               BT=cfg["BT"], BK=bk, MP=MP, PREC=mhc.PRECISION, STAGES=cfg["stages"], TB=tb, NP=NP,
                               BD=bd, SB=sb, ONE_PASS=one_pass, num_warps=cfg["warps"],
                               **pdl.launch(x2.device, prefetch=True))
    return y, post, comb


def _launch_rows(x2, fn, scale, base, weight, n, d, norm_eps, hc_eps, iters, eps, has_res, cfg):
    """Above ``max_tokens``: ``kernels.triton.mhc``'s split mixing GEMM (its partials), then :func:`_rows_kernel`,
    one program a token -> ``(y [T, d], post, comb)``."""
    T, K = x2.shape
    M = fn.shape[0]
    MP, NP = gpu_ops.mix_width(M), mhc_checks.padded(n)
    mcfg = {**mhc.MHC_CONFIG, "mix_BT": cfg["split_BT"], "mix_BK": cfg["split_BK"]}
    part, ssp, split = mhc.mix_parts(x2, fn, MP, mcfg, max(1, mhc.mix_split(T, K, mcfg)))
    mixs, y, post, comb = _outputs(x2, n, d, MP, has_res)
    one_pass, bd = tail_plan(1, n, d, cfg)
    _rows_kernel[(T,)](part, ssp, mixs, scale, base, x2, weight, y, post if has_res else mixs,
                       comb if has_res else mixs, T, K, split, n, d, float(norm_eps), float(hc_eps), int(iters),
                       float(eps), HAS_RES=has_res, MP=MP, NP=NP, BD=bd, SB=mhc.partials_a_load(split, 1, MP),
                       ONE_PASS=one_pass, num_warps=cfg["warps"], **pdl.launch(x2.device))
    return y, post, comb


def _check_norm_weight(op: str, x: torch.Tensor, fn: torch.Tensor, weight: torch.Tensor) -> None:
    d = x.shape[-1]
    if weight.shape != (d,) or weight.dtype not in (torch.float32, x.dtype) or weight.device != x.device:
        raise gpu_common.op_refusal(op, f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} "
                                        f"(needs [{d}] in fp32 or {x.dtype} on {x.device})")
    if x.requires_grad or fn.requires_grad:
        raise gpu_common.op_refusal(op, "an input that requires a gradient (the op is the decode step's and has no "
                                        "backward)")


def _pre_norm(x, fn, scale, base, norm_eps, hc_eps, iters, weight, eps, has_res: bool, config):
    """Both ops on checked inputs: one launch up to ``max_tokens`` tokens, else the split mixing GEMM and a program
    a token (``rows``; off: ``kernels.triton.mhc``'s ``hc_pre`` with ``has_res``, ``hc_head`` without, and the
    norm's kernels) -> ``(y, post, comb)`` over ``x``'s leading shape (``post`` and ``comb`` None without
    ``has_res``)."""
    cfg = {**PRE_NORM_CONFIG, **(config or {})}
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    x3 = x.reshape(-1, n, d)
    T = x3.shape[0]
    if T <= cfg["max_tokens"] or cfg["rows"]:
        launch = _launch if T <= cfg["max_tokens"] else _launch_rows
        y, post, comb = launch(x3.reshape(T, n * d).contiguous(), fn, scale, base, weight.contiguous(), n, d,
                               norm_eps, hc_eps, iters, eps, has_res, cfg)
    elif has_res:
        u, post, comb, *_ = mhc.hc_pre_fwd(x3, fn, scale, base, float(norm_eps), float(hc_eps), int(iters))
        y = norm.rms_norm_launch(u, weight.contiguous(), float(eps))
    else:
        u = mhc.hc_head_fwd(x3, fn, scale, base, float(norm_eps), float(hc_eps))[0]
        y, post, comb = norm.rms_norm_launch(u, weight.contiguous(), float(eps)), None, None
    if not has_res:
        return y.view(*lead, d), None, None
    return y.view(*lead, d), post.view(*lead, n), comb.view(*lead, n, n)


def hc_pre_norm(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                hc_eps: float, sinkhorn_iters: int, weight: torch.Tensor, eps: float, config: Optional[dict] = None):
    """:func:`kernels.reference.mhc.hc_pre_norm` (module docstring): ``x [..., n, d]`` bf16/fp16, the mHC mapping
    as ``hc_pre`` takes it, the norm's ``weight [d]`` (fp32 or ``x``'s dtype) -> ``(y [..., d] in x's dtype, post
    [..., n], comb [..., n, n] fp32)``. One launch at up to ``max_tokens`` tokens, else two: the split mixing GEMM
    of ``kernels.triton.mhc`` and a program a token. Anything else is refused with the reason."""
    mhc_checks.check_hc_pre(x, fn, scale, base, sinkhorn_iters)
    _check_norm_weight("hc_pre_norm", x, fn, weight)
    return _pre_norm(x, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters, weight, eps, True, config)


def hc_head_norm(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                 hc_eps: float, weight: torch.Tensor, eps: float, config: Optional[dict] = None) -> torch.Tensor:
    """:func:`kernels.reference.mhc.hc_head_norm`: the head's collapse of ``x [..., n, d]`` and the model's final
    norm, one launch at up to ``max_tokens`` tokens (the kernel without the residual coefficients), else two as
    :func:`hc_pre_norm`'s -> ``[..., d]`` in x's dtype."""
    mhc_checks.check_hc_head(x, fn, scale, base)
    _check_norm_weight("hc_head_norm", x, fn, weight)
    return _pre_norm(x, fn, scale, base, norm_eps, hc_eps, 1, weight, eps, False, config)[0]


def moe_combine_post(pairs: torch.Tensor, shared: torch.Tensor, topk: int, x: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.slots.combine_post``: the MoE's output as ``moe_combine`` sums it (a token's ``topk``
    pairs ``pairs [T * topk, d]`` in fp32 one after another, plus its shared expert's ``shared [T, d]``, rounded
    once to ``shared``'s dtype), then the mHC post of the site, ``hc_post(f, x, post, comb)`` (``x [..., n, d]``
    with ``T`` tokens, ``post``/``comb`` fp32): the bits of this backend's ``moe_combine`` then its ``hc_post``, in
    one launch (``kernels.triton.mhc.combine_post_fwd``) -> ``[..., n, d]`` in x's dtype.

    Why: the eager decode step ran the pairs' sum as a launch of its own before each MoE's mHC post: on an H200 the
    Flash-shaped step's four ``_combine_kernel`` launches took 5.94 us at one sequence, 10.33 at 64 and 19.12 at 256,
    besides the gaps between launches (``bench/results/rollout-h200-flash-shaped-triton-profile-linear-group-
    head.json``; their ``_combine_kernel`` rows also hold the attention's split combine where it ran). Decode only
    (no backward). Anything else is refused with the reason."""
    op = "moe_combine_post"
    mhc_checks.check_hc_post(x[..., 0, :], x, post, comb)
    n, d = x.shape[-2:]
    T = x[..., 0, 0].numel()
    for t, name in ((pairs, "pairs"), (shared, "shared")):
        gpu_common.check_op_input(op, t, name)
    if (topk < 1 or pairs.dim() != 2 or shared.dim() != 2 or shared.shape != (T, d)
            or pairs.shape != (T * topk, d) or pairs.dtype != shared.dtype):
        raise gpu_common.op_refusal(op, f"pairs {tuple(pairs.shape)} {pairs.dtype}, shared {tuple(shared.shape)} "
                                        f"{shared.dtype}, top-{topk} for x {tuple(x.shape)} (needs pairs "
                                        f"[T * topk, {d}] and shared [T, {d}] of one dtype, T = x's tokens)")
    if any(t.requires_grad for t in (pairs, shared, x, post, comb)):
        raise gpu_common.op_refusal(op, "an input that requires a gradient (the op is the decode step's and has no "
                                        "backward)")
    out = mhc.combine_post_fwd(pairs, shared, int(topk), x.reshape(T, n, d), post.reshape(T, n),
                               comb.reshape(T, n, n))
    return out.view(x.shape)
