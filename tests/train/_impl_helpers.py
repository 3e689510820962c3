"""Shared by the implementation tests of the trainer: a small config with every layer kind, its run
config, and a small JSONL task."""

import json

from core.config import preset


def small_config():
    # 3 trunk layers (layer 0 hash-routed, 1-2 learned; layer 1 CSA with an indexer) + 1 MTP layer
    return preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)


def run_config(impl: str, config, qkv_format=None):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, model=config, qkv_format=qkv_format), make_host(third_party=False),
                     model_name="small")


def write_data(path, n=8):
    rows = [{"prompt": f"{i}+{i}=", "response": f"{2 * i}", "reward": {"type": "valid_bytes"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
