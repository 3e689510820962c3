"""KV compressor of DeepSeek-V4 (CSA ratio 4 with overlap, HCA ratio 128 without).

For complete blocks only (``Nb = floor(S/m)``), in fp32::

    a_t = W_kv x_t,  z_t = W_gate x_t                      (kappa*c channels, kappa = 2 if m == 4 else 1)
    zhat_{i,p} = z_{m i + p} + ape[p]                      (ape added BEFORE the overlap rearrangement)
    HCA:  C_i = sum_{p<m} softmax_p(zhat_{i,p}) * a_{m i+p}                (per-channel softmax)
    CSA:  C_i pools 2m slots: {a_{m(i-1)+p}[:c]} u {a_{m i+p}[c:]} with scores {zhat_{i-1,p}[:c]} u
          {zhat_{i,p}[c:]}; for i = 0 the previous-block slots are kv 0 / score -inf.
    C_i <- RoPE(norm(C_i), position m*i)  (weighted RMSNorm; RoPE on the last rope dims)
    rotate=True (indexer's compressor): C_i <- Hadamard(C_i)
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import KeepFP32, Linear, RMSNorm, linear_fp32
from .rope import apply_rope, rope_cos_sin

__all__ = ["hadamard_transform", "Compressor"]


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order, scale ``n^-1/2``) over the last dim."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    y = x
    h = 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(x.shape) * (n ** -0.5)


class Compressor(KeepFP32):
    """``attn.compressor`` / ``attn.indexer.compressor``: params ``wkv, wgate [kappa*c, d]``,
    ``ape [m, kappa*c]`` (fp32) and ``norm [c]`` (fp32).

    ``ops``: a kernel op table (``core.kernel_ops.OpTable``) whose ``apply_rope`` and (a rotating
    compressor) ``hadamard_transform`` the forward calls, and its norm's ``rms_norm``; None (the reference model)
    = this package's functions."""

    _fp32_names = ("ape",)
    ops = None

    def __init__(self, dim: int, head_dim: int, rope_dim: int, ratio: int, rotate: bool = False,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.head_dim, self.rope_dim, self.ratio, self.rotate = head_dim, rope_dim, ratio, rotate
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = Linear(dim, coff * head_dim)
        self.wgate = Linear(dim, coff * head_dim)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, norm_eps)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``x [B,S,d]`` -> compressed entries ``[B, S // m, c]`` (dtype of x)."""
        B, S, _ = x.shape
        m, c = self.ratio, self.head_dim
        nb = S // m
        if nb == 0:
            return x.new_zeros(B, 0, c)
        xs = x[:, : nb * m]
        a = linear_fp32(xs, self.wkv.weight).view(B, nb, m, -1)
        z = linear_fp32(xs, self.wgate.weight).view(B, nb, m, -1)
        z = z + self.ape.to(z.dtype)
        if self.overlap:
            prev_a = torch.cat((a.new_zeros(B, 1, m, c), a[:, :-1, :, :c]), dim=1)
            prev_z = torch.cat((z.new_full((B, 1, m, c), float("-inf")), z[:, :-1, :, :c]), dim=1)
            a = torch.cat((prev_a, a[..., c:]), dim=2)  # [B, nb, 2m, c]
            z = torch.cat((prev_z, z[..., c:]), dim=2)
        comp = (torch.softmax(z, dim=2) * a).sum(dim=2)  # per-channel softmax over the slots
        comp = self.norm(comp.to(x.dtype))
        cos, sin = rope_cos_sin(inv_freq.to(x.device), torch.arange(nb, device=x.device) * m)
        ops = getattr(self, "ops", None)        # other modules borrow this forward (backends/miles: no ``ops``)
        comp = (apply_rope if ops is None else ops.apply_rope)(comp, cos, sin)
        if self.rotate:
            comp = (hadamard_transform if ops is None else ops.hadamard_transform)(comp)
        return comp
