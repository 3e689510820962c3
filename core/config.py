"""Typed DeepSeek-V4 model configuration.

Field names follow the official ``inference/config.json`` ("reference") names.
``ModelConfig.from_hf_dict`` also accepts the HF ``config.json`` names (and the
nested form that ``transformers.DeepseekV4Config.to_dict()`` writes), and
``ModelConfig.to_hf_dict`` writes the official HF ``config.json`` key set.

Presets (see ``PRESETS``):

* ``flash`` / ``pro``: the official V4-Flash / V4-Pro values (43 / 61 trunk
  layers + 1 MTP layer; ``compress_ratios`` has one entry per trunk layer plus
  one per MTP layer).
* ``flash-4layer``: the reference system's CI shape: Flash widths, 4 trunk
  layers with ratios ``0 0 4 128``, 3 hash layers and **no MTP layer**
  (``n_mtp_layers=0``; the reference system's ``compress_ratios`` list has 4
  entries). That is what makes its parameter count 27,390,526,557.
* ``flash-shaped``: the real V4-Flash *layer* dimensions (hidden 4096, 64 heads
  x 512 with rope 64, q_lora 1024, 8 output groups x 1024, indexer 64 x 128
  top-k 512, window 128, expert width 2048 top-6, hc_mult 4, vocab 129280,
  3 hash layers) with 4 trunk layers (ratios ``0 0 4 128``), Flash's one MTP
  layer (ratio 0) and only 32 routed experts + 1 shared: every tensor has a
  real Flash shape, the expert count is cut so the model stays small enough
  for interop tests (upstream name lists, checkpoint formats).
* ``tiny``: CPU-sized model with every layer kind (window / CSA / HCA trunk
  layers, hash and learned routing, one window-only MTP layer).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigError", "FrozenDict", "ModelConfig", "PRESETS", "preset"]


class ConfigError(ValueError):
    """Invalid or incomplete model configuration."""


class FrozenDict(tuple):
    """A hashable, immutable dict: a tuple of ``(key, value)`` pairs sorted by key."""

    __slots__ = ()

    def to_dict(self) -> dict:
        return {k: _thaw(v) for k, v in self}


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return FrozenDict(sorted((str(k), _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)) and not isinstance(v, FrozenDict):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, FrozenDict):
        return v.to_dict()
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


# Field -> accepted keys (reference name first, then HF / other aliases).
_ALIASES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "dim": ("dim", "hidden_size"),
    "n_layers": ("n_layers", "num_hidden_layers"),
    "n_mtp_layers": ("n_mtp_layers", "num_nextn_predict_layers"),
    "n_heads": ("n_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "rope_head_dim": ("rope_head_dim", "qk_rope_head_dim"),
    "q_lora_rank": ("q_lora_rank",),
    "o_groups": ("o_groups",),
    "o_lora_rank": ("o_lora_rank",),
    "window_size": ("window_size", "sliding_window"),
    "index_n_heads": ("index_n_heads",),
    "index_head_dim": ("index_head_dim",),
    "index_topk": ("index_topk",),
    "n_routed_experts": ("n_routed_experts", "num_local_experts"),
    "n_shared_experts": ("n_shared_experts",),
    "n_activated_experts": ("n_activated_experts", "num_experts_per_tok"),
    "moe_inter_dim": ("moe_inter_dim", "moe_intermediate_size"),
    "n_hash_layers": ("n_hash_layers", "num_hash_layers"),
    "score_func": ("score_func", "scoring_func"),
    "route_scale": ("route_scale", "routed_scaling_factor"),
    "swiglu_limit": ("swiglu_limit",),
    "shared_expert_clamp": ("shared_expert_clamp",),
    "hc_mult": ("hc_mult",),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters",),
    "hc_eps": ("hc_eps",),
    "norm_eps": ("norm_eps", "rms_norm_eps"),
    "rope_theta": ("rope_theta",),
    "compress_rope_theta": ("compress_rope_theta",),
    "compress_ratios": ("compress_ratios",),
    "rope_factor": ("rope_factor",),
    "original_seq_len": ("original_seq_len",),
    "beta_fast": ("beta_fast",),
    "beta_slow": ("beta_slow",),
    "max_position_embeddings": ("max_position_embeddings", "max_seq_len"),
    "expert_dtype": ("expert_dtype",),
    "quantization_config": ("quantization_config",),
    "bos_token_id": ("bos_token_id",),
    "eos_token_id": ("eos_token_id",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}

# Optional fields and the value used when the key is absent.
_OPTIONAL: dict[str, Any] = {
    "n_mtp_layers": 0,
    "shared_expert_clamp": True,
    "rope_factor": 1.0,          # no rope_scaling -> no YaRN
    "original_seq_len": 0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "expert_dtype": None,
    "quantization_config": None,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 architecture hyper-parameters (official reference names)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_mtp_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    n_hash_layers: int
    score_func: str
    route_scale: float
    swiglu_limit: float
    shared_expert_clamp: bool  # True = official (shared expert clamped too); False = reference-system variant
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    compress_ratios: tuple[int, ...]  # n_layers + n_mtp_layers entries
    rope_factor: float
    original_seq_len: int  # YaRN L0; 0 disables YaRN
    beta_fast: float
    beta_slow: float
    max_position_embeddings: int
    expert_dtype: str | None
    quantization_config: tuple | None  # FrozenDict; see quantization_config_dict()
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(f.name, v))
        _check_ranges(self)
        cr = self.compress_ratios
        if len(cr) != self.n_layers + self.n_mtp_layers:
            raise ConfigError(
                f"compress_ratios has {len(cr)} entries, expected n_layers + n_mtp_layers = "
                f"{self.n_layers} + {self.n_mtp_layers}"
            )
        for r in cr:
            if r < 0 or r == 1:
                raise ConfigError(f"compress_ratios: invalid ratio {r} (0 = window only, 4 = CSA, >= 2 = HCA)")
        if self.head_dim <= self.rope_head_dim or self.rope_head_dim % 2:
            raise ConfigError("rope_head_dim must be even and smaller than head_dim")
        if self.index_head_dim <= self.rope_head_dim and any(r == 4 for r in cr):
            raise ConfigError("index_head_dim must be larger than rope_head_dim")
        if self.n_heads % self.o_groups:
            raise ConfigError("o_groups must divide n_heads")
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError("n_activated_experts must be <= n_routed_experts")
        if self.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"score_func: unknown value {self.score_func!r}")
        if self.n_hash_layers > self.n_layers:
            raise ConfigError("n_hash_layers must be <= n_layers")

    # ------------------------------------------------------------- accessors
    def layer_kind(self, layer_id: int) -> str:
        """``"window"`` (ratio 0), ``"csa"`` (ratio 4, overlap + indexer) or ``"hca"`` (any other ratio).

        ``layer_id`` may index an MTP layer (``n_layers + i``)."""
        if not 0 <= layer_id < len(self.compress_ratios):
            raise ConfigError(f"layer_id {layer_id} out of range [0, {len(self.compress_ratios)})")
        r = self.compress_ratios[layer_id]
        return "window" if r == 0 else ("csa" if r == 4 else "hca")

    def is_hash_layer(self, layer_id: int) -> bool:
        """Hash-routed MoE (trunk layers ``< n_hash_layers``; MTP layers never are)."""
        return layer_id < min(self.n_hash_layers, self.n_layers)

    def quantization_config_dict(self) -> dict | None:
        return None if self.quantization_config is None else _thaw(self.quantization_config)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --------------------------------------------------------------- parsing
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a dict with HF and/or reference key names. Unknown keys are ignored."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a dict, got {type(d).__name__}")
        d = dict(d)
        if isinstance(d.get("text_config"), dict):  # multimodal wrappers
            d = {**d, **d["text_config"]}
        # rope: official rope_scaling, or transformers' nested rope_parameters.
        rs = d.get("rope_scaling")
        rp = d.get("rope_parameters")
        if rs is None and isinstance(rp, dict):
            rs = rp.get("compress") if isinstance(rp.get("compress"), dict) else rp
        if rs is not None:
            if not isinstance(rs, dict):
                raise ConfigError("rope_scaling must be a dict")
            rtype = rs.get("type", rs.get("rope_type", "yarn"))
            if rtype == "yarn":
                for key, field in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                                   ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
                    if key in rs and field not in d:
                        d[field] = rs[key]
        # transformers' serialized form: layer_types / mlp_layer_types / partial_rotary_factor.
        if "compress_ratios" not in d and isinstance(d.get("layer_types"), list):
            rates = d.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
            rates = {"sliding_attention": 0, **rates}
            n_mtp = d.get("num_nextn_predict_layers", d.get("n_mtp_layers", 0))
            try:
                d["compress_ratios"] = [rates[t] for t in d["layer_types"]] + [0] * int(n_mtp)
            except KeyError as e:
                raise ConfigError(f"layer_types: unknown layer type {e.args[0]!r}") from None
        if "num_hash_layers" not in d and "n_hash_layers" not in d and isinstance(d.get("mlp_layer_types"), list):
            n = 0
            for t in d["mlp_layer_types"]:
                if t != "hash_moe":
                    break
                n += 1
            d["n_hash_layers"] = n
        if ("qk_rope_head_dim" not in d and "rope_head_dim" not in d and "partial_rotary_factor" in d
                and "head_dim" in d and d["partial_rotary_factor"] is not None):
            d["rope_head_dim"] = int(round(d["head_dim"] * d["partial_rotary_factor"]))

        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for key in _ALIASES[f.name]:
                if key in d:
                    kwargs[f.name] = d[key]
                    break
            else:
                if f.name in _OPTIONAL:
                    kwargs[f.name] = _OPTIONAL[f.name]
                else:
                    raise ConfigError(f"missing required config key {f.name!r} (accepted names: {_ALIASES[f.name]})")
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        if kwargs.get("quantization_config") is not None and not isinstance(kwargs["quantization_config"], (dict, tuple)):
            raise ConfigError("quantization_config must be a dict")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        from core.bounded_io import load_json

        try:
            d = load_json(path, what="config file")
        except json.JSONDecodeError as e:
            raise ConfigError(f"malformed JSON in {path}: {e}") from e
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """Official HF ``config.json`` keys (as in the ``deepseek-ai/DeepSeek-V4-*`` release)."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": self.n_layers,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "num_hash_layers": self.n_hash_layers,
            "scoring_func": self.score_func,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "routed_scaling_factor": self.route_scale,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "compress_ratios": list(self.compress_ratios),
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
        }
        if self.original_seq_len > 0:
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
            }
        if self.expert_dtype is not None:
            d["expert_dtype"] = self.expert_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config_dict()
        if not self.shared_expert_clamp:
            d["shared_expert_clamp"] = False  # non-official extension key
        return d


# ---------------------------------------------------------------- coercion
_INT_FIELDS = {f for f, t in ModelConfig.__annotations__.items() if t == "int"}
_FLOAT_FIELDS = {f for f, t in ModelConfig.__annotations__.items() if t == "float"}


def _coerce(name: str, v: Any) -> Any:
    if name in _INT_FIELDS:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                return int(v)
            raise ConfigError(f"config key {name!r} must be an int, got {type(v).__name__} ({v!r})")
        return v
    if name in _FLOAT_FIELDS:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"config key {name!r} must be a number, got {type(v).__name__} ({v!r})")
        if not math.isfinite(v):
            raise ConfigError(f"config key {name!r} must be finite")
        return float(v)
    if name == "score_func":
        if not isinstance(v, str):
            raise ConfigError(f"config key {name!r} must be a string, got {type(v).__name__}")
        return v
    if name in ("shared_expert_clamp", "tie_word_embeddings"):
        if not isinstance(v, bool):
            raise ConfigError(f"config key {name!r} must be a bool, got {type(v).__name__}")
        return v
    if name == "compress_ratios":
        if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise ConfigError(f"config key 'compress_ratios' must be a list of ints, got {v!r}")
        return tuple(v)
    if name == "expert_dtype":
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"config key 'expert_dtype' must be a string or null, got {type(v).__name__}")
        return v
    if name == "quantization_config":
        if v is None or isinstance(v, FrozenDict):
            return v
        if isinstance(v, dict):
            return _freeze(v)
        if isinstance(v, tuple):  # a tuple of (key, value) pairs
            try:
                return _freeze(dict(v))
            except (TypeError, ValueError):
                pass
        raise ConfigError(f"config key 'quantization_config' must be a dict, got {type(v).__name__}")
    return v


# ----------------------------------------------------------------- ranges
# key -> (lowest, highest) accepted value, both inclusive. The upper bounds are far above any released
# DeepSeek model (V4-Pro: vocab 129,280, dim 7,168, 61 layers, 384 experts) but keep a config from
# claiming sizes whose allocation alone exhausts memory (a vocab of 10**12 is refused here, before any
# tensor exists); the checkpoint readers then hold the config to the tensor shapes in the files.
# A string bound names another key of the same config.
_INT_RANGES: dict[str, tuple[Any, Any]] = {
    "vocab_size": (1, 1 << 22),
    "dim": (1, 1 << 16),
    "n_layers": (1, 1024),
    "n_mtp_layers": (0, 16),
    "n_heads": (1, 4096),
    "head_dim": (2, 8192),
    "rope_head_dim": (0, 8192),
    "q_lora_rank": (1, 1 << 16),
    "o_groups": (1, "n_heads"),
    "o_lora_rank": (1, 1 << 16),
    "window_size": (1, 1 << 20),
    "index_n_heads": (1, 4096),
    "index_head_dim": (1, 8192),
    "index_topk": (1, 1 << 20),
    "n_routed_experts": (1, 1 << 16),
    "n_shared_experts": (0, 64),
    "n_activated_experts": (1, "n_routed_experts"),
    "moe_inter_dim": (1, 1 << 18),
    "n_hash_layers": (0, "n_layers"),
    "hc_mult": (1, 64),
    "hc_sinkhorn_iters": (1, 10_000),
    "original_seq_len": (0, 1 << 26),
    "max_position_embeddings": (1, 1 << 26),
    "bos_token_id": (0, "vocab_size"),
    "eos_token_id": (0, "vocab_size"),
}
# key -> why it must be > 0 (the float fields are already known finite)
_POSITIVE_FLOATS = ("hc_eps", "norm_eps", "route_scale", "rope_theta", "compress_rope_theta", "rope_factor")
_MAX_COMPRESS_RATIO = 1 << 16


def _check_ranges(c: "ModelConfig") -> None:
    """Every size in range (errors name the key and the accepted range)."""
    for key, (lo, hi) in _INT_RANGES.items():
        v = getattr(c, key)
        hi_v = getattr(c, hi) - (1 if key.endswith("_token_id") else 0) if isinstance(hi, str) else hi
        if not lo <= v <= hi_v:
            hi_s = f"{hi_v:,} (= {hi}{' - 1' if key.endswith('_token_id') else ''})" if isinstance(hi, str) else f"{hi:,}"
            raise ConfigError(f"config key {key!r} = {v:,} is out of range: allowed {lo:,} .. {hi_s}")
    for key in _POSITIVE_FLOATS:
        v = getattr(c, key)
        if not v > 0:
            raise ConfigError(f"config key {key!r} = {v} is out of range: must be > 0 (and finite)")
    for r in c.compress_ratios:
        if r > _MAX_COMPRESS_RATIO:
            raise ConfigError(f"config key 'compress_ratios': ratio {r:,} is out of range: allowed 0, 2 .. "
                              f"{_MAX_COMPRESS_RATIO:,}")


# ---------------------------------------------------------------- presets
_FP8_QUANT = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

_FLASH = ModelConfig(
    vocab_size=129280, dim=4096, n_layers=43, n_mtp_layers=1, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window_size=128,
    index_n_heads=64, index_head_dim=128, index_topk=512,
    n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=2048, n_hash_layers=3,
    score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, shared_expert_clamp=True,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
    rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0, max_position_embeddings=1048576,
    expert_dtype="fp4", quantization_config=_FP8_QUANT,
)

_PRO = _FLASH.replace(
    dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
    n_routed_experts=384, moe_inter_dim=3072, route_scale=2.5,
    compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
)

_FLASH_4LAYER = _FLASH.replace(n_layers=4, n_mtp_layers=0, compress_ratios=(0, 0, 4, 128))

# All FP8/FP4-quantizable linears of tiny have in/out features that are multiples of 128.
# (The router gate [8, 256] and indexer.weights_proj [4, 256] are never FP8 in the official
# checkpoint -- they are BF16 there too -- so their small out_features is harmless.)
_TINY = _FLASH.replace(
    vocab_size=1024, dim=256, n_layers=4, n_mtp_layers=1, n_heads=4, head_dim=128, rope_head_dim=64,
    q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=128,
    index_n_heads=4, index_head_dim=128, index_topk=8,
    n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=128, n_hash_layers=2,
    compress_ratios=(0, 4, 128, 4, 0),
)

# tiny with V4-Flash's attention heads (64 x 512): the smallest model the `cuda` kernel backend's sparse
# attention takes (kernels/cuda: head dim 512, heads in tiles of 64), for its tests.
_TINY_WIDE_HEADS = _TINY.replace(n_heads=64, head_dim=512)

_FLASH_SHAPED = _FLASH.replace(n_layers=4, n_mtp_layers=1, n_routed_experts=32, compress_ratios=(0, 0, 4, 128, 0))

PRESETS: dict[str, ModelConfig] = {
    "flash": _FLASH,
    "pro": _PRO,
    "flash-4layer": _FLASH_4LAYER,
    "flash-shaped": _FLASH_SHAPED,
    "tiny": _TINY,
    "tiny-wide-heads": _TINY_WIDE_HEADS,
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; valid names: {sorted(PRESETS)}") from None
