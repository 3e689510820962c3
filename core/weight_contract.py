"""The one weight contract: official DeepSeek-V4 checkpoint names <-> native names.

Both training implementations (``miles`` and ``megatron``) hold their weights
under the **same native (Megatron-style) names**, so one HF checkpoint loads
into either, a native checkpoint written by one loads into the other, and the
rollout export is implementation-agnostic. This module is the only place that
knows the mapping; everything else (import, export buckets, the weight checker,
native checkpoints, stale-checkpoint refusal) asks it.

The mapping is the declarative :data:`TABLE`: one :class:`Rule` per tensor
kind, in one of three scopes, each applied with a name prefix per instance:

=========  ==========================  ==========================================
scope      official prefix             native prefix
=========  ==========================  ==========================================
global     (none)                      (none)
block      ``layers.N.``               ``decoder.layers.N.``
           ``mtp.K.``                  ``mtp.layers.K.mtp_model_layer.``
mtp        ``mtp.K.``                  ``mtp.layers.K.``
=========  ==========================  ==========================================

A rule maps one official tensor to one native tensor (a rename), or one side
holds several tensors that are the other side's single tensor cut into equal
parts along ``Rule.dim``:

* ``hc_{attn,ffn}_scale`` ``[3]`` is split into ``alpha_pre``, ``alpha_post``,
  ``alpha_res`` (``[1]`` each) on import and re-packed ``[pre, post, res]`` on
  export;
* routed / shared expert ``linear_fc1`` is ``cat(w1, w3)`` along dim 0 (gate
  rows first, then up).

The native names are upstream Megatron's own (NVIDIA Megatron-LM ``dev``:
``HyperConnectionModule`` keeps its static bias as ``<site>.bias``, the MTP block
lives under ``mtp.layers.K.mtp_model_layer``, MTP ``e_proj`` / ``h_proj`` are
separate when hyper-connections are on); ``docs/interop.md`` lists the upstream
commits and ``tests/contract/data/upstream_names_*.json`` the upstream names.
Contract v1 names (``mapping_proj.bias``, ``mtp.layers.K.transformer_layer.``,
the fused ``eh_proj``) are refused as stale. Megatron-Bridge's sequential-expert
form ``mlp.experts.local_experts.E.linear_fc{1,2}.weight`` is accepted on import
(:func:`canonical_native_name`).

The names below are the official reference names (``official_tensor_specs``),
the *logical* (dequantised) tensors: ``.scale`` entries are not part of the
contract; read an FP8/FP4 checkpoint with ``iter_tensors(dequantize=True)``.

Besides names the table declares, per tensor:

* ``fp32``: kept in fp32 by both implementations and by the export (attn_sink,
  compressor ``ape`` and ``norm``, every ``hc_*`` tensor incl. the alphas and
  the head trio; also the router's ``expert_bias`` buffer, fp32 in the official
  checkpoint too). Import upcasts these losslessly; nothing ever downcasts them.
* ``holder``: ``"parameter"`` (trainable), ``"frozen_parameter"``
  (``mlp.router.tid2eid``: a Parameter with ``requires_grad=False`` so weight
  sync, which reads parameters, sees it; a buffer made the reference system
  push an all-zero table to the engine) or ``"buffer"``
  (``mlp.router.expert_bias``).
* ``group``: atomic export groups. Official tensors of one group must reach a
  rollout engine in the same bucket (:data:`ATOMIC_EXPORT_GROUPS`).

No function here changes a value: import/export only rename, concatenate,
split and (for fp32-kept tensors) upcast, so HF -> native -> HF is
bit-identical.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from core.errors import UserInputError

#: Bumped whenever a native name, a split/cat layout or a dtype rule changes.
#: Native checkpoints record it; a different version is refused.
CONTRACT_VERSION = 2

GLOBAL, BLOCK, MTP = "global", "block", "mtp"
PARAMETER, FROZEN_PARAMETER, BUFFER = "parameter", "frozen_parameter", "buffer"

#: The command that turns an HF checkpoint into a native one (for error messages).
CONVERT_HINT = "dsv4 convert --impl {impl} --hf DIR --out DIR"


class WeightContractError(UserInputError, ValueError):
    """A tensor name / shape / dtype that the contract does not allow."""


@dataclass(frozen=True)
class Rule:
    """One row of the contract.

    ``official`` / ``native``: name templates relative to the scope prefix;
    ``{e}`` stands for a routed expert index. At most one side has more than
    one member; that side's tensors are equal parts of the other side's single
    tensor along ``dim``.
    """

    scope: str
    official: Tuple[str, ...]
    native: Tuple[str, ...]
    dim: int = 0
    fp32: bool = False
    holder: str = PARAMETER
    group: Optional[str] = None

    def __post_init__(self):
        if len(self.official) > 1 and len(self.native) > 1:
            raise AssertionError(f"rule {self.official} <-> {self.native}: both sides have several parts")

    @property
    def key(self) -> str:
        """The atomic group this rule belongs to (its own when ungrouped)."""
        return self.group or self.native[0]

    @property
    def has_expert(self) -> bool:
        return "{e}" in self.native[0]


def _r(scope, official, native, **kw) -> Rule:
    as_tuple = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    return Rule(scope, as_tuple(official), as_tuple(native), **kw)


_SA = "self_attention."
_CA = "self_attention.core_attention."
_HCA = "self_attention_hyper_connection."
_HCF = "mlp_hyper_connection."

#: The contract. Order: globals, block tensors, MTP-only tensors.
TABLE: Tuple[Rule, ...] = (
    # ---------------------------------------------------------------- global
    _r(GLOBAL, "embed.weight", "embedding.word_embeddings.weight"),
    _r(GLOBAL, "head.weight", "output_layer.weight"),
    _r(GLOBAL, "norm.weight", "decoder.final_layernorm.weight"),
    _r(GLOBAL, "hc_head_fn", "decoder.hc_head_fn", fp32=True),
    _r(GLOBAL, "hc_head_base", "decoder.hc_head_base", fp32=True),
    _r(GLOBAL, "hc_head_scale", "decoder.hc_head_scale", fp32=True),
    # ------------------------------------------------- block: norms and mHC
    _r(BLOCK, "attn_norm.weight", "input_layernorm.weight"),
    _r(BLOCK, "ffn_norm.weight", "pre_mlp_layernorm.weight"),
    _r(BLOCK, "hc_attn_fn", _HCA + "mapping_proj.weight", fp32=True),
    _r(BLOCK, "hc_attn_base", _HCA + "bias", fp32=True),
    _r(BLOCK, "hc_attn_scale", (_HCA + "alpha_pre", _HCA + "alpha_post", _HCA + "alpha_res"),
       fp32=True, group="self_attention_hc_alphas"),
    _r(BLOCK, "hc_ffn_fn", _HCF + "mapping_proj.weight", fp32=True),
    _r(BLOCK, "hc_ffn_base", _HCF + "bias", fp32=True),
    _r(BLOCK, "hc_ffn_scale", (_HCF + "alpha_pre", _HCF + "alpha_post", _HCF + "alpha_res"),
       fp32=True, group="mlp_hc_alphas"),
    # ------------------------------------------------------- block: attention
    _r(BLOCK, "attn.wq_a.weight", _SA + "linear_q_down_proj.weight", group="wqkv_a"),
    _r(BLOCK, "attn.q_norm.weight", _SA + "q_layernorm.weight"),
    _r(BLOCK, "attn.wq_b.weight", _SA + "linear_q_up_proj.weight"),
    _r(BLOCK, "attn.wkv.weight", _SA + "linear_kv_proj.weight", group="wqkv_a"),
    _r(BLOCK, "attn.kv_norm.weight", _SA + "kv_layernorm.weight"),
    _r(BLOCK, "attn.wo_a.weight", _SA + "linear_o_group_proj"),  # a bare Parameter: no ".weight"
    _r(BLOCK, "attn.wo_b.weight", _SA + "linear_proj.weight"),
    _r(BLOCK, "attn.attn_sink", _CA + "attn_sink", fp32=True),
    # compressor (CSA and HCA layers)
    _r(BLOCK, "attn.compressor.wkv.weight", _CA + "compressor.linear_wkv.weight", group="compressor_wkv_gate"),
    _r(BLOCK, "attn.compressor.wgate.weight", _CA + "compressor.linear_wgate.weight", group="compressor_wkv_gate"),
    _r(BLOCK, "attn.compressor.ape", _CA + "compressor.ape", fp32=True),
    _r(BLOCK, "attn.compressor.norm.weight", _CA + "compressor.norm.weight", fp32=True),
    # lightning indexer (CSA layers)
    _r(BLOCK, "attn.indexer.wq_b.weight", _CA + "indexer.linear_wq_b.weight"),
    _r(BLOCK, "attn.indexer.weights_proj.weight", _CA + "indexer.linear_weights_proj.weight"),
    _r(BLOCK, "attn.indexer.compressor.wkv.weight", _CA + "indexer.compressor.linear_wkv.weight",
       group="indexer_compressor_wkv_gate"),
    _r(BLOCK, "attn.indexer.compressor.wgate.weight", _CA + "indexer.compressor.linear_wgate.weight",
       group="indexer_compressor_wkv_gate"),
    _r(BLOCK, "attn.indexer.compressor.ape", _CA + "indexer.compressor.ape", fp32=True),
    _r(BLOCK, "attn.indexer.compressor.norm.weight", _CA + "indexer.compressor.norm.weight", fp32=True),
    # ------------------------------------------------------------ block: MoE
    _r(BLOCK, "ffn.gate.weight", "mlp.router.weight"),
    _r(BLOCK, "ffn.gate.bias", "mlp.router.expert_bias", fp32=True, holder=BUFFER),
    _r(BLOCK, "ffn.gate.tid2eid", "mlp.router.tid2eid", holder=FROZEN_PARAMETER),
    _r(BLOCK, ("ffn.experts.{e}.w1.weight", "ffn.experts.{e}.w3.weight"), "mlp.experts.linear_fc1.weight{e}",
       dim=0, group="experts_fc1"),
    _r(BLOCK, "ffn.experts.{e}.w2.weight", "mlp.experts.linear_fc2.weight{e}"),
    _r(BLOCK, ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
       "mlp.shared_experts.linear_fc1.weight", dim=0, group="shared_experts_fc1"),
    _r(BLOCK, "ffn.shared_experts.w2.weight", "mlp.shared_experts.linear_fc2.weight"),
    # ------------------------------------------------------------- MTP only
    _r(MTP, "enorm.weight", "enorm.weight"),
    _r(MTP, "hnorm.weight", "hnorm.weight"),
    _r(MTP, "e_proj.weight", "e_proj.weight"),
    _r(MTP, "h_proj.weight", "h_proj.weight"),
    _r(MTP, "norm.weight", "final_layernorm.weight"),
    _r(MTP, "hc_head_fn", "hc_head_fn", fp32=True),
    _r(MTP, "hc_head_base", "hc_head_base", fp32=True),
    _r(MTP, "hc_head_scale", "hc_head_scale", fp32=True),
)


def _atomic_groups() -> Dict[str, Dict[str, Tuple[str, ...]]]:
    out: Dict[str, Dict[str, list]] = {}
    for rule in TABLE:
        if rule.group is None:
            continue
        g = out.setdefault(rule.group, {"scope": rule.scope, "official": [], "native": []})
        g["official"].extend(rule.official)
        g["native"].extend(rule.native)
    return {k: {"scope": v["scope"], "official": tuple(v["official"]), "native": tuple(v["native"])}
            for k, v in out.items()}


#: key -> {"scope", "official": suffixes, "native": suffixes}: official tensors
#: that must be published together (SGLang fuses wq_a+wkv into wqkv_a and
#: concatenates compressor wkv+wgate; the packed alphas, the fc1 halves and
#: e/h_proj come from one native tensor or go into one official tensor).
ATOMIC_EXPORT_GROUPS: Dict[str, Dict[str, Tuple[str, ...]]] = _atomic_groups()


# ----------------------------------------------------------------- lookup
def _template_regex(template: str) -> "re.Pattern":
    return re.compile(re.escape(template).replace(re.escape("{e}"), r"(\d+)") + r"\Z")


class _Index:
    """name (relative to a scope prefix) -> (rule, position) for one side."""

    def __init__(self, side: str):
        self.exact: Dict[Tuple[str, str], Tuple[Rule, int]] = {}
        self.patterns: Dict[str, List[Tuple["re.Pattern", Rule, int]]] = {}
        for rule in TABLE:
            for pos, tpl in enumerate(getattr(rule, side)):
                if "{e}" in tpl:
                    self.patterns.setdefault(rule.scope, []).append((_template_regex(tpl), rule, pos))
                else:
                    assert (rule.scope, tpl) not in self.exact, tpl
                    self.exact[(rule.scope, tpl)] = (rule, pos)

    def find(self, scope: str, rest: str):
        hit = self.exact.get((scope, rest))
        if hit is not None:
            return hit[0], hit[1], None
        for rx, rule, pos in self.patterns.get(scope, ()):
            m = rx.match(rest)
            if m:
                return rule, pos, int(m.group(1))
        return None


_OFFICIAL_INDEX = _Index("official")
_NATIVE_INDEX = _Index("native")

_RX_OFF_LAYER = re.compile(r"layers\.(\d+)\.(.+)\Z", re.S)
_RX_OFF_MTP = re.compile(r"mtp\.(\d+)\.(.+)\Z", re.S)
_RX_NAT_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)\Z", re.S)
_RX_NAT_MTP_BLOCK = re.compile(r"mtp\.layers\.(\d+)\.mtp_model_layer\.(.+)\Z", re.S)
_RX_NAT_MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)\Z", re.S)


@dataclass(frozen=True)
class Binding:
    """A rule applied at one place: a layer / MTP block (and expert)."""

    rule: Rule
    official_prefix: str
    native_prefix: str
    expert: Optional[int] = None

    def _render(self, templates: Sequence[str], prefix: str) -> Tuple[str, ...]:
        e = "" if self.expert is None else str(self.expert)
        return tuple(prefix + t.replace("{e}", e) for t in templates)

    @property
    def official_names(self) -> Tuple[str, ...]:
        return self._render(self.rule.official, self.official_prefix)

    @property
    def native_names(self) -> Tuple[str, ...]:
        return self._render(self.rule.native, self.native_prefix)

    @property
    def unit_key(self) -> Tuple[str, Optional[int], str]:
        """Identifies the atomic export group instance this binding is part of."""
        return (self.native_prefix, self.expert, self.rule.key)


def _official_candidates(name: str):
    m = _RX_OFF_LAYER.match(name)
    if m:
        i = m.group(1)
        return m.group(2), [(BLOCK, f"layers.{i}.", f"decoder.layers.{i}.")]
    m = _RX_OFF_MTP.match(name)
    if m:
        k = m.group(1)
        return m.group(2), [(MTP, f"mtp.{k}.", f"mtp.layers.{k}."),
                            (BLOCK, f"mtp.{k}.", f"mtp.layers.{k}.mtp_model_layer.")]
    return name, [(GLOBAL, "", "")]


def _native_candidates(name: str):
    m = _RX_NAT_LAYER.match(name)
    if m:
        i = m.group(1)
        return m.group(2), [(BLOCK, f"layers.{i}.", f"decoder.layers.{i}.")]
    m = _RX_NAT_MTP_BLOCK.match(name)
    if m:
        k = m.group(1)
        return m.group(2), [(BLOCK, f"mtp.{k}.", f"mtp.layers.{k}.mtp_model_layer.")]
    m = _RX_NAT_MTP.match(name)
    if m:
        k = m.group(1)
        return m.group(2), [(MTP, f"mtp.{k}.", f"mtp.layers.{k}.")]
    return name, [(GLOBAL, "", "")]


def _match(name: str, side: str) -> Optional[Tuple[Binding, int]]:
    """Structural match (no config): the binding and the name's position in it."""
    if not isinstance(name, str):
        return None
    rest, cands = (_official_candidates if side == "official" else _native_candidates)(name)
    index = _OFFICIAL_INDEX if side == "official" else _NATIVE_INDEX
    for scope, off_prefix, nat_prefix in cands:
        hit = index.find(scope, rest)
        if hit is None:
            continue
        rule, pos, expert = hit
        b = Binding(rule, off_prefix, nat_prefix, expert)
        names = b.official_names if side == "official" else b.native_names
        if names[pos] == name:  # rejects non-canonical indices such as "layers.01."
            return b, pos
    return None


# ------------------------------------------------------- config-dependent
def _spec_table(config):
    from core.checkpoint.official_tensors import logical_specs, official_tensor_specs

    return logical_specs(official_tensor_specs(config, "bf16"))


@functools.lru_cache(maxsize=8)
def _cached_specs(config):
    return _spec_table(config)


def official_specs(config):
    """``official name -> TensorSpec`` (logical: dequantised shape and dtype) for ``config``."""
    try:
        hash(config)
    except TypeError:
        return _spec_table(config)
    return _cached_specs(config)


def _resolve(name: str, side: str, config) -> Tuple[Binding, int]:
    hit = _match(name, side)
    if hit is None:
        what = "official checkpoint" if side == "official" else "native"
        hint = ""
        if side == "official" and _match(name, "native") is not None:
            hint = " (it is a native name; use native_to_hf for those)"
        elif side == "native":
            if _match(name, "official") is not None:
                hint = " (it is an official checkpoint name; use hf_to_native for those)"
            else:
                reason = _legacy_reason(name)
                if reason:
                    hint = f" ({reason})"
        if side == "official" and name.endswith(".scale"):
            hint = " (a quantisation scale: read the checkpoint with dequantize=True)"
        raise WeightContractError(f"tensor {name!r}: unknown {what} name, not in the weight contract{hint}")
    b, pos = hit
    specs = official_specs(config)
    missing = [n for n in b.official_names if n not in specs]
    if missing:
        raise WeightContractError(
            f"tensor {name!r}: not a tensor of this model (no {missing[0]!r} in the official "
            f"tensor table for this config: layer / expert index out of range, or the layer kind "
            f"has no such tensor)")
    return b, pos


def _native_shape(b: Binding, pos: int, specs) -> Tuple[int, ...]:
    rule = b.rule
    off = [tuple(specs[n].logical_shape) for n in b.official_names]
    if len(rule.official) > 1:  # native = cat(official parts)
        shape = list(off[0])
        shape[rule.dim] = sum(s[rule.dim] for s in off)
        return tuple(shape)
    shape = list(off[0])
    if len(rule.native) > 1:  # native = equal part of the official tensor
        shape[rule.dim] //= len(rule.native)
    return tuple(shape)


def _native_dtype(b: Binding, specs) -> torch.dtype:
    dt = specs[b.official_names[0]].logical_dtype
    if b.rule.fp32 and dt.is_floating_point:
        return torch.float32
    return dt


def iter_bindings(config) -> Iterator[Binding]:
    """Every rule instance of ``config``, in official-table order (each once)."""
    seen = set()
    for name in official_specs(config):
        b, _ = _resolve(name, "official", config)
        key = (b.native_prefix, b.expert, id(b.rule))
        if key not in seen:
            seen.add(key)
            yield b


def native_names(config) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``native name -> (shape, dtype)`` for every tensor of ``config``.

    dtype is the contract dtype: fp32 for the fp32-kept tensors, int64 for
    ``tid2eid`` (integer; implementations may hold int32), else the official
    logical dtype (bf16).
    """
    specs = official_specs(config)
    out: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for b in iter_bindings(config):
        dt = _native_dtype(b, specs)
        for pos, n in enumerate(b.native_names):
            out[n] = (_native_shape(b, pos, specs), dt)
    return out


def official_to_native_names(name: str, config) -> Tuple[str, ...]:
    """The native tensor(s) an official tensor becomes (3 for ``hc_*_scale``)."""
    return _resolve(name, "official", config)[0].native_names


def native_to_official_names(name: str, config) -> Tuple[str, ...]:
    """The official tensor(s) a native tensor becomes (w1 and w3 for ``linear_fc1``)."""
    return _resolve(name, "native", config)[0].official_names


def export_unit(native_name: str, config) -> Tuple[tuple, Tuple[str, ...], Tuple[str, ...]]:
    """``(unit key, native members, official members)`` of the atomic export
    group ``native_name`` belongs to (a single tensor when it has none)."""
    b, _ = _resolve(native_name, "native", config)
    specs = official_specs(config)
    if b.rule.group is None:
        return b.unit_key, b.native_names, b.official_names
    nat: List[str] = []
    off: List[str] = []
    for rule in TABLE:
        if rule.group != b.rule.group or rule.scope != b.rule.scope:
            continue
        other = Binding(rule, b.official_prefix, b.native_prefix, b.expert)
        if all(n in specs for n in other.official_names):
            nat.extend(other.native_names)
            off.extend(other.official_names)
    return b.unit_key, tuple(nat), tuple(off)


# ------------------------------------------------------ per-name properties
def rule_for(name: str) -> Rule:
    """The rule of a native or official name (structural; no config needed)."""
    hit = _match(name, "native") or _match(name, "official")
    if hit is None:
        raise WeightContractError(f"tensor {name!r}: not in the weight contract")
    return hit[0].rule


def keeps_fp32(name: str) -> bool:
    """Whether a native or official tensor is kept in fp32 (False for unknown names)."""
    hit = _match(name, "native") or _match(name, "official")
    return bool(hit and hit[0].rule.fp32)


def holder(native_name: str) -> str:
    """``"parameter"``, ``"frozen_parameter"`` (tid2eid) or ``"buffer"`` (expert_bias)."""
    hit = _match(native_name, "native")
    if hit is None:
        raise WeightContractError(f"tensor {native_name!r}: not a native name of the weight contract")
    return hit[0].rule.holder


def is_trainable(native_name: str) -> bool:
    return holder(native_name) == PARAMETER


def is_integer_tensor(name: str) -> bool:
    """tid2eid (native or official): an integer table, never a float."""
    hit = _match(name, "native") or _match(name, "official")
    return bool(hit and hit[0].rule.native[0].endswith("tid2eid"))


# ------------------------------------------------------------ stale names
_LEGACY_PATTERNS: Tuple[Tuple["re.Pattern", str], ...] = tuple((re.compile(p), why) for p, why in (
    (r"(^|\.)self_attention\.(wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)(\.|$)",
     "pre-contract attention name (the old plugin layout; now linear_q_down_proj / q_layernorm / "
     "linear_q_up_proj / linear_kv_proj / kv_layernorm / linear_o_group_proj / linear_proj)"),
    (r"(^|\.)self_attention\.(attn_sink|compressor\.|indexer\.)",
     "pre-contract name: attn_sink, compressor and indexer now live under self_attention.core_attention"),
    (r"(^|\.)hc_(attn|ffn)_(fn|base|scale)$",
     "pre-contract hyper-connection attribute (now self_attention_hyper_connection / mlp_hyper_connection)"),
    (r"(^|\.)hc_head_params\.",
     "pre-contract HCHeadParams name (now decoder.hc_head_fn / hc_head_base / hc_head_scale)"),
    (r"(^|\.)(compressor|indexer\.compressor)\.(wkv|wgate)\.",
     "pre-contract compressor name (now linear_wkv / linear_wgate)"),
    (r"(^|\.)mtp\.layers\.\d+\.transformer_layer\.",
     "contract v1 MTP block name (now mtp.layers.K.mtp_model_layer., as in upstream Megatron)"),
    (r"_hyper_connection\.mapping_proj\.bias$",
     "contract v1 hyper-connection bias (now <site>_hyper_connection.bias, as in upstream Megatron)"),
    (r"(^|\.)mtp\.layers\.\d+\.eh_proj\.",
     "contract v1 fused MTP projection (now separate mtp.layers.K.e_proj / h_proj, as in upstream Megatron)"),
    (r"^module\.", "wrapper prefix (DDP / Float16Module 'module.') must be stripped"),
))


_RX_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight\Z", re.S)


def canonical_native_name(name: str) -> str:
    """The contract's spelling of a native name written by another Megatron setup.

    Megatron-Bridge / megatron-core with sequential (non-grouped) experts hold routed expert
    ``E`` as ``...mlp.experts.local_experts.E.linear_fc1.weight``; the contract (and the
    grouped-GEMM experts of upstream's DeepSeek-V4 spec) spell it ``...mlp.experts.linear_fc1.weightE``.
    Every other name is returned unchanged."""
    m = _RX_LOCAL_EXPERT.match(name)
    if m:
        return f"{m.group(1)}{m.group(3)}.weight{int(m.group(2))}"
    return name


def _legacy_reason(name: str) -> Optional[str]:
    for rx, why in _LEGACY_PATTERNS:
        if rx.search(name):
            return why
    return None


def stale_reason(name: str, config=None) -> Optional[str]:
    """Why ``name`` is not a current native name (None when it is one).

    Known pre-contract spellings get a specific reason; anything else outside
    the contract is stale too. With ``config`` the name must also exist for
    that model (layer / expert range, layer kind).
    """
    why = _legacy_reason(name)
    if why:
        return why
    hit = _match(name, "native")
    if hit is None:
        if _match(name, "official") is not None:
            return "an official checkpoint name, not a native one"
        return "not a name of the weight contract"
    if config is not None:
        try:
            _resolve(name, "native", config)
        except WeightContractError as e:
            return str(e)
    return None


def is_stale_name(name: str, config=None) -> bool:
    """True for pre-contract names (``self_attention.wq_a.``, ``.hc_attn_fn``,
    ``decoder.hc_head_params.``, ...) and for anything not in the contract."""
    return stale_reason(name, config) is not None


# ------------------------------------------------------------- conversion
def _check_in(name: str, t, shape: Tuple[int, ...], integer: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise WeightContractError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise WeightContractError(f"tensor {name!r}: shape {tuple(t.shape)} != contract shape {tuple(shape)}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise WeightContractError(f"tensor {name!r}: must be an integer table, got {t.dtype}")
    if not integer and not t.is_floating_point():
        raise WeightContractError(f"tensor {name!r}: must be floating point, got {t.dtype}")
    if not integer and t.dtype.itemsize == 1:
        raise WeightContractError(f"tensor {name!r}: {t.dtype} is a quantised storage dtype; the contract holds "
                                  f"logical tensors (read the checkpoint with dequantize=True)")


def _join(parts: List[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _cut(t: torch.Tensor, n: int, dim: int, name: str, clone: bool = True) -> List[torch.Tensor]:
    if n == 1:
        return [t]
    size = t.shape[dim]
    if size % n:
        raise WeightContractError(f"tensor {name!r}: dim {dim} of size {size} does not split into {n} parts")
    parts = torch.split(t, size // n, dim=dim)
    return [p.clone(memory_format=torch.contiguous_format) for p in parts] if clone else list(parts)


def _missing_message(direction: str, pending, side: str) -> str:
    lines = []
    for (b, parts) in list(pending.values())[:5]:
        names = b.official_names if side == "official" else b.native_names
        have = [names[i] for i in sorted(parts)]
        miss = [n for i, n in enumerate(names) if i not in parts]
        lines.append(f"{', '.join(miss)} (needed with {', '.join(have)})")
    more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
    return f"{direction}: stream ended with incomplete tensor groups; missing " + "; ".join(lines) + more


def _gather_group(pending: dict, b, pos: int, t: torch.Tensor, part_names, name: str):
    """Collect one part of a tensor that several input tensors make up (w1+w3 -> fc1, the three
    alphas -> hc scale, ...). Returns the joined tensor once every part has arrived, else None."""
    key = (b.native_prefix, b.expert, id(b.rule))
    entry = pending.setdefault(key, (b, {}))
    entry[1][pos] = t
    if len(entry[1]) < len(part_names):
        return None
    del pending[key]
    parts = [entry[1][i] for i in range(len(part_names))]
    if len({p.dtype for p in parts}) > 1:
        raise WeightContractError(f"tensor {name!r}: parts {part_names} have different dtypes {[p.dtype for p in parts]}")
    return _join(parts, b.rule.dim)


def hf_to_native(name_tensor_iter: Iterable[Tuple[str, torch.Tensor]], config) -> Iterator[Tuple[str, torch.Tensor]]:
    """Official ``(name, tensor)`` pairs -> native ``(name, tensor)`` pairs, streaming.

    Renames; splits ``hc_*_scale`` into the three alphas; concatenates w1/w3
    into ``linear_fc1`` as soon as both halves have arrived (only incomplete halves are held). fp32-kept tensors
    are upcast to fp32 (lossless); nothing else changes dtype. Raises
    :class:`WeightContractError` naming the tensor on an unknown / duplicate
    name, a wrong shape, a float ``tid2eid``, or a group left incomplete.
    """
    specs = official_specs(config)
    seen: set = set()
    pending: Dict[tuple, Tuple[Binding, Dict[int, torch.Tensor]]] = {}
    for name, t in name_tensor_iter:
        if name in seen:
            raise WeightContractError(f"tensor {name!r}: appears twice in the input")
        seen.add(name)
        b, pos = _resolve(name, "official", config)
        spec = specs[name]
        _check_in(name, t, spec.logical_shape, not spec.logical_dtype.is_floating_point)
        rule = b.rule
        if len(rule.official) > 1:
            t = _gather_group(pending, b, pos, t, b.official_names, name)
            if t is None:
                continue
        if rule.fp32 and t.dtype != torch.float32:
            t = t.to(torch.float32)
        for n, piece in zip(b.native_names, _cut(t, len(rule.native), rule.dim, name)):
            yield n, piece
    if pending:
        raise WeightContractError(_missing_message("hf_to_native", pending, "official"))


def native_to_hf(native_iter: Iterable[Tuple[str, torch.Tensor]], config, *,
                 official_dtypes: bool = False, clone_cuts: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Native ``(name, tensor)`` pairs -> official ``(name, tensor)`` pairs, streaming.

    Inverse of :func:`hf_to_native`: the three alphas are packed into
    ``hc_*_scale`` once all three have arrived; ``linear_fc1`` is split into
    w1/w3. Dtypes are kept (fp32 stays
    fp32) unless ``official_dtypes=True``, which casts every tensor to the
    official checkpoint's logical dtype (bf16 for linears and norms, int64 for
    tid2eid) for writing an HF checkpoint. ``clone_cuts=False``: the pieces of a split tensor (w1 / w3 of
    ``linear_fc1``) are views of it, not copies (``rollout.shared_weights``: the engine computes with the
    trainer's memory). Raises like :func:`hf_to_native`.
    """
    specs = official_specs(config)
    seen: set = set()
    pending: Dict[tuple, Tuple[Binding, Dict[int, torch.Tensor]]] = {}
    for name, t in native_iter:
        if name in seen:
            raise WeightContractError(f"tensor {name!r}: appears twice in the input")
        seen.add(name)
        b, pos = _resolve(name, "native", config)
        rule = b.rule
        integer = not specs[b.official_names[0]].logical_dtype.is_floating_point
        _check_in(name, t, _native_shape(b, pos, specs), integer)
        if isinstance(t, torch.nn.Parameter):
            t = t.detach()
        if len(rule.native) > 1:
            t = _gather_group(pending, b, pos, t, b.native_names, name)
            if t is None:
                continue
        for n, piece in zip(b.official_names, _cut(t, len(rule.official), rule.dim, name, clone_cuts)):
            if official_dtypes and piece.dtype != specs[n].logical_dtype:
                piece = piece.to(specs[n].logical_dtype)
            yield n, piece
    if pending:
        raise WeightContractError(_missing_message("native_to_hf", pending, "native"))


def official_boxes(native_name: str, offsets: Sequence[int], sizes: Sequence[int], config
                   ) -> List[Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """Where a box of a native tensor lies in the official tensors it is made of, so that a rank reads only
    its box from an HF checkpoint (a tensor-parallel slice; ``linear_fc1`` = cat(w1, w3) gives a box of each).

    Returns ``[(official name, official offsets, sizes, offsets inside the native box)]``; the pieces tile the
    native box. The values are the official ones unchanged (the fp32-kept tensors are upcast by the caller,
    as :func:`hf_to_native` does)."""
    b, pos = _resolve(native_name, "native", config)
    specs = official_specs(config)
    shape = _native_shape(b, pos, specs)
    offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
        raise WeightContractError(f"tensor {native_name!r}: box at {offsets} of size {sizes} is not inside its "
                                  f"contract shape {shape}")
    rule, d = b.rule, b.rule.dim
    if len(rule.official) == 1:            # the official tensor itself, or its pos-th equal part along dim
        off = list(offsets)
        if len(rule.native) > 1:
            off[d] += pos * shape[d]
        return [(b.official_names[0], tuple(off), sizes, (0,) * len(shape))]
    out = []                               # native = cat(official parts) along dim
    lo, hi = offsets[d], offsets[d] + sizes[d]
    start = 0
    for name in b.official_names:
        n = specs[name].logical_shape[d]
        a, z = max(lo, start), min(hi, start + n)
        if a < z:
            off, size, inner = list(offsets), list(sizes), [0] * len(shape)
            off[d], size[d], inner[d] = a - start, z - a, a - lo
            out.append((name, tuple(off), tuple(size), tuple(inner)))
        start += n
    return out


def check_native_state(names: Iterable[str], config=None, *, complete: bool = False) -> None:
    """Raise :class:`WeightContractError` if any name is stale (listing them)
    or, with ``complete`` and ``config``, if a contract tensor is missing."""
    names = list(names)
    bad = [(n, stale_reason(n, config)) for n in names]
    bad = [(n, why) for n, why in bad if why]
    if bad:
        shown = "; ".join(f"{n!r}: {why}" for n, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise WeightContractError(f"{len(bad)} tensor name(s) outside weight contract v{CONTRACT_VERSION}: "
                                  f"{shown}{more}")
    if complete and config is not None:
        missing = sorted(set(native_names(config)) - set(names))
        if missing:
            raise WeightContractError(f"{len(missing)} contract tensor(s) missing, e.g. {missing[:5]}")


def module_tensors(module: torch.nn.Module, config=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The contract tensors a model holds, for weight sync / native checkpoints.

    Yields ``(native name, tensor)`` for every parameter and every contract
    buffer (``expert_bias``) of ``module``, leading ``module.`` wrapper
    prefixes stripped. Raises :class:`WeightContractError` when a parameter
    name is stale, or a tensor is held the wrong way: ``tid2eid`` must be a
    Parameter with ``requires_grad=False`` (a buffer is invisible to weight
    sync: the reference system pushed an all-zero table to the engine),
    ``expert_bias`` a buffer, everything else a Parameter; and fp32-kept
    tensors must be fp32.
    """
    def strip(n: str) -> str:
        while n.startswith("module."):
            n = n[len("module."):]
        return n

    problems: List[str] = []
    out: List[Tuple[str, torch.Tensor]] = []
    for raw, p in module.named_parameters():
        n = strip(raw)
        why = stale_reason(n, config)
        if why:
            problems.append(f"parameter {n!r}: {why}")
            continue
        h = holder(n)
        if h == BUFFER:
            problems.append(f"{n!r} must be a buffer, not a Parameter")
        elif h == FROZEN_PARAMETER and p.requires_grad:
            problems.append(f"{n!r} must have requires_grad=False")
        # (a PARAMETER the user froze, e.g. with a freeze knob, is still exported)
        out.append((n, p))
    for raw, b in module.named_buffers():
        n = strip(raw)
        if _match(n, "native") is None:
            continue  # caches, counters, rope tables ...
        if holder(n) != BUFFER:
            problems.append(f"{n!r} is registered as a buffer but must be a Parameter "
                            f"(weight sync reads parameters)")
            continue
        out.append((n, b))
    for n, t in out:
        if keeps_fp32(n) and t.is_floating_point() and t.dtype != torch.float32:
            problems.append(f"{n!r} is {t.dtype}; the weight contract keeps it in fp32")
    if problems:
        raise WeightContractError(f"{len(problems)} problem(s) with the model's weights: " + "; ".join(problems[:8]))
    yield from out


__all__ = [
    "ATOMIC_EXPORT_GROUPS", "BUFFER", "Binding", "CONTRACT_VERSION", "CONVERT_HINT", "FROZEN_PARAMETER",
    "PARAMETER", "Rule", "TABLE", "WeightContractError", "canonical_native_name", "check_native_state",
    "export_unit", "hf_to_native",
    "holder", "is_integer_tensor", "module_tensors", "is_stale_name", "is_trainable", "iter_bindings", "keeps_fp32",
    "native_names", "native_to_hf", "native_to_official_names", "official_boxes", "official_specs",
    "official_to_native_names",
    "rule_for", "stale_reason",
]
