"""The gradient cast kernel (``kernels/triton/grad_copy.py``: a bf16 gradient copied or added into its fp32
main-grad buffer) against torch's ``copy_`` / ``add_``: bit-identical (bf16 -> fp32 is exact; the add is one fp32
addition). Sizes: a tail block only, full blocks plus a tail, exact full blocks, zero. Refusals name the reason.
With no GPU, ``TRITON_INTERPRET=1`` runs them.
"""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 1000, 4096, 2 * 4096 + 77]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("accumulate", [False, True], ids=["copy", "add"])
def test_cast_into_equals_torch(n, accumulate):
    from kernels.triton.grad_copy import cast_into

    dev = triton_device()
    g = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=g) * 10).bfloat16().to(dev)
    main = torch.randn(n, generator=g).to(dev)
    want = main.clone().add_(grad) if accumulate else main.clone().copy_(grad)
    got = cast_into(main, grad, accumulate)
    assert got is main and torch.equal(main, want)


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_cast_into_at_unaligned_offsets(offset):
    """Views that start off a 16-byte boundary (a parameter inside megatron-core's fp32 buffer): the masked head up
    to the boundary, the unmasked body, the tail, and nothing outside the view written."""
    from kernels.triton.grad_copy import cast_into

    dev = triton_device()
    n = 4096 + 37
    g = torch.Generator().manual_seed(offset)
    buffer = torch.randn(n + 16, generator=g).to(dev)
    grads = (torch.randn(n + 16, generator=g) * 10).bfloat16().to(dev)
    want = buffer.clone()
    want[offset:offset + n].add_(grads[3:3 + n])
    cast_into(buffer[offset:offset + n], grads[3:3 + n], True)
    assert torch.equal(buffer, want)


def test_cast_into_refuses_what_it_cannot_serve():
    from kernels.triton.grad_copy import cast_into

    dev = triton_device()
    main = torch.zeros(8, device=dev)
    with pytest.raises(ValueError, match="bf16 into fp32"):
        cast_into(main, torch.zeros(8, device=dev, dtype=torch.float16), False)
    with pytest.raises(ValueError, match="contiguous"):
        cast_into(main, torch.zeros(16, device=dev, dtype=torch.bfloat16)[::2], False)
