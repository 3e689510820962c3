"""The triton backend's Walsh-Hadamard transform (``kernels/triton/hadamard.py``) against
``kernels.reference.compressor.hadamard_transform``.

Oracle: the reference op on the same inputs, which the kernel must match bit for bit on a GPU (it runs the same
butterfly stages and rounds each to the input dtype, as torch's separate kernels do), and the exact transform
in float64 for the gradient (the reference's autograd runs the stages in reverse order: other roundings).

Shapes: the indexer's queries ``[B, S, 64, 128]`` and pooled keys ``[B, 128]`` of the Flash-shaped model (GPU
only), small rows of 2 to 1,024 channels. With no GPU, ``TRITON_INTERPRET=1`` runs the small shapes; the
interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest, so there bf16 is checked within a few
bf16 steps of the row's largest magnitude per stage (fp32 stays exact).
"""

import pytest
import torch

from kernels.reference.compressor import hadamard_transform as reference

from ._backends import triton_device

pytestmark = pytest.mark.gpu

SHAPES = [
    pytest.param((3, 5, 4, 128), id="small-queries"),
    pytest.param((7, 16), id="rows-of-16"),
    pytest.param((2, 2), id="rows-of-2"),
    pytest.param((4, 1024), id="rows-of-1024"),
    pytest.param((2, 4096, 64, 128), id="flash-indexer-q",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
    pytest.param((64, 128), id="flash-pooled-keys",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]


def _check(got, want, what):
    if got.is_cuda or got.dtype == torch.float32:
        print(f"{what}: {(got == want).float().mean().item():.6%} of elements bitwise equal")
        assert torch.equal(got, want), what
        return
    stages = want.shape[-1].bit_length()
    bound = stages * 2.0 ** -7 * want.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= bound).all(), what


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_hadamard_matches_the_reference(shape, dtype):
    from kernels.triton.hadamard import hadamard_transform

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(triton_device())
    _check(hadamard_transform(x), reference(x), f"forward {shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_hadamard_backward_is_the_transform_of_the_gradient(dtype):
    from kernels.triton.hadamard import hadamard_transform

    dev = triton_device()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 128, generator=g).to(dtype).to(dev).requires_grad_(True)
    dy = torch.randn(6, 3, 128, generator=g).to(dtype).to(dev)
    hadamard_transform(x).backward(dy)
    exact = reference(dy.double())                   # H symmetric: the gradient is the transform of dy
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    assert x.grad.dtype == dtype
    assert ((x.grad.double() - exact).abs() <= 8 * step * exact.abs().amax(-1, keepdim=True)).all()


def test_hadamard_refuses_what_it_cannot_serve():
    from kernels.triton.hadamard import hadamard_transform

    dev = triton_device()
    with pytest.raises(ValueError, match="power of two.*--kernel-backend none"):
        hadamard_transform(torch.randn(3, 96, device=dev))
    with pytest.raises(ValueError, match="--kernel-backend none"):
        hadamard_transform(torch.randn(3, 128, device=dev, dtype=torch.float64))
    if dev == "cuda":
        with pytest.raises(ValueError, match="CUDA tensors"):
            hadamard_transform(torch.randn(3, 128))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("n", [2, 128, 1024])
def test_the_kernel_compiles_for_sm90(dtype, n):
    """The kernel compiles to PTX for sm_90 (H100/H200) with triton alone, no GPU (the interpreter runs code the
    compiler rejects: the stages' reshapes, permutes, splits and joins of a register tile)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import hadamard as K

    br = max(1, K.ELEMENTS_PER_PROGRAM // n)
    consts = dict(N=n, LOG_N=n.bit_length() - 1, BR=br, ROUND=dtype != "fp32")
    sig = {"X": f"*{dtype}", "Y": f"*{dtype}", "R": "i32", "scale": "fp32", **{k: "constexpr" for k in consts}}
    compiled = compile(ASTSource(K._hadamard_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    assert ".entry" in compiled.asm["ptx"]
