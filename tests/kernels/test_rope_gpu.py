"""The triton backend's rotary embedding (``kernels/triton/rope.py``) against ``kernels.reference.rope.apply_rope``.

Oracle: the reference op on the same inputs (fp32 math for bf16/fp16/fp32 inputs, as the kernel), which the
kernel must match bit for bit on a GPU: it rounds each product on its own as torch's separate kernels do (a
fused multiply-add, Triton's default, differed in up to 25% of fp32 outputs and in 12 bf16 elements of a
Flash-shaped query; H200, 2026-12-02). The backward is checked against the reference op's autograd gradient on
the same upstream gradient.

Shapes: the Flash-shaped query (4096 tokens x 64 heads x 512, 64 rope channels), a KV / attention-output row
``[B, S, D]``, per-sequence angles ``[B, S, r/2]`` (packed THD positions), and odd sizes (D = 80, 16 rope
channels, 37 tokens). With no GPU, ``TRITON_INTERPRET=1`` runs the small shapes; otherwise they skip.
"""

import pytest
import torch

from kernels.reference.rope import apply_rope as reference_rope
from kernels.reference.rope import rope_cos_sin, rope_inv_freq

from ._backends import triton_device

pytestmark = pytest.mark.gpu

SHAPES = [
    pytest.param(dict(x=(2, 37, 3, 80), rope=16, per_batch=False), id="small-heads"),
    pytest.param(dict(x=(2, 19, 96), rope=32, per_batch=True), id="small-rows-per-batch-angles"),
    pytest.param(dict(x=(1, 4096, 64, 512), rope=64, per_batch=False), id="flash-q",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
    pytest.param(dict(x=(1, 4096, 512), rope=64, per_batch=True), id="flash-kv-thd",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]


def _inputs(shape, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape["x"], generator=g).to(dtype).to(dev)
    B, S = shape["x"][:2]
    inv = rope_inv_freq(shape["rope"], 160000.0, 16.0, 65536, 32.0, 1.0)     # a compressed layer's YaRN angles
    if shape["per_batch"]:   # packed sequences: positions restart per segment
        pos = torch.cat([torch.arange(n) for n in (S // 3, S - S // 3)]).expand(B, S).to(dev)
    else:
        pos = torch.arange(S, device=dev)
    cos, sin = rope_cos_sin(inv, pos)
    return x, cos, sin


def _check(got, want, what):
    """On a GPU the kernel gives the reference's bits. Triton's CPU interpreter truncates fp32 -> bf16 casts
    where the GPU rounds to nearest: there, within one bf16 step of each rotated pair's length."""
    if got.is_cuda or got.dtype == torch.float32:
        same = (got == want).float().mean().item()
        print(f"{what}: {same:.6%} of elements bitwise equal")
        assert torch.equal(got, want), what
        return
    pair = want.float().unflatten(-1, (-1, 2)).norm(dim=-1, keepdim=True).expand(*want.shape[:-1], -1, 2).flatten(-2)
    assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * pair + 1e-30).all(), what


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "inverse"])
def test_rope_matches_the_reference(shape, dtype, inverse):
    from kernels.triton.rope import apply_rope

    x, cos, sin = _inputs(shape, dtype, triton_device())
    _check(apply_rope(x, cos, sin, inverse=inverse), reference_rope(x, cos, sin, inverse=inverse),
           f"forward {tuple(x.shape)} {dtype} inverse={inverse}")


@pytest.mark.parametrize("shape", SHAPES)
def test_rope_backward_is_the_references(shape):
    from kernels.triton.rope import apply_rope

    dev = triton_device()
    x, cos, sin = _inputs(shape, torch.bfloat16, dev)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype).to(dev)
    grads = []
    for fn in (apply_rope, reference_rope):
        leaf = x.detach().requires_grad_(True)
        fn(leaf, cos, sin).backward(g)
        grads.append(leaf.grad)
    _check(grads[0], grads[1], f"backward {tuple(x.shape)}")


def test_rope_refuses_what_it_cannot_serve():
    from kernels.triton.rope import apply_rope

    dev = triton_device()
    x, cos, sin = _inputs(dict(x=(1, 8, 2, 64), rope=16, per_batch=False), torch.bfloat16, dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        apply_rope(x.double(), cos, sin)
    with pytest.raises(ValueError, match="one angle per token"):
        apply_rope(x, cos[:4], sin[:4])
    if dev == "cuda":
        with pytest.raises(ValueError, match="CUDA tensors"):
            apply_rope(x.cpu(), cos.cpu(), sin.cpu())
