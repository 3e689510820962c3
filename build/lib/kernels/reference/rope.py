"""Rotary position embedding of DeepSeek-V4 (interleaved pairs, trailing rope dims, optional YaRN).

* Pairs are ``(x[2i], x[2i+1])`` of the rope slice; the rope slice is the LAST
  ``rope_dim`` channels of a vector.
* ``f_i = theta^(-2i/rope_dim)``; YaRN (only when ``original_seq_len > 0``)
  blends ``f_i / factor`` and ``f_i`` with a linear ramp between the
  correction dims ``low``/``high``. No YaRN mscale anywhere.
* Window-only layers: ``rope_theta`` without YaRN. Compressed (CSA/HCA)
  layers: ``compress_rope_theta`` with YaRN (for everything in the layer).
"""

from __future__ import annotations

import math

import torch

__all__ = ["yarn_correction_range", "rope_inv_freq", "layer_inv_freq", "rope_cos_sin", "apply_rope"]


def yarn_correction_range(rope_dim: int, theta: float, original_seq_len: int,
                          beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """``(low, high)`` YaRN correction dims (in units of pair index 0..rope_dim/2-1)."""
    def corr_dim(n_rot: float) -> float:
        return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(0, math.floor(corr_dim(beta_fast)))
    high = min(rope_dim - 1, math.ceil(corr_dim(beta_slow)))
    return low, high


def rope_inv_freq(rope_dim: int, theta: float, factor: float = 1.0, original_seq_len: int = 0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` in float64 (YaRN-blended when ``original_seq_len > 0``)."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu")  # CPU even under a device context
    freqs = 1.0 / (theta ** (i / rope_dim))
    if original_seq_len > 0:
        low, high = yarn_correction_range(rope_dim, theta, original_seq_len, beta_fast, beta_slow)
        if high == low:
            high = low + 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        smooth = 1.0 - ramp  # 1 for high-frequency pairs (kept), 0 for low-frequency pairs (interpolated)
        freqs = freqs / factor * (1.0 - smooth) + freqs * smooth
    return freqs


def layer_inv_freq(config, layer_id: int) -> torch.Tensor:
    """The per-layer choice: window-only layers use ``rope_theta`` (no YaRN); compressed layers
    use ``compress_rope_theta`` with YaRN."""
    if config.compress_ratios[layer_id] == 0:
        return rope_inv_freq(config.rope_head_dim, config.rope_theta)
    return rope_inv_freq(config.rope_head_dim, config.compress_rope_theta, config.rope_factor,
                         config.original_seq_len, config.beta_fast, config.beta_slow)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype=torch.float64):
    """``cos, sin`` of shape ``[*positions.shape, rope_dim // 2]`` (angles computed in float64)."""
    ang = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` (interleaved pairs).

    ``x``: ``[B, S, D]`` or ``[B, S, H, D]``; ``cos``/``sin``: ``[S, r/2]`` (or ``[B, S, r/2]``).
    ``inverse=True`` applies the conjugate rotation (RoPE at position ``-t``). Out of place."""
    half = cos.shape[-1]
    r = 2 * half
    extra = x.dim() - 3  # number of dims between S and D (heads)
    shape = cos.shape[:-1] + (1,) * extra + (half,)
    ct = torch.promote_types(x.dtype, torch.float32)  # fp32 math (fp64 if x is fp64)
    c = cos.reshape(shape).to(ct)
    s = sin.reshape(shape).to(ct)
    if inverse:
        s = -s
    rot = x[..., -r:].to(ct).unflatten(-1, (half, 2))
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], out), dim=-1)
