"""Triton output head with the labels' log-probs: ``log softmax(y @ w^T / T)[label]`` per row, the logits GEMM
kept, the passes after it fused (``kernels.reference.layers.head_logprobs``).

Why: the trainer needs one number per token (the next token's log-prob), but the torch path materialises the
whole fp32 distribution: ``log_softmax`` reads the fp32 logits ``[N, V]`` and writes as many log-probs (saved for
its backward), the gather's backward fills a zero ``[N, V]`` tensor and scatters into it, ``log_softmax``'s
backward reads two ``[N, V]`` tensors and writes a third, and the head GEMM's backward casts that fp32 gradient
to bf16: six passes over 4 bytes x V per token. On the Flash-shaped model (V = 129,280) that was 56 ms of a
one-second step of eight sequences (``bench.train_cli --profile``, "outside the model"). Here:

* forward: the GEMM writes the fp32 logits (as before); one kernel reads them once, an online max and sum of
  exponentials per row, and returns ``lp = logit[label] / T - lse`` and ``lse``;
* backward: one kernel reads the logits once and writes the logits' gradient straight in the operands' dtype,
  ``g / T * (onehot(label) - exp(logit / T - lse))`` (the torch path rounds the same fp32 value to bf16 in its
  cast), which the head's two GEMMs take as before (``kernels.reference.layers.half_linear_backward``: the
  weight gradient goes into the fp32 gradient buffer when ``wgrad_fusion`` marked the weight).

The autograd function saves the fp32 logits (the torch path saved the same number of fp32 log-probs), so the
peak is unchanged; the freed passes are the win. Labels outside ``[0, V)`` give NaN log-probs (the torch gather
would raise: a kernel cannot, and a host check would cost a synchronisation per micro-batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops
from kernels.reference.layers import half_linear_backward, mm_fp32_out

__all__ = ["head_logprobs", "logprob_stats_launch", "logprob_grad_launch"]

BV_STATS = 4096          # vocabulary columns per iteration of a row's forward program
BV_GRAD = 2048           # vocabulary columns per backward program
LOG2E = tl.constexpr(1.4426950408889634)     # constexpr: a jitted kernel reads only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _logprob_stats_kernel(L, LAB, LP, LSE, temperature, V: tl.constexpr, SCALED: tl.constexpr, BV: tl.constexpr):
    """One row: ``lse`` of ``logits / T`` by an online max and sum (base 2 inside), and the label's log-prob."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * V
    m = tl.full((BV,), -3.0e38, tl.float32)          # finite: no inf - inf in the rescale of unused lanes
    s = tl.zeros((BV,), tl.float32)
    for start in range(0, V, BV):
        cols = start + tl.arange(0, BV)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if SCALED:
            x = x / temperature
        x2 = x * LOG2E
        m_new = tl.maximum(m, x2)
        s = s * tl.exp2(m - m_new) + tl.where(cols < V, tl.exp2(x2 - m_new), 0.0)
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(s * tl.exp2(m - mx), 0)
    lse = (mx + tl.log2(total)) * LN2
    label = tl.load(LAB + row)
    valid = (label >= 0) & (label < V)
    picked = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    if SCALED:
        picked = picked / temperature
    tl.store(LSE + row, lse)
    tl.store(LP + row, tl.where(valid, picked - lse, float("nan")))


@triton.jit
def _logprob_grad_kernel(L, LAB, LSE, G, D, V, temperature, SCALED: tl.constexpr, BV: tl.constexpr):
    """One block of one row: ``d logits = g / T * (onehot(label) - softmax(logits / T))`` in D's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    mask = cols < V
    x = tl.load(L + row * V + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row).to(tl.float32)
    if SCALED:
        x = x / temperature
        g = g / temperature
    p = tl.exp2((x - tl.load(LSE + row)) * LOG2E)
    label = tl.load(LAB + row)
    d = tl.where(cols == label, g - g * p, -g * p)
    tl.store(D + row * V + cols, d.to(D.dtype.element_ty), mask=mask)


def logprob_stats_launch(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """The ``dsv4_triton::logprob_stats`` op's launcher: fp32 ``logits [N, V]``, long ``labels [N]`` (contiguous)
    -> ``(lp [N], lse [N])`` fp32, of ``logits / temperature``."""
    N, V = logits.shape
    lp = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(lp)
    if N:
        _logprob_stats_kernel[(N,)](logits, labels, lp, lse, float(temperature), V=V, SCALED=temperature != 1.0,
                            BV=BV_STATS, num_warps=8)
    return lp, lse


def logprob_grad_launch(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                        temperature: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``dsv4_triton::logprob_grad`` op's launcher: the gradient of the labels' log-probs (upstream ``g [N]``)
    with respect to ``logits [N, V]``, in ``out_dtype``."""
    N, V = logits.shape
    d = torch.empty((N, V), dtype=out_dtype, device=logits.device)
    if N:
        _logprob_grad_kernel[(N, triton.cdiv(V, BV_GRAD))](logits, labels, lse, g, d, V, float(temperature),
                                                   SCALED=temperature != 1.0, BV=BV_GRAD, num_warps=8)
    return d


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, labels, temperature):
        logits = mm_fp32_out(y, w.t())
        lp, lse = gpu_ops.TRITON.logprob_stats(logits, labels, temperature)
        ctx.save_for_backward(y, w, labels, logits, lse)
        ctx.temperature = temperature
        return lp

    @staticmethod
    def backward(ctx, g):
        y, w, labels, logits, lse = ctx.saved_tensors
        d = gpu_ops.TRITON.logprob_grad(logits, labels, lse, g.contiguous(), ctx.temperature, y.dtype)
        del logits
        dy, dw = half_linear_backward(y, w, d, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dy, dw, None, None


def head_logprobs(y: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`kernels.reference.layers.head_logprobs` with the passes after the GEMM fused: ``y [N, d]`` and
    ``w [V, d]`` (CUDA, both bf16 or both fp16), ``labels [N]`` long -> fp32 ``[N]``. Differentiable in ``y`` and
    ``w``. Anything else is refused with the reason."""
    gpu_common.check_op_input("head_logprobs", y, "y")
    gpu_common.check_op_input("head_logprobs", w, "w")
    if y.dtype not in (torch.bfloat16, torch.float16) or w.dtype != y.dtype:
        raise gpu_common.op_refusal("head_logprobs", f"y {y.dtype} and w {w.dtype} (the kernel takes one half "
                                                     f"precision dtype for both: the head's bf16 GEMM)")
    if y.dim() != 2 or w.dim() != 2 or y.shape[1] != w.shape[1] or labels.shape != y.shape[:1]:
        raise gpu_common.op_refusal("head_logprobs", f"y {tuple(y.shape)}, w {tuple(w.shape)}, labels "
                                                     f"{tuple(labels.shape)} (y [N, d], w [V, d], labels [N])")
    if labels.dtype != torch.long or labels.device != y.device:
        raise gpu_common.op_refusal("head_logprobs", f"labels of {labels.dtype} on {labels.device} (long, on "
                                                     f"{y.device})")
    if not temperature > 0:
        raise gpu_common.op_refusal("head_logprobs", f"temperature {temperature} (must be > 0)")
    return _HeadLogprobs.apply(y.contiguous(), w, labels.contiguous(), float(temperature))
