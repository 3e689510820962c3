"""Fused Triton kernels of the quantization converters (CUDA tensors only).

Imported lazily by :mod:`converters._accel`; the torch code of each converter
is the reference and every kernel here reproduces its result bit for bit on
the same CUDA device (finite inputs; NaN outputs are NaN too, payloads aside):

* :func:`fp8_block_dequantize` - e4m3/e5m2 ``q`` times its 128x128 block scale
  (fp32 / bf16 / fp16 / fp64 or e8m0 bytes), one fp32 multiply, cast to the output dtype.
* :func:`fp8_block_quantize` - one program per 128x128 tile: the tile is read
  once into registers, its amax, scale and e4m3 codes come out of the same pass.
* :func:`mxfp4_to_fp8` - one program per 128x128 tile: the tile exponent from its
  512 block scales, each e2m1 value rebuilt as ``v * 2^off`` in fp32 bits and cast
  to e4m3, plus the per-tile exactness / NaN flags.
* :func:`absmax` and :func:`nvfp4_quantize` - NVFP4 (1x16 e4m3 scales, fp32 global scale).

Details that make the results identical to torch on CUDA:

* ``tensor / python_float`` is computed by torch on CUDA as ``tensor * fl32(1 / b)``
  (the reciprocal is an fp32 division on the host), so the kernels multiply by
  the same fp32 reciprocal; tensor / tensor divisions are IEEE (``div_rn``).
* Dividing by a power of two equals multiplying by its exact inverse.
* Powers of two are built from their bits (2^-127 is the subnormal 0x00400000).
* fp32 -> e4m3 / bf16 / fp16 conversions round to nearest even, as torch's.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

FP8_BLOCK = 128
NVFP4_BLOCK = 16
# torch on CUDA: x / 448.0 == x * (1.0f / 448.0f); same for 6.0
INV_448 = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32))
INV_6 = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0, dtype=torch.float32))
FP8_AMAX_FLOOR = 1e-4
BIG = 1 << 22            # elements: from here on the autotuned launch is used

_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
_FP8_IN = (torch.float8_e4m3fn, torch.float8_e5m2)
_DEQ_OUT = (torch.bfloat16, torch.float32)     # fp16 outputs stay on the torch path (an fp16 run differed)
_SCALE_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Unit stride along the last dim (any row stride); copies otherwise."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


_SM_COUNT = {}


def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":            # the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors
        return 4
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


# ---------------------------------------------------------------------------
# FP8 128x128 block dequantization
# ---------------------------------------------------------------------------

@triton.jit
def _fp8_dequant_kernel(q_ptr, s_ptr, o_ptr, M, N, stride_qm, stride_om, stride_sm, stride_sn,
                        E8M0: tl.constexpr, OUT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    n_cb = tl.cdiv(N, BN)
    pm = pid // n_cb
    pn = pid % n_cb
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)
    q = tl.load(q_ptr + r64[:, None] * stride_qm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # BM divides 128: one scale row per program, one scale per 128 columns
    srow = (pm * BM) // 128
    s = tl.load(s_ptr + srow * stride_sm + (cols // 128) * stride_sn, mask=cmask, other=0)
    if E8M0:
        b = s.to(tl.int32)
        bits = tl.where(b == 0, 0x00400000, b << 23)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        sf = bits.to(tl.float32, bitcast=True)
    else:
        sf = s.to(tl.float32)
    out = q * sf[None, :]
    if OUT_F32:
        res = out
    else:
        res = out.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(o_ptr + r64[:, None] * stride_om + cols[None, :], res, mask=mask)


_fp8_dequant_tuned = triton.autotune(
    configs=[triton.Config({"BM": 32, "BN": 256}, num_warps=4),
             triton.Config({"BM": 64, "BN": 256}, num_warps=8),
             triton.Config({"BM": 16, "BN": 512}, num_warps=4),
             triton.Config({"BM": 32, "BN": 512}, num_warps=8)],
    key=["N", "E8M0", "OUT_F32"],
)(_fp8_dequant_kernel)


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> Optional[torch.Tensor]:
    """``q [M, N]`` fp8 times its 128x128 block ``scale`` -> ``dtype``; ``None`` when not handled
    here (the caller then runs the torch path, which also raises the shape errors)."""
    if q.dim() != 2 or q.dtype not in _FP8_IN or dtype not in _DEQ_OUT:
        return None
    M, N = q.shape
    if tuple(scale.shape) != (_cdiv(M, 128), _cdiv(N, 128)) or M == 0 or N == 0:
        return None
    if scale.dtype == torch.float8_e8m0fnu:
        s, e8 = scale.view(torch.uint8), True
    elif scale.dtype in _SCALE_FLOAT:
        s, e8 = scale, False
    else:
        return None
    if s.device != q.device:
        s = s.to(q.device)
    q = _row_major(q)
    out = torch.empty((M, N), dtype=dtype, device=q.device)
    f32 = dtype == torch.float32
    args = (q, s, out, M, N, q.stride(0), out.stride(0), s.stride(0), s.stride(1))
    if M * N >= BIG:
        _fp8_dequant_tuned[lambda m: (_cdiv(M, m["BM"]) * _cdiv(N, m["BN"]),)](*args, E8M0=e8, OUT_F32=f32)
    else:
        _fp8_dequant_kernel[(_cdiv(M, 32) * _cdiv(N, 128),)](*args, E8M0=e8, OUT_F32=f32, BM=32, BN=128, num_warps=4)
    return out


# ---------------------------------------------------------------------------
# FP8 128x128 block quantization (one program per tile)
# ---------------------------------------------------------------------------

@triton.jit
def _fp8_quant_kernel(x_ptr, q_ptr, s_ptr, M, N, stride_xm, stride_qm, n_ct, inv448, amax_floor,
                      UE8M0: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    tm = pid // n_ct
    tn = pid % n_ct
    rows = (tm * 128 + tl.arange(0, 128)).to(tl.int64)
    cols = tn * 128 + tl.arange(0, 128)
    if EVEN:
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :]).to(tl.float32)
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    amax = tl.maximum(amax, amax_floor)
    sc = amax * inv448                                   # torch (CUDA): amax / 448.0
    if UE8M0:
        bits = sc.to(tl.int32, bitcast=True)             # sc >= 2.2e-7: a normal float
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2(sc))
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)                     # 2^-e, exact
        y = x * inv
        tl.store(s_ptr + pid, (e + 127).to(tl.uint8))
    else:
        y = tl.math.div_rn(x, sc)
        tl.store(s_ptr + pid, sc)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    qb = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if EVEN:
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], qb)
    else:
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], qb, mask=mask)


def fp8_block_quantize(w: torch.Tensor, scale_fmt: str = "ue8m0") -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """2-D bf16/fp16/fp32 ``w`` -> ``(e4m3 [M, N], scale [ceil(M/128), ceil(N/128)])`` as
    :func:`core.checkpoint.formats.fp8_block_quantize`; ``None`` when not handled here."""
    if w.dim() != 2 or w.dtype not in _FLOAT_IN or scale_fmt not in ("ue8m0", "fp32"):
        return None
    M, N = w.shape
    if M == 0 or N == 0:
        return None
    w = _row_major(w)
    rb, cb = _cdiv(M, 128), _cdiv(N, 128)
    q = torch.empty((M, N), dtype=torch.uint8, device=w.device)
    ue = scale_fmt == "ue8m0"
    s = torch.empty((rb, cb), dtype=torch.uint8 if ue else torch.float32, device=w.device)
    even = M % 128 == 0 and N % 128 == 0
    nw = 8 if M * N >= BIG else 4
    _fp8_quant_kernel[(rb * cb,)](w, q, s, M, N, w.stride(0), q.stride(0), cb, INV_448, FP8_AMAX_FLOOR,
                                  UE8M0=ue, EVEN=even, num_warps=nw)
    return q.view(torch.float8_e4m3fn), (s.view(torch.float8_e8m0fnu) if ue else s)


# ---------------------------------------------------------------------------
# MXFP4 (e2m1 + 1x32 ue8m0) -> FP8 e4m3 + 128x128 tile scales
# ---------------------------------------------------------------------------

@triton.jit
def _e2m1_times_pow2_to_e4m3(c, off, is_nan):
    """e2m1 code ``c`` (0..15) times ``2^off`` -> e4m3 byte, and whether that loses bits."""
    m = c & 7
    ex = m >> 1
    mt = m & 1
    offc = tl.minimum(tl.maximum(off, -30), 6)    # below 2^-30 everything is +-0 in e4m3 anyway
    expf = tl.where(ex == 0, offc + 126, ex + offc + 126)
    mant = tl.where(ex == 0, 0, mt << 22)
    bits = tl.where(m == 0, 0, (expf << 23) | mant) | ((c >> 3) << 31)
    q = bits.to(tl.float32, bitcast=True).to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    q = tl.where(is_nan, 0x7F, q)
    # lowest set bit exponent of the value; zeros get the torch path's sentinel 127 (so, as there,
    # a zero is only flagged when its block is more than 2^136 below the tile's largest block)
    lsb = tl.where(m == 0, 127, tl.where(ex == 0, -1, ex - 1 - mt))
    lost = tl.where(is_nan, 0, ((lsb + off) < -9).to(tl.int32))
    return q, lost


@triton.jit
def _mxfp4_to_fp8_kernel(p_ptr, s_ptr, w_ptr, ts_ptr, flags_ptr, any_ptr, stride_pm, stride_sm, stride_wm,
                         n_ct, FP32_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    tm = pid // n_ct
    tn = pid % n_ct
    rows = (tm * 128 + tl.arange(0, 128)).to(tl.int64)
    sb = tl.load(s_ptr + rows[:, None] * stride_sm + tn * 4 + tl.arange(0, 4)[None, :]).to(tl.int32)
    is_nan = sb == 255
    e = sb - 127
    tmax = tl.max(tl.max(tl.where(is_nan, -1000, e), axis=1), axis=0)
    tile_exp = tl.maximum(tmax - 6, -127)
    off = e - tile_exp
    off_b = tl.reshape(tl.broadcast_to(off[:, :, None], (128, 4, 16)), (128, 64))
    nan_b = tl.reshape(tl.broadcast_to(is_nan[:, :, None], (128, 4, 16)), (128, 64))
    byte = tl.load(p_ptr + rows[:, None] * stride_pm + tn * 64 + tl.arange(0, 64)[None, :]).to(tl.int32)
    q_lo, lost_lo = _e2m1_times_pow2_to_e4m3(byte & 0xF, off_b, nan_b)
    q_hi, lost_hi = _e2m1_times_pow2_to_e4m3((byte >> 4) & 0xF, off_b, nan_b)
    out = tl.reshape(tl.join(q_lo, q_hi), (128, 128)).to(tl.uint8)
    tl.store(w_ptr + rows[:, None] * stride_wm + tn * 128 + tl.arange(0, 128)[None, :], out)
    if FP32_SCALE:
        sbits = tl.where(tile_exp == -127, 0x00400000, (tile_exp + 127) << 23)
        tl.store(ts_ptr + pid, sbits.to(tl.float32, bitcast=True))
    else:
        tl.store(ts_ptr + pid, (tile_exp + 127).to(tl.uint8))
    lost = tl.max(tl.max(lost_lo | lost_hi, axis=1), axis=0)
    nan = tl.max(tl.max(is_nan.to(tl.int32), axis=1), axis=0)
    flag = lost | (nan << 1)
    tl.store(flags_ptr + pid, flag.to(tl.int8))
    if flag != 0:
        tl.atomic_or(any_ptr, flag)


def mxfp4_to_fp8(packed: torch.Tensor, scale: torch.Tensor, scale_format: str = "ue8m0"):
    """Packed e2m1 ``[M, N/2]`` + ue8m0 bytes ``[M, N/32]`` (M, N multiples of 128, checked by
    the caller) -> ``(e4m3 [M, N], tile scale [M/128, N/128], flags int8 [M/128, N/128],
    any int32 [1])``; flag bit 0: a value loses bits, bit 1: a NaN block scale."""
    M, N = packed.shape[0], packed.shape[1] * 2
    rb, cb = M // 128, N // 128
    p = _row_major(packed.view(torch.uint8))
    s = _row_major(scale.view(torch.uint8))
    dev = packed.device
    w = torch.empty((M, N), dtype=torch.uint8, device=dev)
    fp32 = scale_format == "fp32"
    ts = torch.empty((rb, cb), dtype=torch.float32 if fp32 else torch.uint8, device=dev)
    flags = torch.empty((rb, cb), dtype=torch.int8, device=dev)
    anyf = torch.zeros(1, dtype=torch.int32, device=dev)
    if rb * cb:
        _mxfp4_to_fp8_kernel[(rb * cb,)](p, s, w, ts, flags, anyf, p.stride(0), s.stride(0), w.stride(0), cb,
                                         FP32_SCALE=fp32, num_warps=4)
    return (w.view(torch.float8_e4m3fn), ts if fp32 else ts.view(torch.float8_e8m0fnu), flags, anyf)


# ---------------------------------------------------------------------------
# NVFP4: global absmax, then 1x16 e4m3 block scales + packed e2m1 codes
# ---------------------------------------------------------------------------

@triton.jit
def _absmax_kernel(x_ptr, out_ptr, M, N, stride_xm, n_cb, n_tiles, nprog, iters,
                   BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, iters):
        t = pid + i * nprog
        rows = ((t // n_cb) * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (t % n_cb) * BN + tl.arange(0, BN)
        mask = ((rows < M)[:, None] & (cols < N)[None, :]) & (t < n_tiles)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.atomic_max(out_ptr, tl.max(tl.max(acc, axis=1), axis=0))


def absmax(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x.abs().amax().float()`` (0-d) in one read; ``None`` when not handled here."""
    if x.dtype not in _FLOAT_IN or x.numel() == 0 or not x.is_contiguous():
        return None
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
    M, N = x2.shape
    out = torch.zeros(1, dtype=torch.float32, device=x.device)
    BM, BN = 16, 512
    n_tiles = _cdiv(M, BM) * _cdiv(N, BN)
    grid = (max(1, min(n_tiles, 4 * _sm_count(x.device))),)
    _absmax_kernel[grid](x2, out, M, N, x2.stride(0), _cdiv(N, BN), n_tiles, grid[0], _cdiv(n_tiles, grid[0]),
                         BM=BM, BN=BN, num_warps=8)
    return out.reshape(())


@triton.jit
def _nvfp4_kernel(x_ptr, p_ptr, b_ptr, g_ptr, M, N, stride_xm, stride_pm, stride_bm, inv6,
                  BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    n_cb = tl.cdiv(N, BN)
    pm = pid // n_cb
    pn = pid % n_cb
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < M
    cols = pn * BN + tl.arange(0, BN)
    mask = rmask[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gs = tl.load(g_ptr)
    xb = tl.reshape(x, (BM, BN // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=2)
    t = tl.math.div_rn(bamax * inv6, gs)             # torch (CUDA): (bamax / 6.0) / gs
    t = tl.minimum(t, 448.0)
    b8 = t.to(tl.float8e4nv)
    eff = b8.to(tl.float32) * gs
    zero = eff == 0
    safe = tl.where(zero, 1.0, eff)
    q = tl.math.div_rn(xb, safe[:, :, None])
    q = tl.where(zero[:, :, None], 0.0, q)
    mag = tl.minimum(tl.abs(q), 6.0)
    small = mag < 2.0
    mid = mag < 4.0
    step = tl.where(small, 0.5, tl.where(mid, 1.0, 2.0))
    rstep = tl.where(small, 2.0, tl.where(mid, 1.0, 0.5))
    r = (mag * rstep + 8388608.0) - 8388608.0         # round half to even (mag * rstep is exact, < 2^22)
    qv = r * step
    code = tl.where(qv < 2.0, qv * 2.0, tl.where(qv < 4.0, qv + 2.0, qv * 0.5 + 4.0)).to(tl.int32)
    code = code | (((q < 0) & (code != 0)).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, (BM, BN // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    c2 = pn * (BN // 2) + tl.arange(0, BN // 2)
    tl.store(p_ptr + rows[:, None] * stride_pm + c2[None, :], packed,
             mask=rmask[:, None] & (c2 < N // 2)[None, :])
    c16 = pn * (BN // 16) + tl.arange(0, BN // 16)
    tl.store(b_ptr + rows[:, None] * stride_bm + c16[None, :], b8.to(tl.uint8, bitcast=True),
             mask=rmask[:, None] & (c16 < N // 16)[None, :])


def nvfp4_quantize(w: torch.Tensor, g: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """2-D ``w [M, N]`` (N % 16 == 0) with global scale ``g`` (fp32 [1], on ``w``'s device)
    -> ``(packed uint8 [M, N/2], block scale e4m3 [M, N/16])``; ``None`` when not handled here."""
    if (w.dim() != 2 or w.dtype not in _FLOAT_IN or w.shape[1] % NVFP4_BLOCK or w.numel() == 0
            or g.device != w.device or g.dtype != torch.float32 or g.numel() != 1):
        return None
    M, N = w.shape
    w = _row_major(w)
    packed = torch.empty((M, N // 2), dtype=torch.uint8, device=w.device)
    b = torch.empty((M, N // NVFP4_BLOCK), dtype=torch.uint8, device=w.device)
    BM, BN = (32, 256) if M * N >= BIG else (16, 128)
    grid = (_cdiv(M, BM) * _cdiv(N, BN),)
    _nvfp4_kernel[grid](w, packed, b, g.contiguous(), M, N, w.stride(0), packed.stride(0), b.stride(0), INV_6,
                        BM=BM, BN=BN, num_warps=8 if M * N >= BIG else 4)
    return packed, b.view(torch.float8_e4m3fn)
