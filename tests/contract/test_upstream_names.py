"""The weight contract's native names == upstream Megatron's DeepSeek-V4 names.

``data/upstream_names_<preset>.json`` hold upstream's state names (NVIDIA Megatron-LM ``dev``, the commit
and files recorded in each file), derived from its module structure by ``upstream_names.py``. The two
implementations' module names are checked against the same files in ``tests/impl_megatron/test_names.py``
and ``tests/impl_miles/test_model_contract.py``."""

from __future__ import annotations

import pytest

from core import weight_contract as wc
from core.config import preset

from .upstream_names import MEGATRON_LM_COMMIT, PRESETS, document, load


@pytest.mark.parametrize("name", PRESETS)
def test_contract_native_names_equal_upstream(name):
    up = load(name)
    assert up["source"]["commit"] == MEGATRON_LM_COMMIT
    assert up["num_names"] == len(up["names"]) == len(set(up["names"]))
    ours = wc.native_names(preset(name))
    assert sorted(ours) == sorted(up["names"])


@pytest.mark.parametrize("name", PRESETS)
def test_committed_name_lists_are_current(name):
    """The JSON files are what the structural walk produces (regenerate with ``--write``)."""
    assert load(name) == document(name)


def test_flash_shaped_preset_has_the_flash_layer_dimensions():
    fs, fl = preset("flash-shaped"), preset("flash")
    for f in ("dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
              "index_n_heads", "index_head_dim", "index_topk", "window_size", "moe_inter_dim",
              "n_activated_experts", "hc_mult", "vocab_size", "n_hash_layers", "n_shared_experts"):
        assert getattr(fs, f) == getattr(fl, f), f
    assert (fs.n_layers, fs.n_mtp_layers, fs.compress_ratios, fs.n_routed_experts) == (4, 1, (0, 0, 4, 128, 0), 32)


@pytest.mark.parametrize("name", PRESETS)
def test_upstream_names_are_not_stale(name):
    cfg = preset(name)
    for n in load(name)["names"]:
        assert wc.stale_reason(n, cfg) is None, n
