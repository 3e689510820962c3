"""``DSv4NativeConfig``: megatron-core's ``MLATransformerConfig`` plus the DeepSeek-V4 fields of the
Megatron-native design (field names as in the native ``dsv4_hybrid`` config).

The process must already be set up for megatron-core (a hardware target does that before any
model is built; on CPU the tests call ``backends.cpu.megatron_shims``). Every fused / jit path is
switched off by :func:`native_config`: this implementation runs the PyTorch math of the selected
kernel backend only.

Field map (official ``ModelConfig`` name -> native field):

====================  ==================================
window_size           csa_window_size
compress_ratios       csa_compress_ratios (trunk + MTP)
compress_rope_theta   csa_compress_rotary_base
o_groups              o_groups
o_lora_rank           o_lora_rank
hc_mult               num_residual_streams
hc_sinkhorn_iters     mhc_sinkhorn_iterations
hc_eps                (none: upstream hard-codes 1e-6; :func:`mhc_eps` reads the model config)
n_hash_layers         moe_n_hash_layers
vocab_size            vocab_size, actual_vocab_size (the hash router's ``tid2eid`` rows)
index_n_heads         dsa_indexer_n_heads
index_head_dim        dsa_indexer_head_dim
index_topk            dsa_indexer_topk
(training knob)       dsa_indexer_loss_coeff (None = off)
(fixed)               experimental_attention_variant = "dsv4_hybrid", enable_hyper_connections = True
(init knob)           mhc_init_gating_factor (initial alpha_pre/post/res; upstream default 0.01)
====================  ==================================

Every DeepSeek-V4 field name here is upstream Megatron-LM's (``dev``, see ``docs/interop.md``), so a
config dumped from one side reads on the other. megatron-core 0.19.2 (the pinned version) does not
know ``"dsv4_hybrid"`` in its ``experimental_attention_variant`` literal; this class declares the
field with the wider type and handles the variant itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Literal, Optional

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

__all__ = ["DSv4NativeConfig", "native_config", "indexer_loss_enabled", "mhc_eps", "MHC_EPS"]

#: upstream's ``_MHC_SINKHORN_EPS`` / ``_MHC_COMPUTE_H_EPS`` (hard-coded there; the official ``hc_eps``).
MHC_EPS = 1e-6


@dataclass
class DSv4NativeConfig(MLATransformerConfig):
    """TransformerConfig extension for the Megatron-native DeepSeek-V4 (``dsv4_hybrid``) design."""

    csa_window_size: int = 128
    """Sliding-window length (keys incl. the query itself)."""

    csa_compress_ratios: Optional[List[int]] = None
    """One ratio per trunk layer, then one per MTP layer: 0 = window only, 4 = CSA, else HCA."""

    csa_compress_rotary_base: float = 160000.0
    """RoPE base of compressed (CSA / HCA) layers (YaRN on); window-only layers use ``rotary_base``."""

    o_groups: int = 8
    o_lora_rank: int = 1024

    num_residual_streams: int = 4
    """mHC streams (``hc_mult``)."""

    mhc_sinkhorn_iterations: int = 20

    enable_hyper_connections: bool = True
    """Always on for DeepSeek-V4 (upstream's switch for ``HyperConnectionTransformerLayer``)."""

    mhc_init_gating_factor: float = 0.01
    """Initial value of the three alphas of every ``HyperConnectionModule`` (upstream's default)."""

    experimental_attention_variant: Optional[Literal["gated_delta_net", "dsa", "dsv4_hybrid"]] = "dsv4_hybrid"

    actual_vocab_size: Optional[int] = None
    """Rows of the hash router's ``tid2eid`` table (the tokenizer's vocabulary)."""

    moe_n_hash_layers: int = 0
    """The first ``moe_n_hash_layers`` trunk layers route by the frozen ``tid2eid`` table."""

    vocab_size: int = 0
    max_sequence_length: int = 1 << 20
    tie_word_embeddings: bool = False

    def __post_init__(self):
        variant = self.experimental_attention_variant
        if variant not in (None, "dsv4_hybrid"):
            raise ValueError(f"experimental_attention_variant must be 'dsv4_hybrid', got {variant!r}")
        # megatron-core 0.19.2 validates only the variants it knows: hide ours from its post-init
        self.experimental_attention_variant = None
        try:
            super().__post_init__()
        finally:
            self.experimental_attention_variant = "dsv4_hybrid"
        if not self.enable_hyper_connections:
            raise ValueError("DeepSeek-V4 requires enable_hyper_connections=True")
        if self.moe_n_hash_layers and not self.actual_vocab_size:
            raise ValueError("actual_vocab_size must be set when moe_n_hash_layers > 0 (the tid2eid table rows)")
        if self.csa_compress_ratios is None:
            raise ValueError("csa_compress_ratios is required (one entry per trunk layer and MTP layer)")
        want = self.num_layers + (self.mtp_num_layers or 0)
        if len(self.csa_compress_ratios) != want:
            raise ValueError(f"csa_compress_ratios has {len(self.csa_compress_ratios)} entries, expected "
                             f"num_layers + mtp_num_layers = {want}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("o_groups must divide num_attention_heads")

    def compress_ratio(self, layer_id: int) -> int:
        """Ratio of a 0-based layer id (trunk ``0..L-1``, MTP ``L + k``)."""
        return int(self.csa_compress_ratios[layer_id])

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < min(self.moe_n_hash_layers, self.num_layers)


def mhc_eps(config) -> float:
    """The mHC epsilon (Sinkhorn and ``pre``/head gates): the model config's ``hc_eps`` when the
    config carries one (``native_config`` attaches it), else upstream's hard-coded value."""
    mc = getattr(config, "dsv4_model_config", None)
    return float(mc.hc_eps) if mc is not None else MHC_EPS


def indexer_loss_enabled(config) -> bool:
    """The indexer KL loss is on iff ``dsa_indexer_loss_coeff`` is a number. ``None`` (the default)
    means off; it never reaches an arithmetic expression."""
    return getattr(config, "dsa_indexer_loss_coeff", None) is not None


def native_config(model_config, run_config=None, *, params_dtype: torch.dtype = torch.float32,
                  dsa_indexer_loss_coeff: Optional[float] = None, **overrides) -> DSv4NativeConfig:
    """``core.config.ModelConfig`` (+ a RunConfig for the parallel sizes) -> :class:`DSv4NativeConfig`.

    The generic transformer / MoE fields come from the shared factory
    ``engine.config.make_transformer_config`` (CPU-safe flags, sqrtsoftplus router, SwiGLU clamp, ...);
    this adds the MLA-shape and DeepSeek-V4 native fields. ``overrides`` may set any field."""
    from engine.config import make_transformer_config

    c = model_config
    names = {f.name for f in dataclasses.fields(DSv4NativeConfig) if f.init}
    base = make_transformer_config(c, run_config, params_dtype=params_dtype,
                                   **{k: v for k, v in overrides.items() if k not in _OWN_FIELDS})
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init and f.name in names}
    # the factory's post-init derived these from init_method_std; let our post-init derive them again
    for derived in ("init_method", "output_layer_init_method"):
        kw.pop(derived, None)
    kw.update(
        q_lora_rank=c.q_lora_rank, kv_lora_rank=c.head_dim, qk_head_dim=c.head_dim - c.rope_head_dim,
        qk_pos_emb_head_dim=c.rope_head_dim, v_head_dim=c.head_dim, qk_layernorm=True,
        rotary_base=c.rope_theta, rotary_scaling_factor=c.rope_factor,
        original_max_position_embeddings=c.original_seq_len, beta_fast=c.beta_fast, beta_slow=c.beta_slow,
        mscale=1.0, mscale_all_dim=0.0, mtp_num_layers=c.n_mtp_layers or None,
        dsa_indexer_n_heads=c.index_n_heads, dsa_indexer_head_dim=c.index_head_dim,
        dsa_indexer_topk=c.index_topk, dsa_indexer_loss_coeff=dsa_indexer_loss_coeff,
        csa_window_size=c.window_size, csa_compress_ratios=list(c.compress_ratios),
        csa_compress_rotary_base=c.compress_rope_theta, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
        num_residual_streams=c.hc_mult, mhc_sinkhorn_iterations=c.hc_sinkhorn_iters,
        enable_hyper_connections=True, experimental_attention_variant="dsv4_hybrid",
        moe_n_hash_layers=c.n_hash_layers, vocab_size=c.vocab_size, actual_vocab_size=c.vocab_size,
        max_sequence_length=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
    )
    kw.update({k: v for k, v in overrides.items() if k in _OWN_FIELDS})
    cfg = DSv4NativeConfig(**kw)
    for attr, value in vars(base).items():  # non-field attributes the shared engine attaches
        if attr not in names and not hasattr(cfg, attr):
            setattr(cfg, attr, value)
    return cfg


#: Fields set here rather than by the shared factory (MLA shapes, DeepSeek-V4 native fields, DSA knobs).
_OWN_FIELDS = frozenset(
    {f.name for f in dataclasses.fields(DSv4NativeConfig)} - {f.name for f in dataclasses.fields(TransformerConfig)}
) | {"dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
     "dsa_indexer_use_sparse_loss", "dsa_kernel_backend"}
