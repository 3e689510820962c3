"""Tiny checkpoints for implementation-vs-reference parity checks, with no neutral tensor left.

``core.checkpoint.prepare_checkpoint`` initialises attention sinks, compressor position biases (ape),
hyper-connection bases and the router bias to 0 and hyper-connection scales (the alphas) to 1: on such a
file a swapped alpha, sink, ape or bias mapping scores exactly like the right one. The parity checkpoint
gives every one of those tensors random, non-neutral values (seeded per tensor from its name, like the
rest of the file), with the three alphas of each ``hc_*_scale`` clearly distinct, and is written in any
weight format ``prepare_checkpoint`` takes (``bf16`` / ``fp8`` / ``mxfp4-experts``), so a quantized row
scores a file in its own format.
"""

from __future__ import annotations

import torch

from core.checkpoint.official_tensors import APE, ATTN_SINK, GATE_BIAS, HC_BASE, HC_SCALE, official_tensor_specs
from core.checkpoint.tiny import iter_initial_tensors, tensor_seed

# The kinds prepare_checkpoint leaves neutral (0 or 1).
NEUTRAL_KINDS = (ATTN_SINK, APE, HC_BASE, HC_SCALE, GATE_BIAS)
# alpha_pre, alpha_post, alpha_res of one hc_*_scale: far apart, so swapping two changes the output.
ALPHAS = (1.3, 0.6, 1.1)


def non_neutral(name: str, kind: str, like: torch.Tensor, seed: int) -> torch.Tensor:
    """The parity value of one neutral-kind tensor (fp32, ``like``'s shape)."""
    g = torch.Generator().manual_seed(tensor_seed(seed, "parity:" + name))
    noise = torch.randn(like.shape, generator=g, dtype=torch.float32)
    if kind == HC_SCALE:    # [3] (block) or [1] (head)
        return torch.tensor(ALPHAS[: like.numel()]).reshape(like.shape) + 0.1 * noise
    if kind == GATE_BIAS:   # selection-only: large enough to change which experts are picked
        return 0.3 * noise
    return 0.3 * noise      # attn_sink, ape, hc_*_base


def parity_tensors(config, weight_format: str = "bf16", seed: int = 0):
    """``iter_initial_tensors`` with every neutral-kind tensor replaced by :func:`non_neutral`."""
    specs = official_tensor_specs(config, weight_format)
    for name, t in iter_initial_tensors(config, weight_format, seed):
        kind = specs[name].kind
        yield name, (non_neutral(name, kind, t, seed).to(t.dtype) if kind in NEUTRAL_KINDS else t)


def prepare_parity_checkpoint(out_dir, config, *, dtype: str = "bf16", seed: int = 0):
    """Like ``prepare_checkpoint(out_dir, config, dtype=dtype, seed=seed)``, with :func:`parity_tensors`."""
    from core.checkpoint.io import write_checkpoint
    from core.checkpoint.tokenizer import TOKENIZER_FILE, ByteTokenizer

    return write_checkpoint(out_dir, config, parity_tensors(config, dtype, seed), weight_format=dtype,
                            quantize=True, extra_files={TOKENIZER_FILE: ByteTokenizer(int(config.vocab_size)).to_json()},
                            progress=False)
