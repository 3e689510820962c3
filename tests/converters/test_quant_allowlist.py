"""The quantization allow-list against the official weight contract."""

import pytest

from converters.quant_allowlist import gate_up_partner, is_fp8_publish_weight, is_routed_expert_weight
from core.checkpoint.official_tensors import Q_FP4, Q_FP8, official_tensor_specs
from core.config import preset


@pytest.mark.parametrize("preset_name", ["tiny", "flash"])
def test_fp8_allow_list_is_contract_minus_wo_a(preset_name):
    """Published as FP8 == stored as FP8/FP4 in the official checkpoint, except wo_a."""
    specs = official_tensor_specs(preset(preset_name), "mxfp4-experts")
    stored_quantized = {n for n, s in specs.items() if s.quant in (Q_FP8, Q_FP4)}
    expected = {n for n in stored_quantized if not n.endswith("attn.wo_a.weight")}
    published = {n for n in specs if is_fp8_publish_weight(n)}
    assert published == expected
    assert any(n.startswith("mtp.0.e_proj") for n in published)
    assert any("indexer.wq_b" in n for n in published)


QUANTIZED = [
    "layers.0.attn.wq_a.weight", "layers.0.attn.wq_b.weight", "layers.3.attn.wkv.weight",
    "layers.3.attn.wo_b.weight", "layers.3.attn.indexer.wq_b.weight",
    "layers.3.ffn.shared_experts.w1.weight", "layers.3.ffn.shared_experts.w2.weight",
    "layers.3.ffn.shared_experts.w3.weight", "layers.3.ffn.experts.17.w1.weight",
    "layers.3.ffn.experts.0.w2.weight", "mtp.0.ffn.experts.255.w3.weight", "mtp.0.e_proj.weight",
    "mtp.0.h_proj.weight", "mtp.0.attn.wq_a.weight",
]
NOT_QUANTIZED = [
    "layers.0.attn.wo_a.weight", "layers.2.attn.compressor.wkv.weight", "layers.2.attn.compressor.wgate.weight",
    "layers.2.attn.indexer.compressor.wkv.weight", "layers.2.attn.indexer.compressor.wgate.weight",
    "layers.2.attn.indexer.weights_proj.weight", "layers.2.attn.compressor.ape", "layers.2.attn.compressor.norm.weight",
    "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight", "layers.0.attn.q_norm.weight",
    "layers.0.attn.kv_norm.weight", "layers.0.attn.attn_sink", "layers.0.hc_attn_fn", "layers.0.hc_ffn_base",
    "hc_head_fn", "layers.0.ffn.gate.weight", "layers.3.ffn.gate.bias", "layers.0.ffn.gate.tid2eid",
    "embed.weight", "head.weight", "norm.weight", "mtp.0.enorm.weight", "mtp.0.norm.weight",
    "layers.0.attn.wq_a.scale", "layers.3.ffn.experts.1.w1.scale",
]


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized(name):
    assert is_fp8_publish_weight(name)


@pytest.mark.parametrize("name", NOT_QUANTIZED)
def test_not_quantized(name):
    assert not is_fp8_publish_weight(name)


@pytest.mark.parametrize("name,routed", [
    ("layers.3.ffn.experts.0.w1.weight", True),
    ("layers.3.ffn.experts.12.w2.weight", True),
    ("mtp.0.ffn.experts.3.w3.weight", True),
    ("layers.3.ffn.shared_experts.w1.weight", False),
    ("layers.3.ffn.shared_experts.w2.weight", False),
    ("layers.3.ffn.shared_expert.w1.weight", False),
    ("layers.3.ffn.shared_experts.experts.0.w1.weight", False),   # nested naming: shared wins
    ("layers.3.ffn.experts.0.w1.scale", False),
    ("layers.3.ffn.gate.weight", False),
    ("layers.3.attn.wq_a.weight", False),
])
def test_routed_expert_names(name, routed):
    assert is_routed_expert_weight(name) is routed


def test_gate_up_partner():
    assert gate_up_partner("layers.1.ffn.experts.4.w1.weight") == ("layers.1.ffn.experts.4.w3.weight", "gate")
    assert gate_up_partner("layers.1.ffn.experts.4.w3.weight") == ("layers.1.ffn.experts.4.w1.weight", "up")
    assert gate_up_partner("layers.1.ffn.experts.4.w2.weight") is None
    assert gate_up_partner("layers.1.ffn.shared_experts.w1.weight") is None
