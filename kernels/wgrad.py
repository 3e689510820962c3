"""Weight gradients written straight into a parameter's fp32 gradient buffer (gradient-accumulation fusion).

Why: megatron-core's data-parallel wrapper keeps every parameter's gradient in an fp32 buffer (``param.main_grad``)
and, unfused, each backward first writes the weight gradient in bf16 and then a second pass casts it into that
buffer (a step's first micro-batch) or adds it (every later one): one memory-bound pass over all parameters per
micro-batch, whatever its number of tokens, so it weighs most where micro-batches are small. Here the
weight-gradient GEMM itself writes the buffer: bf16 operands, fp32 products and sums, the fp32 result stored into
``main_grad`` (the step's first gradient of the parameter) or added to it in the GEMM's epilogue (cuBLAS with
``beta = 1``: ``torch.addmm(main, g^T, x, out_dtype=float32, out=main)``). No bf16 gradient is written and no
pass is left. It is what megatron-core's ``gradient_accumulation_fusion`` does with Apex's
``fused_weight_gradient_mlp_cuda``, which these machines lack; :data:`APEX_API` is that module's API written with
torch's GEMM, for megatron-core's own linears (``engine.wgrad_fusion``).

The buffer is not zeroed at the start of a step (``engine.grad_buffers.CopyFirstDDP``): a buffer marked by
:func:`mark_last_step` still holds the previous step's gradient, and :func:`claim` tells its first writer of the
step to overwrite it. The mark lives on the ``main_grad`` tensor itself, so megatron-core's linears (which hold
only ``main_grad``) and the project's (which hold the parameter) read the same one.

Numerics: the fused gradient skips the bf16 rounding of the unfused weight gradient (the products of bf16 values
are exact in fp32; the sum runs in fp32 either way), so it is the more exact of the two; they differ by at most
that rounding of each micro-batch's gradient.

On the CPU (tests) the same contract runs as an fp32 GEMM of the upcast operands and a copy or add.
"""

from __future__ import annotations

import types

import torch

__all__ = ["APEX_API", "added_marker", "claim", "claim_all", "fused", "grouped_wgrad_gemms", "linear", "mark_last_step",
           "wgrad_into", "wgrad_refusal"]

_LAST_STEP = "holds_last_step"       # attribute on a main_grad tensor: it still holds the previous step's gradient
_FUSED = "fuse_wgrad"                # attribute on a parameter: its weight gradient goes straight to main_grad


def mark_last_step(main_grad: torch.Tensor, holds: bool = True) -> None:
    """Mark ``main_grad`` as holding the previous step's gradient (its first writer overwrites it)."""
    setattr(main_grad, _LAST_STEP, holds)


def claim(main_grad: torch.Tensor) -> bool:
    """Whether ``main_grad`` still holds the previous step's gradient, so that the caller must overwrite it rather
    than add to it; from this call on it holds this step's."""
    last = getattr(main_grad, _LAST_STEP, False)
    if last:
        setattr(main_grad, _LAST_STEP, False)
    return last


def claim_all(main_grads) -> bool:
    """:func:`claim` for buffers written by one GEMM (a bank of experts): whether it must overwrite them all. A bank
    whose buffers disagree (some still hold the last step's gradient) has those zeroed first, then is added to."""
    last = [claim(m) for m in main_grads]
    if all(last):
        return True
    for m, held in zip(main_grads, last):
        if held:
            m.zero_()
    return False


def _product_into(out: torch.Tensor, gt: torch.Tensor, x: torch.Tensor, accumulate: bool) -> None:
    """``out`` (fp32) gets ``gt @ x`` (bf16 / fp16 operands), stored or added: on CUDA one cuBLAS GEMM with an fp32
    result written into ``out`` (``beta = 1`` when adding); the CPU has no mixed-dtype GEMM, so there the same
    products are upcast first."""
    if out.is_cuda:
        if accumulate:
            torch.addmm(out, gt, x, out_dtype=torch.float32, out=out)
        else:
            torch.mm(gt, x, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.add_(gt.float() @ x.float())
    else:
        out.copy_(gt.float() @ x.float())


def grouped_wgrad_gemms(main: torch.Tensor, x: torch.Tensor, g: torch.Tensor, bounds, accumulate: bool) -> None:
    """The grouped weight gradient as one GEMM per group into its fp32 slice of ``main [E, out, in]``: ``main[e]``
    gets ``g[rows_e]^T @ x[rows_e]`` with rows ``bounds[e]:bounds[e+1]`` (``[0, ends...]`` on the host), stored,
    or added in the epilogue when ``accumulate``. Why not one grouped kernel: torch's grouped GEMM has no fp32
    accumulate into an existing buffer, and the Triton one (``kernels.triton.grouped_wgrad``) runs below cuBLAS at
    the Flash shapes (bench/results/kernels-grouped-wgrad-gemms-h200.json), which ate the pass it saves. The host
    loop costs one launch per expert, each over that expert's rows (hundreds of rows a step)."""
    for e in range(main.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        _product_into(main[e], g[s:t].t(), x[s:t], accumulate)


def fused(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient is to be written into its ``main_grad`` (``engine.wgrad_fusion.enable``)."""
    return getattr(weight, _FUSED, False) and getattr(weight, "main_grad", None) is not None


def wgrad_refusal(main_grad: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> str:
    """Why :func:`wgrad_into` cannot serve these tensors ("" when it can): bf16 or fp16 operands of one dtype, an
    fp32 contiguous ``main_grad [out, in]`` matching ``g [..., out]`` and ``x [..., in]``."""
    if x.dtype not in (torch.bfloat16, torch.float16) or g.dtype != x.dtype:
        return f"operands {x.dtype} / {g.dtype} (the fused weight gradient takes bf16 or fp16 of one dtype)"
    if main_grad.dtype != torch.float32 or not main_grad.is_contiguous():
        return f"a {main_grad.dtype} gradient buffer that is{'' if main_grad.is_contiguous() else ' not'} contiguous"
    if tuple(main_grad.shape) != (g.shape[-1], x.shape[-1]) or g.numel() // g.shape[-1] != x.numel() // x.shape[-1]:
        return f"shapes {tuple(main_grad.shape)} for g {tuple(g.shape)} and x {tuple(x.shape)}"
    return ""


def wgrad_into(main_grad: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> None:
    """``main_grad [out, in]`` (fp32) gets ``g^T @ x`` over all rows of ``x [..., in]`` and ``g [..., out]``:
    stored when :func:`claim` says the buffer holds the last step's gradient, else added."""
    why = wgrad_refusal(main_grad, x, g)
    if why:
        raise ValueError(f"fused weight gradient: {why}")
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    _product_into(main_grad, g2.t(), x2, accumulate=not claim(main_grad))


def added_marker(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a fused backward returns as the weight's gradient: an uninitialized tensor of its shape (autograd
    needs one; nothing reads it), after flagging the weight so megatron-core's gradient hook adds nothing. A fresh
    tensor each time: autograd keeps a gradient it alone references without copying it."""
    weight.grad_added_to_main_grad = True
    return torch.empty(weight.shape, dtype=dtype, device=weight.device)


class _Linear(torch.autograd.Function):
    """``x @ w^T`` whose backward writes ``w``'s gradient into ``w.main_grad`` (:func:`wgrad_into`)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = g @ w if ctx.needs_input_grad[0] else None
        wgrad_into(w.main_grad, x, g)
        return dx, added_marker(w, g.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias), its weight gradient fused into ``w.main_grad`` when :func:`fused` says so and
    the operands suit :func:`wgrad_into` (else plain ``F.linear``)."""
    if fused(w) and w.requires_grad and torch.is_grad_enabled() and x.dtype == w.dtype \
            and x.dtype in (torch.bfloat16, torch.float16):
        return _Linear.apply(x, w)
    return torch.nn.functional.linear(x, w)


def _apex_wgrad_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    wgrad_into(main_grad, total_input, grad_output)


def _apex_wgrad_half(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    raise NotImplementedError("fused weight gradients into a bf16/fp16 buffer: the trainer keeps them in fp32 "
                              "(grad_reduce_in_fp32). Fix: wgrad_fusion=off")


#: Apex's ``fused_weight_gradient_mlp_cuda`` API as megatron-core's linears call it (``wgrad_gemm_accum_fp32
#: (input, grad_output, main_grad)``), on :func:`wgrad_into`.
APEX_API = types.SimpleNamespace(wgrad_gemm_accum_fp32=_apex_wgrad_fp32, wgrad_gemm_accum_fp16=_apex_wgrad_half)
