"""Deterministic official-format checkpoints built from the spec table alone.

``prepare_checkpoint(out_dir, preset("tiny"), dtype="fp8", seed=0)`` writes a
complete checkpoint (config.json, shards, index, byte-level tokenizer) whose
bytes depend only on (config, dtype, seed) (and the torch version's CPU
normal generator).

Each tensor gets its own ``torch.Generator`` seeded from
``sha256(f"{seed}:{name}")`` (never Python's salted ``hash()``), so values do
not depend on iteration order or on which other tensors exist.

Initial values by kind (HF ``_init_weights`` conventions, architecture.md §6.2):

=========================  =========================================
linear / expert / gate /   N(0, 0.02), then quantised per the format
embed / head / hc_*_fn     (FP8 128x128 ue8m0, or FP4 1x32 ue8m0)
norm weights, hc_*_scale   1
hc_*_base, attn_sink, ape  0
ffn.gate.bias              0
ffn.gate.tid2eid           balanced hash: n_activated distinct experts per token
=========================  =========================================
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from .io import DEFAULT_MAX_SHARD_BYTES, write_checkpoint
from .official_tensors import (
    APE, ATTN_SINK, EMBED, EXPERT, GATE, GATE_BIAS, HC_BASE, HC_FN, HC_SCALE, HEAD, LINEAR, NORM,
    SCALE, TID2EID, TensorSpec, official_tensor_specs,
)
from .tokenizer import TOKENIZER_FILE, ByteTokenizer

INIT_STD = 0.02


def tensor_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one tensor."""
    h = hashlib.sha256(f"{int(seed)}:{name}".encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def balanced_tid2eid(vocab: int, n_experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[vocab, k]`` int64: each token gets ``k`` distinct experts, every
    expert is used ``floor`` or ``ceil`` of ``vocab*k/n_experts`` times.

    Tokens are visited in a random order; the r-th token takes the ``k``
    cyclically consecutive slots ``r*k .. r*k+k-1 (mod n_experts)`` of a random
    expert permutation. ``k <= n_experts`` makes the k slots distinct, and the
    cyclic fill makes the load balanced.
    """
    if not 0 < k <= n_experts:
        raise ValueError(f"need 0 < k <= n_experts, got k={k}, n_experts={n_experts}")
    rank = torch.randperm(vocab, generator=gen)
    perm = torch.randperm(n_experts, generator=gen)
    slots = (rank[:, None] * k + torch.arange(k)[None, :]) % n_experts
    return perm[slots].to(torch.int64)


def init_tensor(name: str, spec: TensorSpec, config, seed: int) -> torch.Tensor:
    """The logical initial value of one tensor (before quantisation)."""
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    shape = spec.logical_shape
    k = spec.kind
    if k in (LINEAR, EXPERT, GATE, EMBED, HEAD, HC_FN):
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD).to(
            torch.float32 if spec.dtype == torch.float32 else torch.bfloat16)
    if k in (NORM, HC_SCALE):
        return torch.ones(shape, dtype=spec.dtype)
    if k in (HC_BASE, ATTN_SINK, APE, GATE_BIAS):
        return torch.zeros(shape, dtype=spec.dtype)
    if k == TID2EID:
        return balanced_tid2eid(int(config.vocab_size), int(config.n_routed_experts),
                                int(config.n_activated_experts), gen)
    raise ValueError(f"{name}: no initialiser for kind {k!r}")


def iter_initial_tensors(config, weight_format: str = "bf16", seed: int = 0) -> Iterator[Tuple[str, torch.Tensor]]:
    """Logical initial tensors in spec-table order, generated one at a time."""
    for name, spec in official_tensor_specs(config, weight_format).items():
        if spec.kind != SCALE:
            yield name, init_tensor(name, spec, config, seed)


def prepare_checkpoint(out_dir, config, *, dtype: str = "bf16", seed: int = 0,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                       progress: Optional[bool] = None) -> Path:
    """Write a deterministic official-format checkpoint for ``config``.

    ``dtype`` is the weight format: ``"bf16"``, ``"fp8"`` or
    ``"mxfp4-experts"``. config.json comes from ``config.to_hf_dict()`` with
    ``quantization_config`` / ``expert_dtype`` set for the format. The
    byte-level stand-in tokenizer (:mod:`.tokenizer`) is written alongside.
    Atomic, like :func:`write_checkpoint`.
    """
    tok = ByteTokenizer(int(config.vocab_size))
    return write_checkpoint(out_dir, config, iter_initial_tensors(config, dtype, seed),
                            max_shard_bytes=max_shard_bytes, weight_format=dtype, quantize=True,
                            overwrite=overwrite, extra_files={TOKENIZER_FILE: tok.to_json()},
                            progress=progress)
