"""The triton backend's weightless RMS norm (``kernels/triton/norm.py``) against the reference op
(``kernels.reference.layers.rms_normalize``).

Oracle: the reference op in fp64 on the same inputs. The kernel sums each row in a different order than torch's
mean, so its output is held to one rounding step of the output dtype at each element's magnitude (fp32 outputs:
a few fp32 steps at the row's largest magnitude), and the reference op's own error against fp64 is printed
beside. The backward is checked against the fp64 reference's autograd gradient for the same upstream gradient.

Shapes: the Flash-shaped query (4096 tokens x 64 heads x 512) and odd sizes (D = 80 and 96, 37 rows). With no
GPU, ``TRITON_INTERPRET=1`` runs the small shapes; otherwise they skip.
"""

import pytest
import torch

from kernels.reference.layers import rms_normalize as reference

from ._backends import triton_device, within as _within

pytestmark = pytest.mark.gpu

EPS = 1e-6
SHAPES = [
    pytest.param((2, 37, 3, 80), id="small-heads"),
    pytest.param((5, 96), id="small-rows"),
    pytest.param((1, 4096, 64, 512), id="flash-q",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]


def _x(shape, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype).to(dev)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_normalize_matches_the_reference(shape, dtype):
    from kernels.triton.norm import rms_normalize

    dev = triton_device()
    x = _x(shape, dtype, dev)
    exact = reference(x.double(), EPS)
    got = rms_normalize(x, EPS, dtype)
    assert got.dtype == dtype and rms_normalize(x, EPS).dtype == torch.float32
    ref_err = (reference(x, EPS, dtype).double() - exact).abs().max().item()
    print(f"reference op's own max error {ref_err:.3e}")
    _within(got, exact, dtype, f"forward {shape} {dtype}", dev == "cpu")


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_normalize_backward(shape):
    from kernels.triton.norm import rms_normalize

    dev = triton_device()
    x = _x(shape, torch.bfloat16, dev)
    dy = _x(shape, torch.bfloat16, dev, seed=1)
    leaf = x.detach().requires_grad_(True)
    rms_normalize(leaf, EPS, torch.bfloat16).backward(dy)
    ref = x.double().requires_grad_(True)
    reference(ref, EPS).backward(dy.double())
    assert leaf.grad.dtype == torch.bfloat16
    # dx = r dy - x r^3 mean(dy x): where the two terms cancel, a rounding step of the terms, not of dx
    xd, dyd = x.double(), dy.double()
    r = torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS)
    terms = r * dyd.abs() + xd.abs() * r ** 3 * (dyd * xd).mean(-1, keepdim=True).abs()
    _within(leaf.grad, ref.grad, torch.bfloat16, f"backward {shape}", dev == "cpu", scale=terms)


def test_rms_normalize_refuses_what_it_cannot_serve():
    from kernels.triton.norm import rms_normalize

    dev = triton_device()
    with pytest.raises(ValueError, match="--kernel-backend none"):
        rms_normalize(_x((4, 8), torch.float32, dev).double(), EPS)
    if dev == "cuda":
        with pytest.raises(ValueError, match="CUDA tensors"):
            rms_normalize(_x((4, 8), torch.bfloat16, "cpu"), EPS)
