"""Triton: a compressor's decode step in one kernel (``compressor_step``, the eager static decode step's
``kernels.reference.slots._compress_masked`` after its two GEMMs).

Why: after the GEMMs ``W_kv x`` and ``W_gate x`` a compressor's step was about twenty small kernels (the token's
slot written with its position bias, the slots concatenated with the previous block's, a softmax, a product and
a sum to pool them, a cast, the norm, the rotation, the Hadamard transform, masked writes of the entry and of the
previous block's slots), each a launch in the step's CUDA graph, for every compressor (three a Flash-shaped step,
V4-Flash's 41). And the pooling ran on every row at every step, though a row completes a block once in ``m``
steps: the HCA compressor's (``m = 128``, 512 channels) read 32 MB of fp32 slots a step at 64 sequences, to write
nothing for all but a few rows.

One program a row: it writes the token's slot (``a = kv``, ``z = gate + ape[slot]``); where the token completes a
block it pools the block per channel (the softmax of the scores over the slots weighting the values: the
current block's ``m`` slots, and with overlap the previous block's first-half channels too), then in registers
rounds as the torch ops round: the entry cast to the output dtype, the weighted RMS norm (``x * rsqrt(mean(x^2)
+ eps)`` rounded to fp32, times the weight, cast), RoPE on its last ``2 * half`` channels at the block's first
position (each product rounded on its own, as ``kernels/triton/rope.py``), the Hadamard transform for a rotating
compressor (each butterfly stage rounded to the output dtype, as ``kernels/triton/hadamard.py``), and writes it
to the block's entry; with overlap it keeps the block's first-half slots as the next block's previous ones.
The pooling's sums run in another order than torch's softmax and sum (and the norm's as the norm kernel's):
within fp32 rounding of the pooled entry, so within a rounding step of the output dtype.

The angles come from a table of the blocks' angles (``kernels.reference.decode.angle_table``, the values torch
computes), indexed by the block. No gradient (a decode step).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import gpu_common
from kernels.triton import pdl
from kernels.triton.rope import _rotate_pairs

__all__ = ["compressor_step", "compressor_step_launch", "MAX_CHANNELS", "MAX_RATIO"]

MAX_CHANNELS = 1024       # an entry's channels live in one program's registers
MAX_RATIO = 1024          # slots a block pools (a loop; V4's ratios are 4 and 128)


@triton.jit
def _hadamard_row(y, C: tl.constexpr, LOG_C: tl.constexpr, ROUND: tl.constexpr, dtype: tl.constexpr):
    """``kernels/triton/hadamard.py``'s stages on one row ``y [C]`` (fp32 values of ``dtype``), unscaled."""
    for s in tl.static_range(LOG_C):                # stage s pairs entries 2^s apart
        a, b = tl.split(tl.permute(tl.reshape(y, (C >> (s + 1), 2, 1 << s)), (0, 2, 1)))
        total, diff = a + b, a - b
        if ROUND:
            total = total.to(dtype).to(tl.float32)
            diff = diff.to(dtype).to(tl.float32)
        y = tl.reshape(tl.permute(tl.join(total, diff), (0, 2, 1)), (C,))
    return y


@triton.jit(do_not_specialize=["N", "first", "stride_ob"])
def _compress_kernel(KV, GATE, APE, A, Z, PA, PZ, POS, OUT, NORM_W, ANG, eps, hadamard_scale, N, first, stride_ob,
                     NB, M: tl.constexpr, C: tl.constexpr, HALF: tl.constexpr, OVERLAP: tl.constexpr,
                     ROTATE: tl.constexpr, LOG_C: tl.constexpr, ROUND: tl.constexpr, ROUNDED: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    b = tl.program_id(0).to(tl.int64)
    KC: tl.constexpr = 2 * C if OVERLAP else C          # the slots' channels (kappa * c)
    cols = tl.arange(0, C)
    pos = tl.load(POS + b)
    slot = pos % M
    row = b * M * KC                                     # row b of a, z [B, m, KC]
    # the token's slot: a = W_kv x, z = W_gate x + ape[slot] (the second half's channels too, with overlap)
    kv_hi = tl.load(KV + b * KC + (KC - C) + cols)
    z_hi = tl.load(GATE + b * KC + (KC - C) + cols) + tl.load(APE + slot * KC + (KC - C) + cols)
    tl.store(A + row + slot * KC + (KC - C) + cols, kv_hi)
    tl.store(Z + row + slot * KC + (KC - C) + cols, z_hi)
    if OVERLAP:
        kv_lo = tl.load(KV + b * KC + cols)
        z_lo = tl.load(GATE + b * KC + cols) + tl.load(APE + slot * KC + cols)
        tl.store(A + row + slot * KC + cols, kv_lo)
        tl.store(Z + row + slot * KC + cols, z_lo)
    if ((pos + 1) % M == 0) & (N > 0):                   # the token completes block pos // m: pool it
        # the block's slots: m - 1 in memory and the token's in registers (slot m - 1), each channel's
        # second-half values with overlap, after the previous block's m first-half slots (prev_a, prev_z)
        top = z_hi
        for s in range(M - 1):
            top = tl.maximum(top, tl.load(Z + row + s * KC + (KC - C) + cols))
        if OVERLAP:
            for s in range(M):
                top = tl.maximum(top, tl.load(PZ + b * M * C + s * C + cols))
        e = tl.exp(z_hi - top)
        den = e
        num = e * kv_hi
        for s in range(M - 1):
            e = tl.exp(tl.load(Z + row + s * KC + (KC - C) + cols) - top)
            den += e
            num += e * tl.load(A + row + s * KC + (KC - C) + cols)
        if OVERLAP:
            for s in range(M):
                e = tl.exp(tl.load(PZ + b * M * C + s * C + cols) - top)
                den += e
                num += e * tl.load(PA + b * M * C + s * C + cols)
        x = (num / den).to(OUT.dtype.element_ty).to(tl.float32)
        # the weighted RMS norm (kernels.reference.layers.rms_norm's rounding order)
        x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / C + eps)
        x = (x * tl.load(NORM_W + cols).to(tl.float32)).to(OUT.dtype.element_ty).to(tl.float32)
        # RoPE on the last 2 * HALF channels, interleaved pairs, at the block's first position
        block = pos // M
        ev, od = tl.split(tl.reshape(x, (C // 2, 2)))
        pair = tl.arange(0, C // 2) - (C // 2 - HALF)
        rope = pair >= 0
        cs = tl.load(ANG + block * HALF + pair, mask=rope, other=1.0)
        sn = tl.load(ANG + (NB + block) * HALF + pair, mask=rope, other=0.0)
        x = tl.reshape(tl.join(*_rotate_pairs(ev, od, cs, sn, rope, ROUNDED)), (C,))
        x = x.to(OUT.dtype.element_ty).to(tl.float32)
        if ROTATE:
            x = _hadamard_row(x, C, LOG_C, ROUND, OUT.dtype.element_ty) * hadamard_scale
        at = first + tl.minimum(block, N - 1)            # a slot past the capacity (never fed) writes the last
        tl.store(OUT + b * stride_ob + at * C + cols, x.to(OUT.dtype.element_ty))
        if OVERLAP:                                      # the block's first halves: the next block's previous
            tl.debug_barrier()                           # (read above by other threads of this program)
            for s in range(M - 1):
                tl.store(PA + b * M * C + s * C + cols, tl.load(A + row + s * KC + cols))
                tl.store(PZ + b * M * C + s * C + cols, tl.load(Z + row + s * KC + cols))
            tl.store(PA + b * M * C + (M - 1) * C + cols, kv_lo)
            tl.store(PZ + b * M * C + (M - 1) * C + cols, z_lo)


def compressor_step_launch(kv, gate, ape, a, z, prev_a, prev_z, pos, out, first: int, norm_weight, eps: float,
                           angles, rotate: bool) -> None:
    """The kernel on checked inputs (:func:`compressor_step`)."""
    B, M, KC = a.shape
    C = out.shape[-1]
    overlap = prev_a is not None
    if B == 0:
        return
    _compress_kernel[(B,)](kv, gate, ape, a, z, prev_a if overlap else a, prev_z if overlap else z, pos, out,
                           norm_weight, angles, float(eps), float(C ** -0.5), out.shape[1] - first, first,
                           out.stride(0), angles.shape[1], M=M, C=C, HALF=angles.shape[2], OVERLAP=overlap,
                           ROTATE=bool(rotate), LOG_C=C.bit_length() - 1, ROUND=out.dtype != torch.float32,
                           ROUNDED=not gpu_common.interpreting(), num_warps=4, **pdl.launch(kv.device))


def compressor_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, a: torch.Tensor, z: torch.Tensor,
                    prev_a: Optional[torch.Tensor], prev_z: Optional[torch.Tensor], pos: torch.Tensor,
                    out: torch.Tensor, first: int, norm_weight: torch.Tensor, eps: float, angles: torch.Tensor,
                    rotate: bool) -> None:
    """A compressor's decode step after its GEMMs, in place (module docstring): ``kv, gate [B, kappa*c]`` fp32
    (``W_kv x``, ``W_gate x``), ``ape [m, kappa*c]`` fp32, the slots ``a, z [B, m, kappa*c]`` fp32 and, with
    overlap (``kappa = 2``), ``prev_a, prev_z [B, m, c]`` fp32 (else None), positions ``pos [B]`` int64, the
    entries ``out [B', first + N, c]`` (bf16/fp16/fp32; the block's entry goes to row ``first + pos // m``),
    the norm's weight ``[c]``, the blocks' angle table ``angles [2, blocks, r/2]`` fp32
    (``kernels.reference.decode.angle_table`` with stride ``m``), and whether to rotate (Hadamard). Anything
    else is refused with the reason."""
    op = "compressor_step"
    for name, t in (("kv", kv), ("gate", gate), ("ape", ape), ("a", a), ("z", z), ("angles", angles)):
        gpu_common.check_op_input(op, t, name, dtypes=(torch.float32,))
    gpu_common.check_op_input(op, out, "out")
    gpu_common.check_op_input(op, norm_weight, "norm_weight")
    if a.dim() != 3 or z.shape != a.shape or not (a.is_contiguous() and z.is_contiguous()):
        raise gpu_common.op_refusal(op, f"slots a {tuple(a.shape)} / z {tuple(z.shape)} (needs two contiguous "
                                        f"[B, m, kappa*c] tensors)")
    B, M, KC = a.shape
    C = out.shape[-1] if out.dim() == 3 else 0
    overlap = prev_a is not None
    if (out.dim() != 3 or out.stride(2) != 1 or out.stride(1) != C or out.shape[0] < B or C < 2 or C & (C - 1)
            or C > MAX_CHANNELS or KC != (2 if overlap else 1) * C or not 1 <= M <= MAX_RATIO):
        raise gpu_common.op_refusal(op, f"entries {tuple(out.shape)} for slots {tuple(a.shape)} (needs [B, N, c] "
                                        f"rows of c contiguous channels, c a power of two up to {MAX_CHANNELS}, "
                                        f"the slots c channels, or 2c with overlap, m up to {MAX_RATIO})")
    if overlap and (prev_z is None or prev_a.shape != (B, M, C) or prev_z.shape != (B, M, C)
                    or not (prev_a.is_contiguous() and prev_z.is_contiguous())
                    or prev_a.dtype != torch.float32 or prev_z.dtype != torch.float32):
        raise gpu_common.op_refusal(op, f"previous slots {tuple(prev_a.shape)} (needs two contiguous fp32 "
                                        f"[B, m, c] tensors with overlap)")
    if (kv.shape != (B, KC) or gate.shape != (B, KC) or ape.shape != (M, KC) or pos.shape != (B,)
            or pos.dtype != torch.int64 or norm_weight.shape != (C,) or angles.dim() != 3 or angles.shape[0] != 2
            or not 1 <= angles.shape[2] <= C // 2):
        raise gpu_common.op_refusal(op, f"kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, ape {tuple(ape.shape)}, "
                                        f"pos {tuple(pos.shape)} {pos.dtype}, norm {tuple(norm_weight.shape)}, angles "
                                        f"{tuple(angles.shape)} do not fit slots {tuple(a.shape)} and {C} channels")
    compressor_step_launch(kv.contiguous(), gate.contiguous(), ape.contiguous(), a, z, prev_a, prev_z,
                           pos.contiguous(), out, int(first), norm_weight.contiguous(), eps, angles.contiguous(),
                           rotate)
