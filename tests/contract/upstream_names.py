"""Upstream Megatron's DeepSeek-V4 state names, derived from its module structure.

Upstream's code (NVIDIA Megatron-LM ``dev``) does not import with the pinned megatron-core 0.19.2,
so the names are derived by walking its module tree as written in the files below, independently of
``core.weight_contract``. The result is committed as ``data/upstream_names_<preset>.json``; the test
``test_upstream_names.py`` checks the contract and both implementations against those files.

Regenerate (after re-reading upstream) with::

    PYTHONPATH=. python -m tests.contract.upstream_names --write

What the walk follows (upstream ``dev`` at :data:`MEGATRON_LM_COMMIT`), for the spec upstream and
Megatron-Bridge use for DeepSeek-V4 (``experimental_attention_variant="dsv4_hybrid"``,
``enable_hyper_connections=True``, Transformer Engine, ``moe_grouped_gemm=True``, no biases):

* ``GPTModel``: ``embedding.word_embeddings``, ``decoder`` (``TransformerBlock``), ``mtp``
  (``MultiTokenPredictionBlock``), ``output_layer`` (untied).
* ``TransformerBlock`` with hyper-connections: ``layers``, ``final_layernorm`` and
  ``hc_head_fn`` / ``hc_head_base`` / ``hc_head_scale`` (``transformer/transformer_block.py``).
* ``HyperConnectionTransformerLayer`` (``transformer/transformer_layer.py``, spec in
  ``models/gpt/experimental_attention_variant_module_specs.py``): ``input_layernorm``,
  ``self_attention``, ``self_attention_hyper_connection``, ``pre_mlp_layernorm``, ``mlp``,
  ``mlp_hyper_connection`` (both norms unfused: ``fuse_input_layernorm=False``, MoE pre-norm unfused).
* ``HyperConnectionModule`` (``transformer/hyper_connection.py``): ``mapping_proj`` (``nn.Linear``,
  ``bias=False``), ``alpha_pre``, ``alpha_post``, ``alpha_res``, ``bias``.
* ``DSv4HybridSelfAttention`` (``transformer/experimental_attention_variant/
  deepseek_v4_hybrid_attention.py``): ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_proj``,
  ``q_layernorm``, ``kv_layernorm``, ``core_attention``, ``linear_o_group_proj`` (a bare Parameter),
  ``linear_proj``.
* ``CompressedSparseAttention`` (``.../csa.py``): ``attn_sink``; ``compressor`` when the layer's ratio
  is > 1; ``indexer`` when it is 4. ``Compressor``: ``linear_wkv``, ``linear_wgate``, ``ape``, ``norm``.
  ``CSAIndexer``: ``linear_wq_b``, ``linear_weights_proj``, ``compressor``.
* ``MoELayer``: ``router`` (``TopKRouter``: ``weight``; buffer ``tid2eid`` on hash layers, i.e. trunk
  ``layer_number <= moe_n_hash_layers`` and never an MTP layer, else buffer ``expert_bias``;
  ``transformer/moe/router.py``), ``experts`` (``TEGroupedMLP``: ``linear_fc1.weight<e>``,
  ``linear_fc2.weight<e>``), ``shared_experts`` (``linear_fc1``, ``linear_fc2``).
* ``MultiTokenPredictionLayer`` with hyper-connections (``transformer/multi_token_prediction.py``):
  ``enorm``, ``hnorm``, ``e_proj``, ``h_proj`` (no ``eh_proj``), ``mtp_model_layer`` (a transformer
  layer with the ratio ``csa_compress_ratios[num_layers + k]``), ``final_layernorm``, ``hc_head_*``.

Names are the model's ``state_dict`` keys without Transformer Engine's ``_extra_state`` entries and
without non-persistent buffers (``local_tokens_per_expert``, ...). Megatron-Bridge's DeepSeek-V4 bridge
(:data:`MEGATRON_BRIDGE_COMMIT`, ``src/megatron/bridge/models/deepseek/deepseek_v4_bridge.py``) maps the
same names, and in addition accepts ``mlp.experts.local_experts.<e>.linear_fc{1,2}.weight``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

MEGATRON_LM_REPO = "https://github.com/NVIDIA/Megatron-LM"
MEGATRON_LM_BRANCH = "dev"
MEGATRON_LM_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
MEGATRON_BRIDGE_REPO = "https://github.com/NVIDIA-NeMo/Megatron-Bridge"
MEGATRON_BRIDGE_COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"

UPSTREAM_FILES = [
    "megatron/core/models/gpt/gpt_model.py",
    "megatron/core/models/gpt/experimental_attention_variant_module_specs.py",
    "megatron/core/transformer/transformer_block.py",
    "megatron/core/transformer/transformer_layer.py",
    "megatron/core/transformer/hyper_connection.py",
    "megatron/core/transformer/experimental_attention_variant/deepseek_v4_hybrid_attention.py",
    "megatron/core/transformer/experimental_attention_variant/csa.py",
    "megatron/core/transformer/moe/moe_layer.py",
    "megatron/core/transformer/moe/router.py",
    "megatron/core/transformer/moe/experts.py",
    "megatron/core/transformer/multi_token_prediction.py",
]
BRIDGE_FILES = ["src/megatron/bridge/models/deepseek/deepseek_v4_bridge.py"]

PRESETS = ("tiny", "flash-4layer", "flash-shaped")
DATA = Path(__file__).resolve().parent / "data"


def _hyper_connection(p: str) -> List[str]:
    return [p + "mapping_proj.weight", p + "alpha_pre", p + "alpha_post", p + "alpha_res", p + "bias"]


def _compressor(p: str) -> List[str]:
    return [p + "linear_wkv.weight", p + "linear_wgate.weight", p + "ape", p + "norm.weight"]


def _layer(p: str, ratio: int, hash_layer: bool, n_experts: int) -> List[str]:
    """``HyperConnectionTransformerLayer`` with ``DSv4HybridSelfAttention`` and a ``MoELayer``."""
    out = [p + "input_layernorm.weight"]
    sa = p + "self_attention."
    out += [sa + "linear_q_down_proj.weight", sa + "linear_q_up_proj.weight", sa + "linear_kv_proj.weight",
            sa + "q_layernorm.weight", sa + "kv_layernorm.weight"]
    ca = sa + "core_attention."
    out.append(ca + "attn_sink")
    if ratio > 1:
        out += _compressor(ca + "compressor.")
    if ratio == 4:
        out += [ca + "indexer.linear_wq_b.weight", ca + "indexer.linear_weights_proj.weight"]
        out += _compressor(ca + "indexer.compressor.")
    out += [sa + "linear_o_group_proj", sa + "linear_proj.weight"]
    out += _hyper_connection(p + "self_attention_hyper_connection.")
    out.append(p + "pre_mlp_layernorm.weight")
    out.append(p + "mlp.router.weight")
    out.append(p + ("mlp.router.tid2eid" if hash_layer else "mlp.router.expert_bias"))
    for e in range(n_experts):
        out += [f"{p}mlp.experts.linear_fc1.weight{e}", f"{p}mlp.experts.linear_fc2.weight{e}"]
    out += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"]
    out += _hyper_connection(p + "mlp_hyper_connection.")
    return out


def _hc_head(p: str) -> List[str]:
    return [p + "hc_head_fn", p + "hc_head_base", p + "hc_head_scale"]


def upstream_names(config) -> List[str]:
    """``GPTModel`` state names for a ``core.config.ModelConfig`` (upstream config fields in brackets:
    ``num_layers``, ``mtp_num_layers``, ``csa_compress_ratios``, ``moe_n_hash_layers``, ``num_moe_experts``)."""
    L, E = config.n_layers, config.n_routed_experts
    ratios = list(config.compress_ratios)
    out = ["embedding.word_embeddings.weight"]
    for i in range(L):
        layer_number = i + 1  # upstream numbers layers from 1
        out += _layer(f"decoder.layers.{i}.", ratios[i], layer_number <= config.n_hash_layers, E)
    out.append("decoder.final_layernorm.weight")
    out += _hc_head("decoder.")
    for k in range(config.n_mtp_layers):
        p = f"mtp.layers.{k}."
        out += [p + "enorm.weight", p + "hnorm.weight", p + "e_proj.weight", p + "h_proj.weight"]
        out += _layer(p + "mtp_model_layer.", ratios[L + k], False, E)
        out.append(p + "final_layernorm.weight")
        out += _hc_head(p)
    out.append("output_layer.weight")
    return out


def document(preset_name: str) -> dict:
    from core.config import preset

    names = upstream_names(preset(preset_name))
    return {
        "preset": preset_name,
        "source": {
            "repo": MEGATRON_LM_REPO, "branch": MEGATRON_LM_BRANCH, "commit": MEGATRON_LM_COMMIT,
            "files": UPSTREAM_FILES,
            "cross_checked_with": {"repo": MEGATRON_BRIDGE_REPO, "commit": MEGATRON_BRIDGE_COMMIT,
                                   "files": BRIDGE_FILES},
            "how": "derived from the module structure (tests/contract/upstream_names.py): state_dict keys "
                   "without TE _extra_state and non-persistent buffers; TE spec, moe_grouped_gemm=True",
        },
        "num_names": len(names),
        "names": names,
    }


def load(preset_name: str) -> dict:
    return json.loads((DATA / f"upstream_names_{preset_name}.json").read_text())


def main(argv) -> int:
    if argv[1:] != ["--write"]:
        print(__doc__)
        return 2
    DATA.mkdir(exist_ok=True)
    for name in PRESETS:
        path = DATA / f"upstream_names_{name}.json"
        path.write_text(json.dumps(document(name), indent=1) + "\n")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
