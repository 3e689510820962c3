"""Parameter counting by component, from the official checkpoint's tensor list.

The list is :func:`core.checkpoint.official_tensors.official_tensor_specs` (the bf16 format: no scales): a
count of V4-Pro's 73,164 tensors takes under a second, where instantiating the model on the meta device (its
23,870 expert modules) took 11 s of ``dsv4 inspect``. tests/reference/test_params.py holds the two to each
other on the small presets.

Conventions (they reproduce the reference numbers exactly):

* ``tid2eid`` IS counted (it is a frozen ``nn.Parameter``; key ``hash_tables``); the router ``bias`` is a
  buffer and is NOT counted.
* ``total`` is the main trunk incl. ``embed`` and ``head`` and EXCLUDES the MTP block(s); the MTP block
  is reported under ``mtp`` and included in ``total_with_mtp``.

    flash-4layer (4 layers 0 0 4 128, 3 hash layers, no MTP)  total =    27,390,526,557
    flash (43 layers + 1 MTP)                                  total =   284,334,557,271
    pro   (61 layers + 1 MTP)                                  total = 1,572,999,506,531
"""

from __future__ import annotations

import math

__all__ = ["COMPONENTS", "component_of", "count_parameters"]

COMPONENTS = ("embed", "head", "attention", "compressor", "indexer", "mhc", "router", "hash_tables",
              "routed_experts", "shared_experts", "norms", "mtp")


def component_of(name: str) -> str:
    """Map an official parameter name to its component."""
    if name.startswith("mtp."):
        return "mtp"
    if name == "embed.weight":
        return "embed"
    if name == "head.weight":
        return "head"
    if ".attn.indexer." in name:
        return "indexer"
    if ".attn.compressor." in name:
        return "compressor"
    if ".attn." in name:
        return "attention"
    if name.startswith("hc_") or ".hc_" in name:
        return "mhc"
    if name.endswith("gate.tid2eid"):
        return "hash_tables"
    if ".ffn.gate." in name:
        return "router"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if name.endswith("norm.weight"):
        return "norms"
    raise ValueError(f"unclassified parameter {name}")


def is_parameter(name: str) -> bool:
    """Whether an official tensor is a model parameter: all are but the routers' ``bias`` (a buffer)."""
    return not (name.endswith(".gate.bias") and ".ffn." in name)


def count_parameters(config) -> dict:
    """``{component: count, ..., "total": trunk count (excl. MTP), "total_with_mtp": ...,
    "active_per_token": trunk params touched per token (excl. hash tables)}``."""
    from core.checkpoint.official_tensors import official_tensor_specs

    counts = {k: 0 for k in COMPONENTS}
    for name, spec in official_tensor_specs(config).items():
        if is_parameter(name):
            counts[component_of(name)] += math.prod(spec.shape)
    counts["total"] = sum(v for k, v in counts.items() if k != "mtp")
    counts["total_with_mtp"] = counts["total"] + counts["mtp"]
    routed = counts["routed_experts"]
    counts["active_per_token"] = (counts["total"] - counts["hash_tables"] - routed
                                  + routed * config.n_activated_experts // config.n_routed_experts)
    return counts
