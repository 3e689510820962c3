"""The triton backend's weighted RMS norm (``kernels/triton/norm.py`` ``rms_norm``) against the reference op
(``kernels.reference.layers.rms_norm``), and ``engine.layers.RMSNorm`` running it from the triton op table.

Oracle: the reference op in fp64 on the same inputs (weight included). The kernel rounds in the reference's order;
only the row sums' order differs, so outputs are held to one rounding of the output dtype (``_backends.within``;
two under the interpreter, which truncates). ``dw`` is a sum over rows: held to a few fp32 steps of the sum of
magnitudes. Cases: bf16 and fp32 inputs, bf16 and fp32 (``keep_fp32``) weights, odd row counts and dims that are not
powers of two, zero rows, large values. With no GPU, ``TRITON_INTERPRET=1`` runs these small shapes.
"""

import pytest
import torch

from kernels.reference.layers import rms_norm as reference

from ._backends import triton_device, within as _within

pytestmark = pytest.mark.gpu

EPS = 1e-6
CASES = [
    pytest.param((37, 80), torch.bfloat16, torch.bfloat16, id="bf16-odd-rows-D80"),
    pytest.param((2, 5, 96), torch.bfloat16, torch.float32, id="bf16-x-fp32-weight"),
    pytest.param((19, 48), torch.float32, torch.float32, id="fp32-keep-fp32"),
    pytest.param((1, 4096, 4096), torch.bfloat16, torch.bfloat16, id="flash-hidden",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]


def _inputs(shape, dtype, wdtype, dev, scale=3.0):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(wdtype).to(dev)
    dy = torch.randn(*shape, generator=g).to(dtype).to(dev)
    return x, w, dy


def _run(fn, x, w, dy):
    xl, wl = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = fn(xl, wl, EPS)
    y.backward(dy.to(y.dtype))
    return y, xl.grad, wl.grad


@pytest.mark.parametrize("shape,dtype,wdtype", CASES)
def test_rms_norm_forward_and_backward_match_the_reference(shape, dtype, wdtype):
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from kernels.triton.backend import ops

    dev = triton_device()
    table = ops()
    x, w, dy = _inputs(shape, dtype, wdtype, dev)
    reset_kernels_ran()
    y, dx, dw = _run(table.rms_norm, x, w, dy)
    assert kernels_ran() == {"triton.rms_norm": 1}
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == wdtype
    ey, edx, edw = _run(reference, x.double(), w.double(), dy.double())
    interp = dev == "cpu"
    _within(y, ey.detach(), dtype, f"forward {shape}", interp)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    r = torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS)
    gd = dyd * wd
    terms = r * gd.abs() + xd.abs() * r ** 3 * (gd * xd).mean(-1, keepdim=True).abs()
    _within(dx, edx, dtype, f"dx {shape}", interp, scale=terms)
    dw_scale = (dyd * xd * r).abs().reshape(-1, shape[-1]).sum(0)
    _within(dw, edw, wdtype, f"dw {shape}", interp, scale=dw_scale)


def test_rms_norm_zero_rows_and_large_values():
    from kernels.triton.norm import rms_norm

    dev = triton_device()
    x, w, dy = _inputs((0, 40), torch.bfloat16, torch.float32, dev)
    y, dx, dw = _run(rms_norm, x, w, dy)
    assert y.shape == (0, 40) and dx.shape == (0, 40) and torch.equal(dw, torch.zeros_like(w))
    x, w, dy = _inputs((9, 40), torch.bfloat16, torch.float32, dev, scale=3e4)
    y, dx, dw = _run(rms_norm, x, w, dy)
    ey, edx, _ = _run(reference, x.double(), w.double(), dy.double())
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    _within(y, ey.detach(), torch.bfloat16, "forward, |x| ~ 3e4", dev == "cpu")


def test_rms_norm_refuses_what_it_cannot_serve():
    from kernels.triton.norm import rms_norm

    dev = triton_device()
    x, w, _ = _inputs((4, 8), torch.float32, torch.float32, dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        rms_norm(x.double(), w, EPS)
    with pytest.raises(ValueError, match=r"weight \[D\]"):
        rms_norm(x, w[:4], EPS)


def test_engine_rms_norm_runs_the_kernel_from_the_op_table():
    """``engine.layers.RMSNorm(ops=triton table)``: the kernel serves it (counted), the keep_fp32 weight stays
    fp32 through a bf16 cast, and the output equals the module without a table (the reference op) within a
    rounding of bf16."""
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from engine.layers import RMSNorm
    from kernels.triton.backend import ops

    dev = triton_device()
    x, _, _ = _inputs((7, 24), torch.bfloat16, torch.bfloat16, dev)
    kept = RMSNorm(24, EPS, keep_fp32=True, ops=ops()).to(dev).to(torch.bfloat16)
    plain = RMSNorm(24, EPS, keep_fp32=True).to(dev).to(torch.bfloat16)
    assert kept.weight.dtype == torch.float32
    with torch.no_grad():
        kept.weight.uniform_(0.5, 1.5)
        plain.weight.copy_(kept.weight)
    reset_kernels_ran()
    got = kept(x)
    assert kernels_ran() == {"triton.rms_norm": 1}
    _within(got, plain(x).double(), torch.bfloat16, "engine RMSNorm", dev == "cpu")
