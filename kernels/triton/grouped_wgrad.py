"""Triton weight gradient of the routed experts' grouped GEMM, written straight into the fp32 main-grad buffer.

``engine.moe.grouped_linear`` computes ``h = x_rows @ w[e]^T`` per expert ``e`` with ``torch._grouped_mm``; its
backward writes the bf16 gradient of the stacked weights, and ``engine.grad_buffers`` then casts it (a step's first
micro-batch) or adds it (later ones) into megatron-core's fp32 ``main_grad`` with ``kernels/triton/grad_copy.py``.

Why: that is one bf16 write of ``[E, O, I]`` and one more pass over it (a bf16 read, an fp32 read and write) per
micro-batch, and the routed experts hold 3.2 B of the Flash-shaped model's 5.8 B parameters (the step budget in
docs/kernels-and-benchmarks.md#where-the-steps-time-goes counts the cast pass under gradient accumulation). Here the
fp32 sums of the products go into ``main`` directly, once per tile: no bf16 gradient, no second pass, and no rounding
of the gradient to bf16 before it reaches the fp32 buffer.

    main[e] = g[rows_e]^T @ x[rows_e]          (accumulate=False; zeros for an expert with no rows)
    main[e] += g[rows_e]^T @ x[rows_e]         (accumulate=True; an expert with no rows is not written)

``rows_e = ends[e-1]:ends[e]`` (from row 0 for the first expert); rows past the last end belong to no expert and are
not read. One
program per (``[BLOCK_O, BLOCK_I]`` tile of ``main[e]``, expert ``e``) reads ``ends`` on the device and walks the
expert's rows in blocks of ``BLOCK_K``, so nothing synchronises with the host. The products of bf16 numbers are
exact in fp32 and ``tl.dot`` sums them in fp32: the result differs from an fp64 reference only by the order of the
fp32 summation (and, with ``accumulate``, one fp32 addition to ``main``). Under ``TRITON_INTERPRET=1`` the operands
are cast to fp32 before ``tl.dot`` (exact), since the interpreter multiplies bf16 tiles as their raw 16-bit integers.

Launch settings: a fixed table (:data:`CONFIGS`, picked by :func:`launch_config`), not ``triton.autotune``:
autotuning re-runs the kernel, which would add the gradient into ``main`` several times.
``bench/kernels_grouped_wgrad.py --sweep`` times other settings through the ``config`` argument; the table changes
by hand after that.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common

__all__ = ["grouped_wgrad_into", "grouped_wgrad_refusal", "launch_config", "CONFIGS"]

# (smallest O * I served, settings): the first entry whose bound the shape reaches. The large tile (a 128 x 256
# fp32 accumulator over 8 warps, 3 stages of 64-row operand blocks: 144 KiB of shared memory) was the fastest of
# bench/kernels_grouped_wgrad.py --sweep's 32 settings on one H200 at w1 with 49152 rows
# (bench/results/kernels-grouped-wgrad-sweep-h200.json); small shapes (and the interpreter) take a small tile so that
# fewer elements are masked.
CONFIGS = [
    (1024 * 1024, dict(BLOCK_O=128, BLOCK_I=256, BLOCK_K=64, num_warps=8, num_stages=3)),
    (0, dict(BLOCK_O=64, BLOCK_I=64, BLOCK_K=32, num_warps=4, num_stages=2)),
]
CONFIG_KEYS = ("BLOCK_O", "BLOCK_I", "BLOCK_K", "num_warps", "num_stages")


@triton.jit
def _wgrad_kernel(MAIN, X, G, ENDS, O, I, stride_x, stride_g, ACCUMULATE: tl.constexpr, EVEN_O: tl.constexpr,
                  EVEN_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                  FP32_OPERANDS: tl.constexpr):
    e = tl.program_id(1)
    tiles_i = tl.cdiv(I, BLOCK_I)
    o = (tl.program_id(0) // tiles_i) * BLOCK_O + tl.arange(0, BLOCK_O)
    i = (tl.program_id(0) % tiles_i) * BLOCK_I + tl.arange(0, BLOCK_I)
    end = tl.load(ENDS + e).to(tl.int64)
    start = tl.load(ENDS + tl.maximum(e - 1, 0)).to(tl.int64)
    start = tl.where(e > 0, start, 0)
    o_ok = o < O
    i_ok = i < I
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < end
        g_mask = k_ok[:, None] if EVEN_O else k_ok[:, None] & o_ok[None, :]
        x_mask = k_ok[:, None] if EVEN_I else k_ok[:, None] & i_ok[None, :]
        g = tl.load(G + k[:, None] * stride_g + o[None, :], mask=g_mask, other=0.0)     # [BLOCK_K, BLOCK_O]
        x = tl.load(X + k[:, None] * stride_x + i[None, :], mask=x_mask, other=0.0)     # [BLOCK_K, BLOCK_I]
        if FP32_OPERANDS:     # the interpreter only (module docstring)
            g, x = g.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc)
    out = MAIN + e.to(tl.int64) * O * I + o.to(tl.int64)[:, None] * I + i[None, :]
    mask = o_ok[:, None] & i_ok[None, :]
    if ACCUMULATE:
        mask = mask & (end > start)       # an expert with no rows keeps its buffer bit for bit (-0.0 included)
        acc += tl.load(out, mask=mask, other=0.0)
    tl.store(out, acc, mask=mask)


def launch_config(O: int, I: int) -> dict:
    """The settings :data:`CONFIGS` gives a ``[O, I]`` weight (a copy: callers may change it)."""
    for least, cfg in CONFIGS:
        if O * I >= least:
            return dict(cfg)
    return dict(CONFIGS[-1][1])


def grouped_wgrad_refusal(main: torch.Tensor, x: torch.Tensor, g: torch.Tensor, ends: torch.Tensor) -> str:
    """Why :func:`grouped_wgrad_into` cannot serve these tensors ("" when it can): bf16 ``x [N, I]`` and
    ``g [N, O]`` with unit column stride (any row stride: row slices of a larger tensor are fine), a contiguous
    fp32 ``main [E, O, I]``, int32/int64 ``ends [E]``, all on CUDA (or on the CPU under ``TRITON_INTERPRET=1``)."""
    if x.dtype != torch.bfloat16 or g.dtype != torch.bfloat16 or main.dtype != torch.float32:
        return f"x {x.dtype}, g {g.dtype} into {main.dtype} (the kernel takes bf16 x and g into an fp32 buffer)"
    if x.dim() != 2 or g.dim() != 2 or main.dim() != 3 or ends.dim() != 1:
        return (f"shapes x {tuple(x.shape)}, g {tuple(g.shape)}, main {tuple(main.shape)}, ends {tuple(ends.shape)} "
                f"(the kernel takes x [N, I], g [N, O], main [E, O, I], ends [E])")
    E, O, I = main.shape
    if x.shape[0] != g.shape[0] or x.shape[1] != I or g.shape[1] != O or ends.shape[0] != E:
        return (f"x {tuple(x.shape)} and g {tuple(g.shape)} do not match main [E, O, I] = {tuple(main.shape)} "
                f"and ends {tuple(ends.shape)}")
    if ends.dtype not in (torch.int32, torch.int64):
        return f"ends is {ends.dtype} (the kernel reads int32 or int64 cumulative row counts)"
    if not main.is_contiguous():
        return "main is not contiguous"
    if (x.shape[1] > 1 and x.stride(1) != 1) or (g.shape[1] > 1 and g.stride(1) != 1):
        return "x or g has a column stride other than 1 (the kernel reads rows of contiguous elements)"
    if not all(t.is_cuda for t in (main, x, g, ends)) and not gpu_common.interpreting():
        return (f"tensors on {main.device} / {x.device} / {g.device} / {ends.device} (the kernel runs on CUDA; "
                f"TRITON_INTERPRET=1 for the CPU)")
    if len({t.device for t in (main, x, g, ends)}) != 1:
        return "main, x, g and ends are on different devices"
    return ""


def grouped_wgrad_into(main: torch.Tensor, x: torch.Tensor, g: torch.Tensor, ends: torch.Tensor, accumulate: bool,
                       *, config: Optional[dict] = None) -> None:
    """``main[e] (+)= g[rows_e]^T @ x[rows_e]`` for every expert ``e`` (see the module docstring): the weight
    gradient of ``x_rows @ w[e]^T`` summed in fp32 into the fp32 buffer ``main [E, O, I]``, overwritten unless
    ``accumulate``. ``config`` replaces :func:`launch_config`'s settings (keys :data:`CONFIG_KEYS`; for sweeps).
    Anything :func:`grouped_wgrad_refusal` names is refused with that reason; ``ends`` is never read on the host."""
    why = grouped_wgrad_refusal(main, x, g, ends)
    if why:
        raise ValueError(f"triton grouped_wgrad_into: {why}")
    E, O, I = main.shape
    if E == 0 or O == 0 or I == 0:
        return
    cfg = launch_config(O, I) if config is None else {**launch_config(O, I), **config}
    bo, bi, bk = cfg["BLOCK_O"], cfg["BLOCK_I"], cfg["BLOCK_K"]
    grid = (triton.cdiv(O, bo) * triton.cdiv(I, bi), E)
    with torch.profiler.record_function("dsv4_triton::grouped_wgrad_into"):     # a named op for the step's profile
        _wgrad_kernel[grid](main, x, g, ends, O, I, x.stride(0), g.stride(0), ACCUMULATE=bool(accumulate),
                            EVEN_O=O % bo == 0, EVEN_I=I % bi == 0, BLOCK_O=bo, BLOCK_I=bi, BLOCK_K=bk,
                            FP32_OPERANDS=gpu_common.interpreting(), num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"])
