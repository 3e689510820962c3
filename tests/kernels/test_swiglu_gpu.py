"""The triton backend's clamped, gate-weighted SwiGLU (``kernels/triton/swiglu.py``) against the reference op
(``kernels.reference.moe.weighted_swiglu``).

Oracle: the reference op in fp64 on the same inputs (bf16 ``h``, fp32 gate weights), forward and autograd
backward. Bounds: the output and ``dh`` within two rounding steps of bf16 at the magnitude of the terms that
make them (a product of three factors; ``dg``'s SiLU derivative), the gate weights' fp32 gradient within
1e-5 of the row's sum of magnitudes. Inputs are drawn wide enough that the clamp (limit 10, DeepSeek-V4's
``swiglu_limit``) cuts a share of both halves, and with ``limit = 0`` (no clamp: the shared expert's default).

Shapes: Flash-shaped routed rows (4096 tokens x 6 experts, intermediate 2048) and odd sizes. With no GPU,
``TRITON_INTERPRET=1`` runs the small shapes; otherwise they skip.
"""

import pytest
import torch

from kernels.reference.moe import weighted_swiglu as reference

from ._backends import triton_device

pytestmark = pytest.mark.gpu

SHAPES = [
    pytest.param((37, 80), id="small"),
    pytest.param((5, 512), id="small-wide"),
    pytest.param((4096 * 6, 2048), id="flash-rows",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]
BF16 = 2.0 ** -8          # half a bf16 step: one rounding


def _inputs(shape, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, F = shape
    h = (torch.randn(N, 2 * F, generator=g) * 8).bfloat16().to(dev)        # |x| > 10 for about a fifth
    w = torch.rand(N, generator=g).to(dev)
    da = torch.randn(N, F, generator=g).bfloat16().to(dev)
    return h, w, da


def _check(got, exact, scale, what, steps):
    err = (got.double() - exact).abs()
    bound = steps * BF16 * scale
    worst = err.argmax()
    print(f"{what}: max error {err.max().item():.3e} (bound there {bound.flatten()[worst].item():.3e})")
    assert (err <= bound + 1e-30).all(), what


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("limit", [10.0, 0.0], ids=["clamped", "no-clamp"])
def test_weighted_swiglu_forward_and_backward(shape, limit):
    from kernels.triton.swiglu import weighted_swiglu

    dev = triton_device()
    steps = 4 if dev == "cpu" else 2          # the interpreter truncates fp32 -> bf16 where the GPU rounds
    h, w, da = _inputs(shape, dev)
    hk, wk = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
    a = weighted_swiglu(hk, wk, limit, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and weighted_swiglu(h, w, limit).dtype == torch.float32
    a.backward(da)
    hd, wd = h.double().requires_grad_(True), w.double().requires_grad_(True)
    exact = reference(hd, wd, limit)
    exact.backward(da.double())
    gate, up = h.double().chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    sig = torch.sigmoid(gate)
    silu_abs = (gate * sig).abs()
    _check(a, exact.detach(), exact.detach().abs(), f"forward {shape} limit={limit}", steps)
    dsilu = (sig * (1 + gate * (1 - sig))).abs()
    terms = torch.cat((da.double().abs() * up.abs() * w.double()[:, None] * dsilu,
                       da.double().abs() * silu_abs * w.double()[:, None]), dim=-1)
    _check(hk.grad, hd.grad, terms, f"dh {shape} limit={limit}", steps)
    row = (da.double().abs() * silu_abs * up.abs()).sum(-1)
    err = (wk.grad.double() - wd.grad).abs()
    print(f"dw {shape}: max error {err.max().item():.3e}")
    assert (err <= 1e-5 * row + 1e-30).all()


def test_weighted_swiglu_refuses_what_it_cannot_serve():
    from kernels.triton.swiglu import weighted_swiglu

    dev = triton_device()
    h, w, _ = _inputs((4, 8), dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        weighted_swiglu(h.double(), w, 10.0)
    with pytest.raises(ValueError, match=r"needs h \[N, 2F\]"):
        weighted_swiglu(h[:, :15], w, 10.0)
    if dev == "cuda":
        with pytest.raises(ValueError, match="CUDA tensors"):
            weighted_swiglu(h.cpu(), w.cpu(), 10.0)
