"""One Triton kernel for a bf16 gradient landing in its fp32 main-grad buffer: ``main.copy_(grad)`` or
``main.add_(grad)``.

Why: torch's mixed-dtype ``copy_`` / ``add_`` (bf16 in, fp32 out) is not vectorized and ran near half the HBM
bandwidth: 14.5 ms of the Flash-shaped training step on one H200 went to ``engine.grad_buffers.CopyFirstDDP``'s
copies and adds (bench/results/train-cli-h200-flash-shaped-seq4096-swiglu.json). Here every full block is read
and written with unmasked 16-byte accesses where the pointers allow (the offsets are multiples of the block, so
Triton knows their alignment, as in ``kernels/triton/adamw.py``'s ``ALIGNED`` path); only a head and a tail are
masked, in launches of their own.

Alignment: a parameter's view into megatron-core's fp32 buffer need not start on a 16-byte boundary, and the fp32
stores are two thirds of the bytes moved, so the unmasked body starts at the buffer's first 16-byte boundary (the
up to three elements before it are the masked head). Triton specializes a launch on its pointers' 16-byte
alignment, so the body's stores are 16 bytes wide; the bf16 loads are as wide as the gradient's alignment at that
element allows (16 bytes when both line up, as for a parameter at an aligned offset of the buffer).

Results: bit-identical to torch's. bf16 -> fp32 is exact, so the copy is exact, and the add is one fp32 addition
of the same two fp32 values (``main + float(grad)``, round to nearest even) that torch's ``add_`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_common

__all__ = ["cast_into", "cast_into_refusal"]

BLOCK = 4096           # elements per program: 8 KiB of bf16 in, 16 KiB of fp32 out
NUM_WARPS = 4


@triton.jit
def _cast_kernel(SRC, DST, n, ACCUMULATE: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
        g = tl.load(SRC + offs, mask=mask, other=0.0).to(tl.float32)
        if ACCUMULATE:
            g += tl.load(DST + offs, mask=mask, other=0.0)
        tl.store(DST + offs, g, mask=mask)
    else:
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
        g = tl.load(SRC + offs).to(tl.float32)
        if ACCUMULATE:
            g += tl.load(DST + offs)
        tl.store(DST + offs, g)


def cast_into_refusal(dst: torch.Tensor, src: torch.Tensor) -> str:
    """Why :func:`cast_into` cannot serve ``dst`` / ``src`` ("" when it can): it takes a contiguous bf16 ``src``
    and a contiguous fp32 ``dst`` of the same size, on CUDA (or on the CPU under ``TRITON_INTERPRET=1``)."""
    if src.dtype != torch.bfloat16 or dst.dtype != torch.float32:
        return f"{src.dtype} into {dst.dtype} (the kernel casts bf16 into fp32)"
    if src.numel() != dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        return "the gradient and its buffer differ in size, or one is not contiguous"
    if not (src.is_cuda and dst.is_cuda) and not gpu_common.interpreting():
        return f"tensors on {src.device} / {dst.device} (the kernel runs on CUDA)"
    return ""


def cast_into(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``dst.add_(src)`` when ``accumulate``, else ``dst.copy_(src)``: bf16 ``src`` into fp32 ``dst`` (see the
    module docstring); anything :func:`cast_into_refusal` names is refused with that reason."""
    why = cast_into_refusal(dst, src)
    if why:
        raise ValueError(f"triton cast_into: {why}")
    n = src.numel()
    flat_src, flat_dst = src.view(-1), dst.view(-1)
    head = min(n, (-(dst.data_ptr() // 4)) % 4)          # elements before the buffer's first 16-byte boundary
    body = (n - head) // BLOCK * BLOCK
    with torch.profiler.record_function("dsv4_triton::cast_into"):     # a named op for the step's profile
        for start, count, masked in ((head, body, False), (0, head, True), (head + body, n - head - body, True)):
            if count:
                _cast_kernel[(triton.cdiv(count, BLOCK),)](flat_src[start:], flat_dst[start:], count,
                                                           ACCUMULATE=accumulate, MASKED=masked, BLOCK=BLOCK,
                                                           num_warps=NUM_WARPS)
    return dst
