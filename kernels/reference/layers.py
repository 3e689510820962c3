"""Small shared building blocks: a bare ``Linear``, ``RMSNorm`` and the fp32-keeping mixin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import wgrad

__all__ = ["Linear", "RMSNorm", "KeepFP32", "compute_dtype", "rms_normalize", "rms_norm", "linear_fp32",
           "mm_fp32_out", "half_linear_backward", "label_logprobs", "head_logprobs", "grouped_projection"]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 if any input is fp64 (lets tests run the whole model in double precision)."""
    dt = torch.float32
    for t in tensors:
        dt = torch.promote_types(dt, t.dtype)
    return dt


class KeepFP32(nn.Module):
    """Mixin: the tensors named in ``_fp32_names`` (direct params/buffers of the module) keep
    float32 storage when the module is cast (``.to(torch.bfloat16)``, ``.half()``, ...).
    Device moves and ``to_empty`` still apply. Casting to float64 is allowed (tests)."""

    _fp32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        keep = set()
        for n in self._fp32_names:
            t = self._parameters.get(n, None)
            if t is None:
                t = self._buffers.get(n, None)
            if t is not None:
                keep.add(id(t))

        def guarded(t):
            out = fn(t)
            if (id(t) in keep and t.dtype == torch.float32 and out.is_floating_point()
                    and out.dtype not in (torch.float32, torch.float64)):
                if t.is_meta or out.is_meta:
                    return torch.empty_like(out, dtype=torch.float32)
                return t.to(device=out.device)
            return out

        return super()._apply(guarded, recurse=recurse)


class Linear(nn.Module):
    """``y = x W^T`` (no bias). Storage only ``weight [out, in]``; no costly init at construction
    (``init_weights`` initializes), so huge configs build quickly on the meta device."""

    def __init__(self, in_features: int, out_features: int, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def rms_normalize(x: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim, computed in fp32 (fp64 for fp64 input), returned in that
    compute dtype or cast to ``out_dtype``."""
    ct = compute_dtype(x)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if out_dtype is None else y.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMS normalisation over the last dim (every model's ``RMSNorm``): ``x * rsqrt(mean(x^2) + eps) * w``
    in the compute dtype (fp32; fp64 for fp64 input), returned in ``x``'s dtype.

    The rounding order is part of the contract (the kernels follow it): the normalised rows are rounded to the
    compute dtype, then multiplied by the weight upcast to it (exact), then cast once to ``x``'s dtype. The
    weight's gradient comes back in the weight's own dtype (fp32 for an fp32-kept weight)."""
    y = rms_normalize(x, eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


class RMSNorm(KeepFP32):
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32, cast back to the input dtype; weight stays fp32.

    ``ops``: a kernel op table (``core.kernel_ops.OpTable``) whose ``rms_norm`` the forward calls; None (the
    reference model) = :func:`rms_norm`."""

    _fp32_names = ("weight",)
    ops = None

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm if self.ops is None else self.ops.rms_norm)(x, self.weight, self.eps)


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 accumulation and an fp32 result. Half-precision CUDA operands run one tensor-core
    GEMM (``torch.mm(..., out_dtype=float32)``); elsewhere the operands are upcast first (same products,
    exact in fp32, so the same value up to summation order)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    ct = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(ct) @ b.to(ct)


class _HalfInputFp32Linear(torch.autograd.Function):
    """``y [N, d] @ w [V, d]^T`` -> fp32 for half-precision ``y`` and ``w`` without fp32 copies of either.
    Backward takes the output gradient in the operands' dtype (as a bf16 megatron linear does) and
    accumulates in fp32."""

    @staticmethod
    def forward(ctx, y, w):
        ctx.save_for_backward(y, w)
        return mm_fp32_out(y, w.t())

    @staticmethod
    def backward(ctx, g):
        y, w = ctx.saved_tensors
        return half_linear_backward(y, w, g.to(y.dtype), ctx.needs_input_grad[0], ctx.needs_input_grad[1])


def half_linear_backward(y: torch.Tensor, w: torch.Tensor, g: torch.Tensor, need_dy: bool = True,
                         need_dw: bool = True):
    """``(dy, dw)`` of ``y [N, d] @ w [V, d]^T`` for an output gradient ``g [N, V]`` in the operands' dtype (None
    where not needed), both GEMMs accumulating in fp32. The weight's gradient goes straight into its fp32
    gradient buffer when ``wgrad_fusion`` marked it (``kernels.wgrad``; the returned ``dw`` is then the marker)."""
    dy = mm_fp32_out(g, w).to(y.dtype) if need_dy else None
    if not need_dw:
        return dy, None
    if wgrad.fused(w) and not wgrad.wgrad_refusal(w.main_grad, y, g):
        wgrad.wgrad_into(w.main_grad, y, g)     # straight into the fp32 gradient buffer (the trainer's choice)
        return dy, wgrad.added_marker(w, w.dtype)
    return dy, mm_fp32_out(g.t(), y).to(w.dtype)


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` in fp32 (fp64 if either operand is fp64): the GEMMs whose result DeepSeek-V4 keeps in fp32
    (compressor projections, logits). For bf16 / fp16 ``x`` and ``w`` of one dtype this is one tensor-core
    GEMM with fp32 accumulation and output (the products of half-precision values are exact in fp32, so it
    equals the upcast fp32 GEMM up to summation order); otherwise the operands are upcast."""
    if x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype:
        return _HalfInputFp32Linear.apply(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    ct = compute_dtype(x, w)
    return F.linear(x.to(ct), w.to(ct))


class _GroupedProjection(torch.autograd.Function):
    """``u[n, g] = o[n, g] @ w[g]^T`` for ``o [N, G, d]`` and ``w [G, R, d]``, each way one batched GEMM over
    the groups that reads and writes the token-major tensors in place (a group is a strided matrix: row
    stride ``G * d``, batch stride ``d``). ``torch.einsum`` permutes ``o`` to group-major first and the result
    back, copies of ``[N, G, d]`` each way (about 17 ms a step at the Flash shape)."""

    @staticmethod
    def forward(ctx, o, w):
        N, G, _ = o.shape
        u = o.new_empty(N, G, w.shape[1])
        torch.bmm(o.transpose(0, 1), w.transpose(1, 2), out=u.transpose(0, 1))
        ctx.save_for_backward(o, w)
        return u

    @staticmethod
    def backward(ctx, gu):
        o, w = ctx.saved_tensors
        gu = gu.contiguous().transpose(0, 1)                                   # [G, N, R], strided
        go = gw = None
        if ctx.needs_input_grad[0]:
            go = torch.empty_like(o, memory_format=torch.contiguous_format)
            torch.bmm(gu, w, out=go.transpose(0, 1))
        if ctx.needs_input_grad[1]:
            gw = torch.bmm(gu.transpose(1, 2), o.transpose(0, 1))
        return go, gw


def grouped_projection(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's grouped low-rank output projection ``einsum("...gd,grd->...gr", o, w)`` (``o [..., G, d]``,
    ``w [G, R, d]`` of ``o``'s dtype) without the einsum's group-major copies; forward and backward are the
    einsum's products in another memory order (one batched GEMM a way)."""
    lead, (G, d) = o.shape[:-2], o.shape[-2:]
    return _GroupedProjection.apply(o.reshape(-1, G, d), w).view(*lead, G, w.shape[1])


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)[label]`` over the last dim: ``logits [..., V]``, ``labels [...]`` -> fp32 ``[...]``
    (the trainer's op: ``rollout.logprobs.next_token_logprobs``'s math, gathered)."""
    lg = logits.float()
    if temperature != 1.0:
        lg = lg / temperature
    return torch.log_softmax(lg, dim=-1).gather(-1, labels[..., None]).squeeze(-1)


def head_logprobs(y: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The output head with the labels' log-probs: ``y [N, d]``, ``w [V, d]``, ``labels [N]`` long -> fp32 ``[N]``,
    ``log softmax(linear_fp32(y, w) / T)[label]``. An op of the kernel table: the trainer needs one log-prob per
    token, and a backend may fuse the passes after the GEMM (``kernels/triton/logprobs.py``)."""
    return label_logprobs(linear_fp32(y, w), labels, temperature)
