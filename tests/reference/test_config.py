"""core.config: presets, parsing (HF + reference keys), errors, round trips."""

from __future__ import annotations

import json

import pytest

from core.config import PRESETS, ConfigError, ModelConfig, preset


def test_presets_match_architecture():
    f, p = preset("flash"), preset("pro")
    assert (f.dim, f.n_layers, f.n_heads, f.q_lora_rank, f.o_groups, f.index_topk, f.n_routed_experts,
            f.moe_inter_dim, f.route_scale) == (4096, 43, 64, 1024, 8, 512, 256, 2048, 1.5)
    assert (p.dim, p.n_layers, p.n_heads, p.q_lora_rank, p.o_groups, p.index_topk, p.n_routed_experts,
            p.moe_inter_dim, p.route_scale) == (7168, 61, 128, 1536, 16, 1024, 384, 3072, 2.5)
    assert f.compress_ratios == (0, 0) + (4, 128) * 20 + (4, 0) and len(f.compress_ratios) == 44
    assert p.compress_ratios == (128, 128) + (4, 128) * 29 + (4, 0) and len(p.compress_ratios) == 62
    for c in (f, p):
        assert (c.head_dim, c.rope_head_dim, c.window_size, c.n_hash_layers, c.hc_mult, c.hc_sinkhorn_iters) == \
            (512, 64, 128, 3, 4, 20)
        assert (c.rope_theta, c.compress_rope_theta, c.rope_factor, c.original_seq_len, c.beta_fast,
                c.beta_slow) == (10000.0, 160000.0, 16.0, 65536, 32.0, 1.0)
        assert c.score_func == "sqrtsoftplus" and c.swiglu_limit == 10.0 and c.shared_expert_clamp
        assert c.expert_dtype == "fp4" and c.quantization_config_dict()["weight_block_size"] == [128, 128]
    assert [f.layer_kind(i) for i in (0, 1, 2, 3, 42, 43)] == ["window", "window", "csa", "hca", "csa", "window"]
    assert [p.layer_kind(i) for i in (0, 1, 2, 3, 61)] == ["hca", "hca", "csa", "hca", "window"]


def test_tiny_linears_multiple_of_128():
    from kernels.reference.layers import Linear
    from kernels.reference.model import DeepseekV4Model
    cfg = preset("tiny")
    kinds = {cfg.layer_kind(i) for i in range(cfg.n_layers)}
    assert kinds == {"window", "csa", "hca"} and cfg.n_mtp_layers == 1 and 0 < cfg.n_hash_layers < cfg.n_layers
    m = DeepseekV4Model(cfg, device="meta")
    for name, mod in m.named_modules():
        if isinstance(mod, Linear) and not name.endswith("indexer.weights_proj"):
            assert mod.in_features % 128 == 0 and mod.out_features % 128 == 0, name
    # router gate [E, d] and indexer.weights_proj [H_I, d] are never FP8 (BF16 in the official checkpoint)
    assert cfg.dim % 128 == 0


def test_hf_roundtrip_and_hashable():
    for name, c in PRESETS.items():
        d = c.to_hf_dict()
        assert d["model_type"] == "deepseek_v4" and d["architectures"] == ["DeepseekV4ForCausalLM"]
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(d))) == c, name
        hash(c)
    d = preset("flash").to_hf_dict()
    for k in ("hidden_size", "num_hidden_layers", "compress_ratios", "num_hash_layers", "sliding_window",
              "rope_scaling", "qk_rope_head_dim", "num_nextn_predict_layers", "moe_intermediate_size",
              "num_experts_per_tok", "scoring_func", "routed_scaling_factor", "rms_norm_eps", "expert_dtype"):
        assert k in d
    assert d["rope_scaling"] == {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                                 "beta_fast": 32.0, "beta_slow": 1.0}


def test_reference_keys_and_unknown_keys():
    c = preset("tiny")
    ref = {
        "vocab_size": c.vocab_size, "dim": c.dim, "n_layers": c.n_layers, "n_mtp_layers": 1, "n_heads": c.n_heads,
        "head_dim": c.head_dim, "rope_head_dim": c.rope_head_dim, "q_lora_rank": c.q_lora_rank,
        "o_groups": c.o_groups, "o_lora_rank": c.o_lora_rank, "window_size": c.window_size,
        "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim, "index_topk": c.index_topk,
        "n_routed_experts": c.n_routed_experts, "n_shared_experts": 1, "n_activated_experts": 2,
        "moe_inter_dim": c.moe_inter_dim, "n_hash_layers": 2, "score_func": "sqrtsoftplus", "route_scale": 1.5,
        "swiglu_limit": 10, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-6,
        "rope_theta": 10000, "compress_rope_theta": 160000, "compress_ratios": [0, 4, 128, 4, 0],
        "rope_factor": 16, "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1,
        "max_position_embeddings": c.max_position_embeddings, "expert_dtype": "fp4",
        "quantization_config": c.quantization_config_dict(), "dtype": "fp8", "scale_fmt": "ue8m0", "whatever": 1,
    }
    assert ModelConfig.from_hf_dict(ref) == c
    assert c.replace(dim=512).dim == 512 and c.dim == 256


def test_errors(tmp_path):
    d = preset("tiny").to_hf_dict()
    bad = dict(d)
    del bad["hidden_size"]
    with pytest.raises(ConfigError, match="dim"):
        ModelConfig.from_hf_dict(bad)
    with pytest.raises(ConfigError, match="num_hidden_layers|n_layers"):
        ModelConfig.from_hf_dict({**d, "num_hidden_layers": "4"})
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_hf_dict({**d, "compress_ratios": [0, 4]})
    with pytest.raises(ConfigError, match="route_scale"):
        ModelConfig.from_hf_dict({**d, "routed_scaling_factor": "big"})
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_json(p)
    p.write_text(json.dumps(d))
    assert ModelConfig.from_json(p) == preset("tiny")
    with pytest.raises(ConfigError, match="flash"):
        preset("nope")
    with pytest.raises(ConfigError):
        preset("tiny").layer_kind(5)


def test_transformers_serialized_form():
    import transformers
    from tests.reference.hf_mapping import hf_config_from
    c = preset("tiny")
    d = hf_config_from(c).to_dict()
    assert ModelConfig.from_hf_dict(d).replace(expert_dtype="fp4", quantization_config=c.quantization_config) == c
