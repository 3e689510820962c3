"""Triton Walsh-Hadamard transform over the last dim: :func:`kernels.reference.compressor.hadamard_transform` in one
kernel, the reference's butterflies and roundings in registers.

Why: the reference runs ``log2(n)`` butterfly stages of three torch kernels each (the sums, the differences, a
stack), 21 kernels for the indexer's 128 channels, plus the scale. The rollout engine's eager decode step calls it
twice a step (the indexer's query and the indexer compressor's pooled entry), 42 of the step's small kernels
(``docs/rollout.md``, kernel ops); training calls it on the indexer's queries and keys.

The kernel keeps each row in registers and runs the same stages in the same order: stage ``h`` (1, 2, 4, ...) sees
a row as ``[n / 2h, 2, h]`` and replaces each pair ``(a, b)`` by ``(a + b, a - b)``, rounded to the input dtype as
torch's separate kernels round them (the sum in fp32, then to bf16 / fp16); then the product with ``n^-1/2`` in
fp32, rounded once more. So on a GPU the output is the reference's, bit for bit. Triton's CPU interpreter
truncates fp32 -> bf16 casts instead of rounding them, so there it is within a few bf16 steps.

The transform is its own inverse and symmetric (``H = H^T``, ``H H = 1``): its backward is the same kernel on
the upstream gradient (the reference's autograd runs the stages in reverse order: the same sums, other roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common, gpu_ops

__all__ = ["hadamard_transform", "hadamard_launch", "MAX_SIZE"]

#: The longest row the kernel transforms (a row lives in one program's registers).
MAX_SIZE = 4096
ELEMENTS_PER_PROGRAM = 4096


@triton.jit(do_not_specialize=["R"])
def _hadamard_kernel(X, Y, R, scale, N: tl.constexpr, LOG_N: tl.constexpr, BR: tl.constexpr,
                     ROUND: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, N)
    mask = (rows < R)[:, None]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    y = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(LOG_N):                # stage s pairs entries 2^s apart
        pairs = tl.permute(tl.reshape(y, (BR, N >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))    # [BR, blocks, h, 2]
        a, b = tl.split(pairs)
        total, diff = a + b, a - b
        if ROUND:                                   # the reference's stage output is a tensor of x's dtype
            total = total.to(Y.dtype.element_ty).to(tl.float32)
            diff = diff.to(Y.dtype.element_ty).to(tl.float32)
        y = tl.reshape(tl.permute(tl.join(total, diff), (0, 1, 3, 2)), (BR, N))
    tl.store(Y + offs, (y * scale).to(Y.dtype.element_ty), mask=mask)


def hadamard_launch(x: torch.Tensor) -> torch.Tensor:
    """The ``dsv4_triton::hadamard`` op's launcher: ``x [R, n]`` contiguous, ``n`` a power of two -> ``[R, n]``."""
    R, n = x.shape
    y = torch.empty_like(x)
    if R == 0:
        return y
    br = max(1, min(triton.next_power_of_2(R), ELEMENTS_PER_PROGRAM // n))
    _hadamard_kernel[(triton.cdiv(R, br),)](x, y, R, float(n ** -0.5), N=n, LOG_N=n.bit_length() - 1, BR=br,
                                            ROUND=x.dtype != torch.float32, num_warps=4)
    return y


@gpu_ops.traceable
def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.reference.compressor.hadamard_transform` in one kernel: ``x [..., n]`` (CUDA, bf16/fp16/fp32,
    ``n`` a power of two from 2 to :data:`MAX_SIZE`) -> the same shape and dtype. Differentiable (the backward is
    the same transform). Anything else is refused with the reason."""
    gpu_common.check_op_input("hadamard_transform", x, "x")
    n = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or n < 2 or n > MAX_SIZE or n & (n - 1):
        raise gpu_common.op_refusal("hadamard_transform", f"x {tuple(x.shape)} (needs [..., n] with n a power of "
                                                          f"two from 2 to {MAX_SIZE})")
    flat = x.contiguous().view(-1, n)
    return gpu_ops.TRITON.hadamard(flat).view(x.shape)
