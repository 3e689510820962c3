"""Which official tensors get quantized when weights are published.

This module is **the one place** that decides, from an official tensor name
(``core/checkpoint/official_tensors.py`` naming: ``layers.L.attn.wq_a.weight``,
``mtp.0.ffn.experts.3.w1.weight``, ...), whether a weight is quantized:

* :func:`is_fp8_publish_weight` - FP8 e4m3 128x128 blocks, for publishing to an
  FP8 rollout engine (``converters.fp8_quantizer.quantize_for_publish``).
* :func:`is_routed_expert_weight` - NVFP4 / MXFP4 (routed experts only,
  ``converters.nvfp4``, ``converters.fake_quant``).

It is the companion of the weight contract (``core/weight_contract.py`` maps
official <-> native names; ``core/checkpoint/official_tensors.py`` says which
linears are *stored* as FP8 (``Q8``) or FP4 (``QE``)); this module says which
of them are *re-quantized* when publishing (names are official names, as
``core.export.export_buckets`` yields them). The two differ in
one place only: ``attn.wo_a`` is FP8 in the official checkpoint but runs in
bf16 (the official ``convert.py`` dequantizes it), so it is published in bf16.
``tests/converters/test_quant_allowlist.py`` checks exactly that relation
against ``official_tensor_specs``, so a change of the contract shows up there.

FP8-quantized (per transformer block ``layers.L.`` / ``mtp.j.``)::

    attn.wq_a  attn.wq_b  attn.wkv  attn.wo_b  attn.indexer.wq_b
    ffn.shared_experts.{w1,w2,w3}  ffn.experts.E.{w1,w2,w3}
    mtp.j.e_proj  mtp.j.h_proj

Never quantized: ``attn.wo_a``, every ``compressor.*`` weight (attention and
indexer compressors), ``attn.indexer.weights_proj``, all norms, ``attn_sink``,
``ape``, ``hc_*``, the router ``ffn.gate.weight`` / ``.bias`` / ``.tid2eid``,
``embed.weight`` and ``head.weight``.
"""

from __future__ import annotations

import re

_BLOCK = r"(?:layers|mtp)\.\d+\."

FP8_PUBLISH_PATTERNS = (
    _BLOCK + r"attn\.(?:wq_a|wq_b|wkv|wo_b)\.weight",
    _BLOCK + r"attn\.indexer\.wq_b\.weight",
    _BLOCK + r"ffn\.shared_experts\.w[123]\.weight",
    _BLOCK + r"ffn\.experts\.\d+\.w[123]\.weight",
    r"mtp\.\d+\.(?:e_proj|h_proj)\.weight",
)
_FP8_RE = re.compile("^(?:" + "|".join(FP8_PUBLISH_PATTERNS) + ")$")

# Names that look like linears but must stay high precision (documentation and
# the negative half of the tests; the regex above is what decides).
NEVER_QUANTIZED = (
    "attn.wo_a", "attn.compressor.*", "attn.indexer.compressor.*", "attn.indexer.weights_proj",
    "*norm*", "attn.attn_sink", "*.ape", "hc_*", "ffn.gate.weight", "ffn.gate.bias",
    "ffn.gate.tid2eid", "embed.weight", "head.weight",
)

_ROUTED_RE = re.compile(r"^(?:.*\.)?experts\.\d+\.w[123]\.weight$")
_GATE_UP_RE = re.compile(r"^(?P<prefix>.*\.experts\.\d+\.)w(?P<which>[13])\.weight$")


def is_fp8_publish_weight(name: str) -> bool:
    """True when ``name`` is published as FP8 e4m3 with 128x128 block scales."""
    return _FP8_RE.match(name) is not None


def is_shared_expert_name(name: str) -> bool:
    """True for any tensor under a ``shared_experts`` / ``shared_expert`` module."""
    return ".shared_experts." in name or ".shared_expert." in name or name.startswith(
        ("shared_experts.", "shared_expert."))


def is_routed_expert_weight(name: str) -> bool:
    """True for a routed-expert linear weight (``...experts.E.w{1,2,3}.weight``).

    The shared-expert test runs **first**: ``ffn.shared_experts.w1.weight``
    (and any nested ``...shared_experts.experts.0...`` naming) is never a
    routed expert, whatever else the name contains.
    """
    if is_shared_expert_name(name):
        return False
    if ".experts." not in name and not name.startswith("experts."):
        return False
    return _ROUTED_RE.match(name) is not None


def gate_up_partner(name: str):
    """For a routed ``w1`` (gate) / ``w3`` (up) weight: ``(partner_name, "gate"|"up")``;
    ``None`` for anything else (``w2`` included)."""
    if not is_routed_expert_weight(name):
        return None
    m = _GATE_UP_RE.match(name)
    if m is None:
        return None
    prefix, which = m.group("prefix"), m.group("which")
    if which == "1":
        return prefix + "w3.weight", "gate"
    return prefix + "w1.weight", "up"
