"""Test helper: transformers ``DeepseekV4ForCausalLM`` <-> official DeepSeek-V4 checkpoint names.

Packing differences handled here:

* routed experts: transformers packs all experts of a layer into ``mlp.experts.gate_up_proj [E, 2I, d]``
  (rows ``[:I]`` = gate = official ``w1``, rows ``[I:]`` = up = official ``w3``) and
  ``mlp.experts.down_proj [E, d, I]`` (= official ``w2``);
* the attention sink / compressor position bias / mHC tensors only change names.

transformers has no MTP block (``mtp.*`` is ignored on load), so ``official_to_hf`` drops ``mtp.*``.
"""

from __future__ import annotations

import re

import torch

# (transformers suffix inside model.layers.N., official suffix inside layers.N.)
_LAYER_RENAMES = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
]
_GLOBAL_RENAMES = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
]
_HF2OFF = dict(_LAYER_RENAMES)
_OFF2HF = {o: h for h, o in _LAYER_RENAMES}


def hf_to_official(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    g = dict(_GLOBAL_RENAMES)
    for name, t in hf_sd.items():
        if name in g:
            out[g[name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise KeyError(f"unmapped transformers tensor {name}")
        n, rest = m.group(1), m.group(2)
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"layers.{n}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"layers.{n}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"layers.{n}.ffn.experts.{e}.w2.weight"] = t[e]
        elif rest in _HF2OFF:
            out[f"layers.{n}.{_HF2OFF[rest]}"] = t
        else:
            raise KeyError(f"unmapped transformers tensor {name}")
    return out


def official_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    g = {o: h for h, o in _GLOBAL_RENAMES}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in sd.items():
        if name.startswith("mtp."):
            continue  # transformers has no MTP block
        if name in g:
            out[g[name]] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            raise KeyError(f"unmapped official tensor {name}")
        n, rest = m.group(1), m.group(2)
        me = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.weight", rest)
        if me is not None:
            experts.setdefault(n, {}).setdefault(int(me.group(1)), {})[me.group(2)] = t
        elif rest in _OFF2HF:
            out[f"model.layers.{n}.{_OFF2HF[rest]}"] = t
        else:
            raise KeyError(f"unmapped official tensor {name}")
    for n, per in experts.items():
        ids = sorted(per)
        out[f"model.layers.{n}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((per[e]["w1"], per[e]["w3"]), dim=0) for e in ids])
        out[f"model.layers.{n}.mlp.experts.down_proj"] = torch.stack([per[e]["w2"] for e in ids])
    return out


def hf_config_from(cfg):
    """A transformers ``DeepseekV4Config`` for our ``ModelConfig`` (trunk only: MTP is not modelled)."""
    from transformers import DeepseekV4Config

    rates = {r for r in cfg.compress_ratios[: cfg.n_layers] if r not in (0, 4)}
    assert len(rates) <= 1, "transformers supports one HCA ratio"
    rope = {"rope_type": "yarn", "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.original_seq_len,
            "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow}
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, num_experts_per_tok=cfg.n_activated_experts,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts,
        scoring_func=cfg.score_func, routed_scaling_factor=cfg.route_scale,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps, swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.window_size,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, num_nextn_predict_layers=cfg.n_mtp_layers,
        rms_norm_eps=cfg.norm_eps, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False,
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": rates.pop() if rates else 128},
        compress_ratios=list(cfg.compress_ratios[: cfg.n_layers]), num_hash_layers=cfg.n_hash_layers,
        qk_rope_head_dim=cfg.rope_head_dim, rope_parameters=rope,
    )
