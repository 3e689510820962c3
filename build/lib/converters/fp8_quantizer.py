"""FP8 e4m3 128x128 block quantizer for publishing weights to an FP8 rollout engine.

Which tensors are quantized is decided by :mod:`converters.quant_allowlist`
(the one place); everything else is published unchanged.

Scales (``scale_format``):

* ``"ue8m0"`` (default, the official checkpoint format and what DeepGEMM-style
  engines want): ``s = 2^ceil(log2(amax / 448))`` stored as float8_e8m0fnu.
* ``"fp32"``: ``s = amax / 448`` stored as fp32.

``amax`` is floored at 1e-4 (an all-zero block gets a tiny finite scale).
Per element the round trip ``dequant(quant(w))`` is within one e4m3 ULP of
``w / s`` times ``s`` (it is round-to-nearest, so within half a ULP).

Host-sync free: only tensor ops (no ``.item()``, no tensor truthiness, no
data-dependent shapes), so it can run inside a CUDA-graph / async publish.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from core.checkpoint.formats import FP8_BLOCK, fp8_block_dequantize, fp8_block_quantize

from ._accel import triton_kernels_for
from .quant_allowlist import is_fp8_publish_weight

SCALE_FORMATS = ("ue8m0", "fp32")


def publish_scale_name(weight_name: str, suffix: str = ".scale") -> str:
    """``x.weight`` -> ``x.scale`` (official) or ``x.weight_scale_inv`` (``suffix``)."""
    base = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base + suffix


def quantize_fp8_blocks(tensor: torch.Tensor, scale_format: str = "ue8m0") -> Tuple[torch.Tensor, torch.Tensor]:
    """2-D float tensor -> ``(e4m3 [out, in], scale [ceil(out/128), ceil(in/128)])`` on its device."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    tk = triton_kernels_for(tensor)
    if tk is not None:                      # fused one-pass kernel, bit-identical to the torch path
        out = tk.fp8_block_quantize(tensor, scale_format)
        if out is not None:
            return out
    return fp8_block_quantize(tensor, block=FP8_BLOCK, scale_fmt=scale_format)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return fp8_block_dequantize(q, scale, block=FP8_BLOCK, dtype=dtype)


def quantize_for_publish(name: str, tensor: torch.Tensor, scale_format: str = "ue8m0", *,
                         scale_suffix: str = ".scale") -> List[Tuple[str, torch.Tensor]]:
    """One named weight -> the tensors to publish.

    Allow-listed 2-D weights: ``[(name, e4m3), (scale name, scale)]``;
    anything else: ``[(name, tensor)]`` unchanged.
    """
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    if not is_fp8_publish_weight(name):
        return [(name, tensor)]
    if tensor.dim() != 2 or not tensor.is_floating_point():
        raise ValueError(f"{name}: FP8 publishing needs a 2-D float weight, got {tensor.dtype} "
                         f"{list(tensor.shape)}")
    q, s = quantize_fp8_blocks(tensor.detach(), scale_format)
    return [(name, q), (publish_scale_name(name, scale_suffix), s)]
