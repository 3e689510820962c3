"""The table of official DeepSeek-V4 checkpoint tensors, derived from a config.

This module is **the one place** where the checkpoint's tensor names, shapes
and dtypes live (architecture.md §3.1). Everything else (reader, writer,
validation, tiny checkpoints) asks :func:`official_tensor_specs`.

Notation: ``d = dim``, ``H = n_heads``, ``D = head_dim``, ``n = hc_mult``,
``G = o_groups``, ``R = o_lora_rank``, ``E = n_routed_experts``,
``I = moe_inter_dim``, ``V = vocab_size``, ``k = n_activated_experts``.

Global tensors::

    embed.weight                 BF16 [V, d]
    head.weight                  BF16 [V, d]
    norm.weight                  BF16 [d]
    hc_head_fn / _base / _scale  F32  [n, n*d] / [n] / [1]

Per block, prefix ``layers.L.`` (L < n_layers) or ``mtp.j.`` (layer id
``n_layers + j``); ratio ``m = compress_ratios[layer id]``::

    attn_norm.weight, ffn_norm.weight         BF16 [d]
    hc_{attn,ffn}_fn / _base / _scale         F32  [(2+n)*n, n*d] / [(2+n)*n] / [3]
    attn.attn_sink                            F32  [H]
    attn.wq_a.weight                          Q8   [q_lora_rank, d]
    attn.q_norm.weight                        BF16 [q_lora_rank]
    attn.wq_b.weight                          Q8   [H*D, q_lora_rank]
    attn.wkv.weight                           Q8   [D, d]
    attn.kv_norm.weight                       BF16 [D]
    attn.wo_a.weight                          Q8   [G*R, H*D/G]
    attn.wo_b.weight                          Q8   [d, G*R]
    # m > 0 (CSA/HCA); kappa = 2 on CSA (m == 4, overlapping blocks) else 1
    attn.compressor.wkv.weight, .wgate.weight BF16 [kappa*D, d]
    attn.compressor.ape                       F32  [m, kappa*D]
    attn.compressor.norm.weight               BF16 [D]
    # CSA only (Lightning Indexer; its compressor has c = index_head_dim, kappa = 2)
    attn.indexer.wq_b.weight                  Q8   [index_n_heads*index_head_dim, q_lora_rank]
    attn.indexer.weights_proj.weight          BF16 [index_n_heads, d]
    attn.indexer.compressor.wkv/.wgate.weight BF16 [2*index_head_dim, d]
    attn.indexer.compressor.ape               F32  [m, 2*index_head_dim]
    attn.indexer.compressor.norm.weight       BF16 [index_head_dim]
    # MoE (every layer)
    ffn.gate.weight                           BF16 [E, d]
    ffn.gate.bias                             F32  [E]      (non-hash layers, MTP included)
    ffn.gate.tid2eid                          I64  [V, k]   (hash layers: trunk L < n_hash_layers)
    ffn.experts.e.w1.weight, .w3.weight       QE   [I, d]
    ffn.experts.e.w2.weight                   QE   [d, I]
    ffn.shared_experts.w1.weight, .w3.weight  Q8   [n_shared*I, d]
    ffn.shared_experts.w2.weight              Q8   [d, n_shared*I]

MTP blocks additionally carry ``e_proj.weight`` / ``h_proj.weight`` (Q8
``[d, d]``), ``enorm.weight`` / ``hnorm.weight`` / ``norm.weight`` (BF16
``[d]``) and their own ``hc_head_{fn,base,scale}``; they share the trunk's
embed and head (not stored under ``mtp.*``).

Storage of ``Q8`` (FP8-eligible linears) and ``QE`` (routed experts) per
``weight_format``:

==================  ======================================  ==============================================
weight_format       Q8                                      QE
==================  ======================================  ==============================================
``bf16``            BF16 ``[out, in]``                      BF16 ``[out, in]``
``fp8``             F8_E4M3 ``[out, in]`` + ``.scale``      same as Q8
                    F8_E8M0 ``[ceil(out/128), ceil(in/128)]``
``mxfp4-experts``   as ``fp8``                              I8 ``[out, in/2]`` (two e2m1 codes per byte)
                                                            + ``.scale`` F8_E8M0 ``[out, ceil(in/32)]``
==================  ======================================  ==============================================

The FP8 ``.scale`` of a Q8 weight may also be stored as F32 (``scale_fmt``
null in the official code); :attr:`TensorSpec.accepted_dtypes` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from .formats import E8M0_DTYPE, FP4_BLOCK, FP8_BLOCK, FP8_DTYPE, fp4_scale_shape, fp8_scale_shape

WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4-experts")

# kinds (what a tensor *is*; tiny.py picks its initial values from this)
EMBED, HEAD, NORM, LINEAR, EXPERT, GATE, GATE_BIAS, TID2EID = (
    "embed", "head", "norm", "linear", "expert", "gate", "gate_bias", "tid2eid")
HC_FN, HC_BASE, HC_SCALE, ATTN_SINK, APE, SCALE = (
    "hc_fn", "hc_base", "hc_scale", "attn_sink", "ape", "scale")

# quantisation of a stored weight
Q_FP8, Q_FP4 = "fp8", "fp4"


_ITEMSIZE: Dict[torch.dtype, int] = {}


def dtype_itemsize(dtype: torch.dtype) -> int:
    if dtype not in _ITEMSIZE:
        _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return _ITEMSIZE[dtype]


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor.

    * ``shape`` / ``dtype``: as stored in the checkpoint.
    * ``kind``: one of the kind constants of this module.
    * ``quant``: ``"fp8"`` / ``"fp4"`` for a quantised weight (its scale is
      ``<name minus .weight>.scale``), else None.
    * ``logical_shape`` / ``logical_dtype``: the tensor after dequantisation
      (what a model holds); equal to shape/dtype for unquantised tensors.
    * ``scale_of``: for a ``.scale`` tensor, the weight it belongs to.
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    kind: str
    quant: Optional[str] = None
    logical_shape: Optional[Tuple[int, ...]] = None
    logical_dtype: Optional[torch.dtype] = None
    scale_of: Optional[str] = None
    accepted_dtypes: Tuple[torch.dtype, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.logical_shape is None:
            object.__setattr__(self, "logical_shape", self.shape)
        if self.logical_dtype is None:
            object.__setattr__(self, "logical_dtype", self.dtype)
        if not self.accepted_dtypes:
            object.__setattr__(self, "accepted_dtypes", (self.dtype,))

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * dtype_itemsize(self.dtype)


def scale_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.scale`` (the official scale naming)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"not a weight name: {weight_name!r}")
    return weight_name[: -len(".weight")] + ".scale"


def layer_kind(config, layer_id: int) -> str:
    """``"window"`` / ``"csa"`` / ``"hca"`` for a layer id (MTP ids follow the trunk)."""
    fn = getattr(config, "layer_kind", None)
    if callable(fn):
        return fn(layer_id)
    ratio = int(config.compress_ratios[layer_id])
    return "window" if ratio == 0 else ("csa" if ratio == 4 else "hca")


def _is_hash_layer(config, layer_id: int) -> bool:
    fn = getattr(config, "is_hash_layer", None)
    if callable(fn):
        return bool(fn(layer_id))
    return layer_id < min(int(config.n_hash_layers), int(config.n_layers))


def _check_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")


class _Builder:
    def __init__(self, weight_format: str):
        self.fmt = weight_format
        self.specs: Dict[str, TensorSpec] = {}

    def add(self, name: str, shape, dtype: torch.dtype, kind: str) -> None:
        assert name not in self.specs, name
        self.specs[name] = TensorSpec(tuple(shape), dtype, kind)

    def linear(self, name: str, out_f: int, in_f: int, *, q8: bool, expert: bool = False) -> None:
        """A linear weight; ``q8``: FP8-eligible; ``expert``: routed expert."""
        kind = EXPERT if expert else LINEAR
        shape = (out_f, in_f)
        fmt = self.fmt
        if fmt == "mxfp4-experts" and expert:
            if in_f % 2:
                raise ValueError(f"{name}: FP4 packing needs an even in_features, got {in_f}")
            self.specs[name] = TensorSpec((out_f, in_f // 2), torch.int8, kind, quant=Q_FP4,
                                          logical_shape=shape, logical_dtype=torch.bfloat16)
            self.specs[scale_name(name)] = TensorSpec(fp4_scale_shape(shape, FP4_BLOCK), E8M0_DTYPE,
                                                      SCALE, scale_of=name)
        elif fmt != "bf16" and (q8 or expert):
            self.specs[name] = TensorSpec(shape, FP8_DTYPE, kind, quant=Q_FP8,
                                          logical_shape=shape, logical_dtype=torch.bfloat16)
            self.specs[scale_name(name)] = TensorSpec(fp8_scale_shape(shape, FP8_BLOCK), E8M0_DTYPE,
                                                      SCALE, scale_of=name,
                                                      accepted_dtypes=(E8M0_DTYPE, torch.float32))
        else:
            self.add(name, shape, torch.bfloat16, kind)

    def hc(self, prefix: str, rows: int, n_scale: int, n: int, dim: int) -> None:
        self.add(prefix + "_fn", (rows, n * dim), torch.float32, HC_FN)
        self.add(prefix + "_base", (rows,), torch.float32, HC_BASE)
        self.add(prefix + "_scale", (n_scale,), torch.float32, HC_SCALE)

    def compressor(self, p: str, ratio: int, c: int, overlap: bool, dim: int) -> None:
        kc = (2 if overlap else 1) * c
        self.linear(p + "wkv.weight", kc, dim, q8=False)
        self.linear(p + "wgate.weight", kc, dim, q8=False)
        self.add(p + "ape", (ratio, kc), torch.float32, APE)
        self.add(p + "norm.weight", (c,), torch.bfloat16, NORM)


def _block(b: _Builder, cfg, p: str, layer_id: int, *, is_hash: bool) -> None:
    d, n = cfg.dim, cfg.hc_mult
    H, D = cfg.n_heads, cfg.head_dim
    G, R = cfg.o_groups, cfg.o_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_inter_dim
    if (H * D) % G:
        raise ValueError(f"n_heads*head_dim={H * D} is not divisible by o_groups={G}")
    hc_rows = (2 + n) * n

    b.add(p + "attn_norm.weight", (d,), torch.bfloat16, NORM)
    b.add(p + "ffn_norm.weight", (d,), torch.bfloat16, NORM)
    b.hc(p + "hc_attn", hc_rows, 3, n, d)
    b.hc(p + "hc_ffn", hc_rows, 3, n, d)

    a = p + "attn."
    b.add(a + "attn_sink", (H,), torch.float32, ATTN_SINK)
    b.linear(a + "wq_a.weight", cfg.q_lora_rank, d, q8=True)
    b.add(a + "q_norm.weight", (cfg.q_lora_rank,), torch.bfloat16, NORM)
    b.linear(a + "wq_b.weight", H * D, cfg.q_lora_rank, q8=True)
    b.linear(a + "wkv.weight", D, d, q8=True)
    b.add(a + "kv_norm.weight", (D,), torch.bfloat16, NORM)
    b.linear(a + "wo_a.weight", G * R, H * D // G, q8=True)
    b.linear(a + "wo_b.weight", d, G * R, q8=True)

    kind = layer_kind(cfg, layer_id)
    ratio = int(cfg.compress_ratios[layer_id])
    if kind != "window":
        if ratio <= 0:
            raise ValueError(f"layer {layer_id} is {kind!r} but compress_ratios[{layer_id}]={ratio}")
        csa = kind == "csa"
        b.compressor(a + "compressor.", ratio, D, csa, d)
        if csa:
            ih, ic = cfg.index_n_heads, cfg.index_head_dim
            b.linear(a + "indexer.wq_b.weight", ih * ic, cfg.q_lora_rank, q8=True)
            b.linear(a + "indexer.weights_proj.weight", ih, d, q8=False)
            b.compressor(a + "indexer.compressor.", ratio, ic, True, d)

    f = p + "ffn."
    b.add(f + "gate.weight", (E, d), torch.bfloat16, GATE)
    if is_hash:
        b.add(f + "gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), torch.int64, TID2EID)
    else:
        b.add(f + "gate.bias", (E,), torch.float32, GATE_BIAS)
    for e in range(E):
        x = f"{f}experts.{e}."
        b.linear(x + "w1.weight", I, d, q8=True, expert=True)
        b.linear(x + "w2.weight", d, I, q8=True, expert=True)
        b.linear(x + "w3.weight", I, d, q8=True, expert=True)
    S = cfg.n_shared_experts * I
    if cfg.n_shared_experts:
        b.linear(f + "shared_experts.w1.weight", S, d, q8=True)
        b.linear(f + "shared_experts.w2.weight", d, S, q8=True)
        b.linear(f + "shared_experts.w3.weight", S, d, q8=True)


def official_tensor_specs(config, weight_format: str = "bf16") -> Dict[str, TensorSpec]:
    """Every tensor of an official-format checkpoint for ``config``.

    Returns an insertion-ordered dict ``name -> TensorSpec`` (globals, then
    ``layers.0..``, then ``mtp.0..``), ``.scale`` entries right after their
    weights. See the module docstring for the table.
    """
    _check_format(weight_format)
    n_layers, n_mtp = int(config.n_layers), int(config.n_mtp_layers)
    if len(config.compress_ratios) != n_layers + n_mtp:
        raise ValueError(f"compress_ratios has {len(config.compress_ratios)} entries, "
                         f"expected n_layers + n_mtp_layers = {n_layers + n_mtp}")
    d, n = config.dim, config.hc_mult
    b = _Builder(weight_format)
    b.add("embed.weight", (config.vocab_size, d), torch.bfloat16, EMBED)
    b.add("head.weight", (config.vocab_size, d), torch.bfloat16, HEAD)
    b.add("norm.weight", (d,), torch.bfloat16, NORM)
    b.hc("hc_head", n, 1, n, d)
    for L in range(n_layers):
        _block(b, config, f"layers.{L}.", L, is_hash=_is_hash_layer(config, L))
    for j in range(n_mtp):
        p = f"mtp.{j}."
        _block(b, config, p, n_layers + j, is_hash=False)
        b.linear(p + "e_proj.weight", d, d, q8=True)
        b.linear(p + "h_proj.weight", d, d, q8=True)
        for nm in ("enorm", "hnorm", "norm"):
            b.add(p + nm + ".weight", (d,), torch.bfloat16, NORM)
        b.hc(p + "hc_head", n, 1, n, d)
    return b.specs


def logical_specs(specs: Dict[str, TensorSpec]) -> Dict[str, TensorSpec]:
    """The tensors a model holds: ``.scale`` entries dropped, quantised weights
    described by their logical (dequantised) shape and dtype."""
    out = {}
    for name, s in specs.items():
        if s.kind == SCALE:
            continue
        if s.quant is None:
            out[name] = s
        else:
            out[name] = TensorSpec(s.logical_shape, s.logical_dtype, s.kind)
    return out


def total_bytes(specs: Dict[str, TensorSpec]) -> int:
    return sum(s.nbytes for s in specs.values())
