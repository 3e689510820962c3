"""Config values out of range are refused when the config is made, naming the key and the allowed range
(issue #21, item 3): sizes, epsilons, windows, and upper bounds that keep a config from claiming memory
the files on disk do not back."""

import pytest

from core.config import ConfigError, preset


@pytest.mark.parametrize("key, value, allowed", [
    ("vocab_size", 10 ** 12, r"1 \.\. 4,194,304"),
    ("dim", 0, r"1 \.\."),
    ("n_heads", -4, r"1 \.\."),
    ("window_size", 0, r"1 \.\."),
    ("moe_inter_dim", 10 ** 9, r"\.\. 262,144"),
    ("norm_eps", -1e-6, "> 0"),
    ("hc_eps", 0.0, "> 0"),
    ("o_groups", 8, r"= n_heads"),
    ("eos_token_id", 5000, r"vocab_size - 1"),
    ("n_hash_layers", 9, "n_layers"),
])
def test_out_of_range_model_config_is_refused_naming_key_and_range(key, value, allowed):
    with pytest.raises(ConfigError, match=rf"'{key}'.*out of range.*{allowed}"):
        preset("tiny").replace(**{key: value})


def test_every_preset_is_in_range():
    from core.config import PRESETS

    for name, c in PRESETS.items():
        assert c.replace() == c, name


def test_a_huge_vocab_in_config_json_is_refused_before_allocation(tmp_path):
    import json

    d = preset("tiny").to_hf_dict()
    d["vocab_size"] = 10 ** 12
    (tmp_path / "config.json").write_text(json.dumps(d))
    from core.config import ModelConfig

    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_json(tmp_path / "config.json")


def test_a_native_config_that_does_not_match_its_tensors_is_refused(tmp_path):
    import json

    import torch

    from core.native_checkpoint import META_FILE, NativeCheckpointError, native_model_config, save_native
    from core import weight_contract as wc

    c = preset("tiny").replace(n_layers=2, compress_ratios=(0, 0, 0), n_hash_layers=1)
    state = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in wc.native_names(c).items()}
    save_native(tmp_path / "nat", state, impl="miles", config=c)
    assert native_model_config(tmp_path / "nat") == c
    meta = json.loads((tmp_path / "nat" / META_FILE).read_text())
    meta["model_config"]["vocab_size"] = 4 * c.vocab_size        # in range, but not what the files hold
    (tmp_path / "nat" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(NativeCheckpointError, match="does not belong to these files"):
        native_model_config(tmp_path / "nat")
