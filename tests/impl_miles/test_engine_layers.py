"""Engine primitives the training step's speed rests on, against direct computations: the grouped GEMM of
the routed experts (``engine.moe.grouped_linear``), the fp32 logits of a half-precision output layer
(``kernels.reference.layers.linear_fp32``) and the attention's grouped output projection
(``kernels.reference.layers.grouped_projection``; at the Flash shape on a GPU:
tests/kernels/test_grouped_projection_gpu.py)."""

from __future__ import annotations

import torch


def test_grouped_linear_matches_per_group_linear():
    """The grouped GEMM (``torch._grouped_mm``) against one ``F.linear`` per group, with empty groups
    (first, middle, last), forward and both gradients."""
    from engine.moe import _grouped_mm_supported, grouped_linear

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    counts = [0, 7, 0, 12, 3, 0]
    x = torch.randn(sum(counts), 32, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), 48, 32, generator=g).to(dtype).requires_grad_()
    assert _grouped_mm_supported(x, w)
    ends = torch.tensor(counts).cumsum(0)
    y = grouped_linear(x, w, ends)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    assert not _grouped_mm_supported(xr, wr)  # fp32 / fp64 take the per-group loop
    assert not _grouped_mm_supported(xr.float(), wr.float())
    yr = grouped_linear(xr, wr, ends)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    bounds = [0] + ends.tolist()
    direct = torch.cat([xr[s:e] @ wr[i].T for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])
    torch.testing.assert_close(yr, direct)
    tol = dict(atol=0.1, rtol=0.02)
    for a, b in ((y, yr), (dx, dxr), (dw, dwr)):
        torch.testing.assert_close(a.double(), b, **tol)
    assert not dw[[0, 2, 5]].any()


def test_fp32_logits_half_operands_match_fp32_math():
    """bf16 hidden states and head: fp32 logits equal to the upcast fp32 GEMM (same exact products),
    gradients equal to the fp32 autograd ones up to bf16 rounding of the logit gradient, in the operands' dtypes."""
    from kernels.reference.layers import linear_fp32

    g = torch.Generator().manual_seed(6)
    y = torch.randn(2, 5, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16().requires_grad_()
    out = linear_fp32(y, w)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 96)
    yr, wr = y.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = yr @ wr.T
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dl = torch.randn(out.shape, generator=g)
    dy, dw = torch.autograd.grad(out, (y, w), dl)
    dyr, dwr = torch.autograd.grad(ref, (yr, wr), dl)
    assert dy.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    torch.testing.assert_close(dy.float(), dyr, atol=0.02, rtol=0.02)
    torch.testing.assert_close(dw.float(), dwr, atol=0.02, rtol=0.02)
    # fp32 / fp64 operands keep the plain upcast path
    assert linear_fp32(yr, wr).dtype == torch.float32
    assert linear_fp32(yr.double(), wr).dtype == torch.float64


def test_grouped_projection_is_the_einsum():
    """Both implementations' grouped output projection against ``torch.einsum("...gd,grd->...gr")``: in fp64 the
    same products summed in the same order, so forward and both gradients are equal; in bf16 within the einsum's
    own rounding; a non-contiguous output gradient (as a sliced consumer hands back) gives the same gradients."""
    from kernels.reference.layers import grouped_projection

    g = torch.Generator().manual_seed(2)
    o = torch.randn(2, 5, 4, 12, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(4, 3, 12, generator=g, dtype=torch.float64).requires_grad_()
    up = torch.randn(2, 5, 4, 6, generator=g, dtype=torch.float64)[..., ::2]          # strided output gradient
    u, ref = grouped_projection(o, w), torch.einsum("bsgd,grd->bsgr", o, w)
    assert u.shape == ref.shape == (2, 5, 4, 3)
    assert torch.equal(u, ref)
    for a, b in zip(torch.autograd.grad(u, (o, w), up), torch.autograd.grad(ref, (o, w), up)):
        assert torch.equal(a, b)
    ob, wb = o.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ub = grouped_projection(ob.view(10, 4, 12), wb)                                      # [T, G, d] (megatron)
    torch.testing.assert_close(ub.double(), torch.einsum("tgd,grd->tgr", ob.double().view(10, 4, 12), wb.double()),
                               atol=0.05, rtol=0.02)
    dob, dwb = torch.autograd.grad(ub, (ob, wb), up.reshape(10, 4, 3).bfloat16())
    assert dob.shape == ob.shape and dwb.shape == wb.shape and dob.is_contiguous()
