"""The ``norm_rope`` op in torch: an RMS norm and RoPE of one token's rows, and optionally their write into a KV
ring, the contract of the GPU backends' one-kernel version (``kernels/triton/norm_rope.py``), which the eager
static decode step calls where the run's table has it (``kernels.reference.decode._attend``): the query's
``rope(rms_normalize(q))`` and the key's ``rope(kv_norm(kv))`` written to its ring slot ``pos % W``, each two or
three launches (a norm, a rotation, an index write) in torch.
"""

from __future__ import annotations

from typing import Optional

import torch

from .layers import rms_norm, rms_normalize
from .rope import apply_rope

__all__ = ["norm_rope"]


def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor, sin: torch.Tensor,
              ring: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None,
              window: int = 0) -> Optional[torch.Tensor]:
    """``x [B, 1, (H,) D]``: the weighted RMS norm (``weight [D]``, :func:`~.layers.rms_norm`) or, with ``weight``
    None, the weightless one in ``x``'s dtype (:func:`~.layers.rms_normalize`), then RoPE at each row's angles
    ``cos, sin [B, 1, r/2]`` (:func:`~.rope.apply_rope`). Returned; or, given ``ring [B', window + N, D]``,
    ``pos [B]`` and ``window``, row ``b`` (``x [B, 1, D]``) written to ``ring[b, pos[b] % window]`` and None
    returned."""
    y = rms_normalize(x, eps, x.dtype) if weight is None else rms_norm(x, weight, eps)
    y = apply_rope(y, cos, sin)
    if ring is None:
        return y
    ring[torch.arange(y.shape[0], device=pos.device), pos % window] = y[:, 0]
    return None
