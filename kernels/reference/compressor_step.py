"""The ``compressor_step`` op in torch: a compressor's decode step after its two GEMMs, the contract of the GPU
backends' one-kernel version (``kernels/triton/compress.py``), which the eager static decode step calls where
the run's table has it (``kernels.reference.slots._compress_masked``).

It is that step's torch code with the reference ops, on explicit tensors instead of the modules: the token's slot
written (``a = kv``, ``z = gate + ape[slot]``); where the token completes a block (``(pos + 1) % m == 0``), the
block pooled per channel (:func:`~.decode.pool_slots`: the softmax of the scores over the slots weighting the
values; with overlap, the previous block's first-half channels first), cast to the entries' dtype, normalised
(:func:`~.layers.rms_norm`), rotated at the block's first position (:func:`~.rope.apply_rope`, the angles a row of
the blocks' table :func:`~.decode.angle_table`), Hadamard-transformed for a rotating compressor, and written to
the entry ``first + pos // m``; with overlap the block's first halves kept as the next block's previous slots.
"""

from __future__ import annotations

from typing import Optional

import torch

from .compressor import hadamard_transform
from .decode import pool_slots, table_angles
from .layers import rms_norm
from .rope import apply_rope

__all__ = ["compressor_step"]


def compressor_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, a: torch.Tensor, z: torch.Tensor,
                    prev_a: Optional[torch.Tensor], prev_z: Optional[torch.Tensor], pos: torch.Tensor,
                    out: torch.Tensor, first: int, norm_weight: torch.Tensor, eps: float, angles: torch.Tensor,
                    rotate: bool) -> None:
    """In place (module docstring): ``kv, gate [B, kappa*c]`` (``W_kv x``, ``W_gate x`` in the slots' dtype),
    ``ape [m, kappa*c]``, slots ``a, z [B, m, kappa*c]``, with overlap (``kappa = 2``) ``prev_a, prev_z [B, m, c]``
    (else None), positions ``pos [B]``, entries ``out [B', first + N, c]``, the norm's weight ``[c]`` and
    ``eps``, the blocks' angles ``[2, blocks, r/2]`` and whether to rotate."""
    B, m, _ = a.shape
    c = out.shape[-1]
    rows = torch.arange(B, device=pos.device)
    slot = pos % m
    a[rows, slot] = kv
    z[rows, slot] = gate + ape.to(z.dtype)[slot]
    N = out.shape[1] - first
    if N == 0:                       # capacity below one block: no token can complete one
        return
    done, block = (pos + 1) % m == 0, pos // m
    pa, pz = a, z
    if prev_a is not None:           # entry i pools block i-1's first-half channels and block i's second half
        pa = torch.cat((prev_a, a[..., c:]), dim=1)
        pz = torch.cat((prev_z, z[..., c:]), dim=1)
    pooled = rms_norm(pool_slots(pa, pz).to(out.dtype), norm_weight, eps)
    cos, sin = table_angles(angles, block)
    pooled = apply_rope(pooled[:, None], cos, sin)[:, 0]
    if rotate:
        pooled = hadamard_transform(pooled)
    at = block.clamp(max=N - 1) + first
    out[rows, at] = torch.where(done[:, None], pooled, out[rows, at])
    if prev_a is not None:
        prev_a.copy_(torch.where(done[:, None, None], a[..., :c], prev_a))
        prev_z.copy_(torch.where(done[:, None, None], z[..., :c], prev_z))
