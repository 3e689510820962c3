"""NVFP4 for routed experts: e2m1 values, 1x16 e4m3 block scales, one fp32 global scale.

Only routed experts are NVFP4 (:func:`converters.quant_allowlist.is_routed_expert_weight`,
which rejects shared experts before looking for ``.experts.``); shared experts
and everything else stay high precision.

Encoding of a 2-D weight ``W [out, in]`` (``in % 16 == 0``), all in fp32:

* ``amax_g`` = max |W| over the tensor (for an expert's gate ``w1`` and up
  ``w3``: over **both**, so they share one global scale; ``w2`` alone).
* global scale (stored as ``.weight_scale_2``, fp32 ``[1]``):
  ``g = max(amax_g, 1e-12) / (6 * 448)``.
* per block of 16 along ``in``: ``b = e4m3(min((amax_blk / 6) / g, 448))``
  (round to nearest even), stored as ``.weight_scale`` float8_e4m3fn ``[out, in/16]``.
* effective scale ``e = f32(b) * g``; codes = nearest e2m1 of ``W / e``
  (ties to the even code, saturating at 6; ``e == 0`` gives code 0).
* packed two codes per byte, low nibble = even column: ``.weight`` uint8 ``[out, in/2]``.
* decode: ``W' = FP4[code] * f32(b) * g``.

No host synchronization anywhere (tensor ops only).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from core.checkpoint.formats import FP4_MAX, FP8_DTYPE, FP8_MAX, fp4_decode, fp4_encode, fp4_pack, fp4_unpack

from ._accel import triton_kernels_for
from .quant_allowlist import gate_up_partner, is_routed_expert_weight

NVFP4_BLOCK = 16
AMAX_FLOOR = 1e-12


class NVFP4Tensor(NamedTuple):
    packed: torch.Tensor        # uint8 [out, in/2]
    block_scale: torch.Tensor   # float8_e4m3fn [out, in/16]
    global_scale: torch.Tensor  # fp32 [1]


def _check(w: torch.Tensor, name: str = "tensor") -> None:
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"{name}: NVFP4 needs a 2-D weight with in_features % {NVFP4_BLOCK} == 0, "
                         f"got {list(w.shape)}")


def global_amax(*tensors: torch.Tensor) -> torch.Tensor:
    """max |x| over all given tensors, fp32 0-d (on their device, no sync)."""
    out = _amax(tensors[0])
    for t in tensors[1:]:
        out = torch.maximum(out, _amax(t))
    return out


def _amax(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    tk = triton_kernels_for(t)
    if tk is not None:                 # one read, no |x| temporary (max is exact: same value)
        out = tk.absmax(t)
        if out is not None:
            return out
    return t.abs().amax().float()


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float().clamp_min(AMAX_FLOOR) / (FP4_MAX * FP8_MAX)).reshape(1)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def nvfp4_codes(x: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [..., n]`` (n % 16 == 0), global scale ``g`` -> (codes uint8 [..., n], block scales e4m3 [..., n/16])."""
    xb = _blocks(x)
    gs = g.float().reshape(())
    bamax = xb.abs().amax(dim=-1)
    b = ((bamax / FP4_MAX) / gs).clamp_max(FP8_MAX).to(FP8_DTYPE)
    eff = b.float() * gs
    safe = torch.where(eff == 0, torch.ones_like(eff), eff)
    q = torch.where(eff[..., None] == 0, torch.zeros_like(xb), xb / safe[..., None])
    codes = fp4_encode(q).reshape(x.shape)
    return codes, b


def nvfp4_quantize(w: torch.Tensor, amax: Optional[torch.Tensor] = None, *, name: str = "tensor") -> NVFP4Tensor:
    """Quantize one 2-D weight; ``amax`` (0-d) overrides its own global amax."""
    _check(w, name)
    g = global_scale_from_amax(global_amax(w) if amax is None else amax)
    tk = triton_kernels_for(w, g)
    if tk is not None:                 # fused kernel, bit-identical to nvfp4_codes + fp4_pack
        out = tk.nvfp4_quantize(w.detach(), g)
        if out is not None:
            return NVFP4Tensor(out[0], out[1], g)
    codes, b = nvfp4_codes(w.detach(), g)
    return NVFP4Tensor(fp4_pack(codes).view(torch.uint8), b, g)


def nvfp4_dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype=torch.float32) -> torch.Tensor:
    codes = fp4_unpack(packed)
    vals = _blocks(fp4_decode(codes))
    eff = block_scale.float() * global_scale.float().reshape(())
    return (vals * eff[..., None]).reshape(codes.shape).to(dtype)


def nvfp4_quantize_pair(gate: torch.Tensor, up: torch.Tensor, *, names=("gate", "up")
                        ) -> Tuple[NVFP4Tensor, NVFP4Tensor]:
    """Gate (w1) and up (w3) of one expert with ONE shared global amax."""
    if gate is None or up is None:
        raise ValueError("nvfp4_quantize_pair needs both the gate (w1) and the up (w3) projection: they share "
                         "one global amax")
    _check(gate, names[0])
    _check(up, names[1])
    amax = global_amax(gate, up)
    return nvfp4_quantize(gate, amax, name=names[0]), nvfp4_quantize(up, amax, name=names[1])


def nvfp4_names(weight_name: str) -> Tuple[str, str, str]:
    """``x.weight`` -> (``x.weight``, ``x.weight_scale``, ``x.weight_scale_2``)."""
    return weight_name, weight_name + "_scale", weight_name + "_scale_2"


def _emit(name: str, t: NVFP4Tensor) -> List[Tuple[str, torch.Tensor]]:
    n_w, n_s, n_g = nvfp4_names(name)
    return [(n_w, t.packed), (n_s, t.block_scale), (n_g, t.global_scale)]


def quantize_experts_nvfp4(named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
    """Publish a bucket with routed experts in NVFP4; everything else unchanged.

    Gate/up pairs must be in the same bucket: a lone ``experts.E.w1`` or
    ``experts.E.w3`` raises ``ValueError`` naming the missing partner.
    Output order follows the input (a pair is emitted at its first member).
    """
    items = list(named_tensors)
    by_name: Dict[str, torch.Tensor] = dict(items)
    for n, _ in items:
        p = gate_up_partner(n)
        if p is not None and p[0] not in by_name:
            partner, role = p
            raise ValueError(f"NVFP4: {n} is the {role} projection of a routed expert but its "
                             f"{'up' if role == 'gate' else 'gate'} partner {partner} is not in the same bucket; "
                             f"gate (w1) and up (w3) share one global amax and must be quantized together")
    out: List[Tuple[str, torch.Tensor]] = []
    done = set()
    for n, t in items:
        if n in done:
            continue
        if not is_routed_expert_weight(n):
            out.append((n, t))
            continue
        p = gate_up_partner(n)
        if p is None:                                     # w2
            out += _emit(n, nvfp4_quantize(t, name=n))
            continue
        partner, role = p
        gate_n, up_n = (n, partner) if role == "gate" else (partner, n)
        qg, qu = nvfp4_quantize_pair(by_name[gate_n], by_name[up_n], names=(gate_n, up_n))
        out += _emit(gate_n, qg) + _emit(up_n, qu)
        done.update((gate_n, up_n))
    return out
