"""Fake quantization (quantize-dequantize) with straight-through gradients.

Forward: the value a quantized kernel would see; backward: the identity
(straight-through estimator). All ops work on any device, in fp32, and
return the input dtype. Blocks run along the **last** dimension.

* :func:`fake_quant_nvfp4` - routed-expert weights, NVFP4 (1x16 e4m3 block
  scales + fp32 global scale, :mod:`converters.nvfp4`); gate/up pairs share
  the global amax via :func:`fake_quant_nvfp4_pair`.
* :func:`fake_quant_mxfp4` - routed-expert weights, MXFP4 FP4 sim
  (architecture.md §2.8): per 32, ``s = 2^ceil(log2(max(amax, 6*2^-126) / 6))``,
  ``x/s`` rounded to the nearest e2m1 value (ties to the even code), ``* s``.
* :func:`fake_quant_fp8_act` / :func:`fake_quant_kv_nope` - ``act_quant`` FP8
  simulation of the KV nope dims (§2.2, §2.8): per 64, ``s = 2^ceil(log2(max(amax,
  1e-4) / 448))``, ``clamp(x/s, ±448)`` cast to e4m3, ``* s``; the trailing
  ``rope_dim`` dims are left untouched.
"""

from __future__ import annotations

from typing import Optional

import torch

from core.checkpoint.formats import (
    FP4_MAX, FP8_DTYPE, FP8_MAX, fp4_decode, fp4_encode, pow2_ceil_exponent,
)

from .nvfp4 import NVFP4_BLOCK, global_amax, global_scale_from_amax, nvfp4_codes

MXFP4_BLOCK = 32
KV_FP8_BLOCK = 64
ACT_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = FP4_MAX * 2.0 ** -126


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)


# ---------------------------------------------------------------------------
# pure quantize-dequantize functions (no autograd)
# ---------------------------------------------------------------------------

def nvfp4_qdq(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    g = global_scale_from_amax(global_amax(x) if amax is None else amax)
    codes, b = nvfp4_codes(x, g)
    eff = b.float() * g.reshape(())
    return (_blocked(fp4_decode(codes), NVFP4_BLOCK) * eff[..., None]).reshape(x.shape).to(x.dtype)


def mxfp4_qdq(x: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    xb = _blocked(x, block)
    amax = xb.abs().amax(dim=-1).clamp_min(FP4_AMAX_FLOOR)
    s = _pow2(pow2_ceil_exponent(amax / FP4_MAX))
    q = fp4_decode(fp4_encode(xb / s[..., None]))
    return (q * s[..., None]).reshape(x.shape).to(x.dtype)


def fp8_act_qdq(x: torch.Tensor, block: int = KV_FP8_BLOCK) -> torch.Tensor:
    xb = _blocked(x, block)
    amax = xb.abs().amax(dim=-1).clamp_min(ACT_AMAX_FLOOR)
    s = _pow2(pow2_ceil_exponent(amax / FP8_MAX))
    q = (xb / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return (q * s[..., None]).reshape(x.shape).to(x.dtype)


# ---------------------------------------------------------------------------
# straight-through autograd wrappers
# ---------------------------------------------------------------------------

class _NVFP4STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, amax):
        return nvfp4_qdq(x, amax)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _MXFP4STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        return mxfp4_qdq(x, block)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _FP8ActSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        return fp8_act_qdq(x, block)

    @staticmethod
    def backward(ctx, g):
        return g, None


def fake_quant_nvfp4(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NVFP4 quantize-dequantize of ``x`` (global amax: its own, or ``amax``), STE backward."""
    return _NVFP4STE.apply(x, None if amax is None else amax.detach())


def fake_quant_nvfp4_pair(gate: torch.Tensor, up: torch.Tensor):
    """Gate and up of one expert with one shared global amax, STE backward."""
    if gate is None or up is None:
        raise ValueError("fake_quant_nvfp4_pair needs both the gate (w1) and the up (w3) weight")
    amax = global_amax(gate, up)
    return fake_quant_nvfp4(gate, amax), fake_quant_nvfp4(up, amax)


def fake_quant_mxfp4(x: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """MXFP4 (1x32 ue8m0) quantize-dequantize, STE backward."""
    return _MXFP4STE.apply(x, block)


def fake_quant_fp8_act(x: torch.Tensor, block: int = KV_FP8_BLOCK) -> torch.Tensor:
    """``act_quant`` FP8 e4m3 simulation in 1 x ``block`` blocks, STE backward."""
    return _FP8ActSTE.apply(x, block)


def fake_quant_kv_nope(kv: torch.Tensor, rope_dim: int = 64, block: int = KV_FP8_BLOCK) -> torch.Tensor:
    """FP8-simulate the leading nope dims ``kv[..., :-rope_dim]``; rope dims pass through."""
    if rope_dim <= 0:
        return fake_quant_fp8_act(kv, block)
    nope, rope = kv[..., :-rope_dim], kv[..., -rope_dim:]
    return torch.cat([fake_quant_fp8_act(nope, block), rope], dim=-1)
