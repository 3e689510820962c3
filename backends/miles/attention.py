"""DeepSeek-V4 attention of the ``miles`` implementation (BSHD, tensor parallel over heads).

Native names under ``self_attention.`` (``core.weight_contract``)::

    linear_q_down_proj.weight   [q_lora, d]        replicated
    q_layernorm.weight          [q_lora]           replicated
    linear_q_up_proj.weight     [H*D, q_lora]      megatron ColumnParallelLinear (heads split)
    linear_kv_proj.weight       [D, d]             replicated (one shared K=V head)
    kv_layernorm.weight         [D]                replicated
    linear_o_group_proj         [G*R, H*D/G]       bare Parameter, split over groups (dim 0)
    linear_proj.weight          [d, G*R]           megatron RowParallelLinear
    core_attention.attn_sink    [H]                fp32, split over heads
    core_attention.compressor.{linear_wkv,linear_wgate}.weight, .norm.weight (fp32), .ape (fp32)
    core_attention.indexer.{linear_wq_b,linear_weights_proj}.weight, .compressor.*   (CSA layers)

Forward (pseudo-code of the reference system, math from ``kernels.reference``)::

    cq = q_layernorm(linear_q_down_proj(x)); q = rms(linear_q_up_proj(cq) per head); RoPE(q)
    kv = RoPE(kv_layernorm(linear_kv_proj(x)))
    idx = window(W) [+ compressed: indexer top-k (ratio 4) | all causal blocks (ratio 128)]
    kv_all = copy_to_tp_region(cat(kv, compressor(x)))          # grads all-reduced over TP
    o = sparse_attention_with_sink(q, kv_all, idx, attn_sink)   # kernel backend op
    o = inverse RoPE(o); u = o per group @ wo_a per group (grouped_projection); out = linear_proj(u)

The indexer is frozen by default (no parameter gradient; its top-k is discrete anyway) and
runs under ``no_grad``. Requires ``o_groups % tp == 0`` (and so ``n_heads % tp == 0``).

Packed sequences and context parallelism (``forward(x, thd)`` with an
:class:`engine.thd_attention.ThdContext`): ``x [B, L, d]`` is this CP rank's contiguous slice of
the stream (``B == 1`` for THD; BSHD + CP: every sample is one segment). RoPE positions restart at
each segment start; the token KV is all-gathered over CP; the compressors run on compacted
fixed-capacity slots (groups never cross a segment, the overlap resets at a segment start, a rank
builds the groups whose last token it holds, the left-boundary rows come from the previous rank)
and are all-gathered rank-major; the indexer scores the query's own segment only and selects its
top-k per segment.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import KeepFP32Module, Linear, RMSNorm, init_normal_, attribute_on, row_parallel_linear
from engine.layout import current as parallel_layout
from engine.runtime import ensure_megatron
from engine.thd_attention import (
    ThdContext,
    all_gather_cp,
    compressed_kv,
    hca_indices,
    indexer_topk,
    indexer_visible_mask,
    picks_to_rows,
    replayed_segment_picks,
)
from engine.tp import mark_keep_in_fp32, mark_tp
from kernels.reference.attention import compressed_visible_indices, window_indices
from kernels.reference.compressor import Compressor as _RefCompressor
from kernels.reference.indexer import Indexer as _RefIndexer
from kernels.reference.indexer import indexer_input_dtype
from kernels.reference.layers import compute_dtype, grouped_projection
from kernels.reference.rope import layer_inv_freq, rope_cos_sin

__all__ = ["DSv4Compressor", "DSv4Indexer", "DSv4CoreAttention", "DeepSeekV4Attention"]


class DSv4Compressor(KeepFP32Module):
    """KV compressor with native names (``linear_wkv``, ``linear_wgate``, ``norm``, ``ape``);
    the math is the reference ``Compressor.forward`` (called on this module)."""

    def __init__(self, dim: int, head_dim: int, rope_dim: int, ratio: int, rotate: bool, norm_eps: float,
                 params_dtype=torch.float32, std: float | None = 0.02, ops=None):
        super().__init__()
        self.head_dim, self.rope_dim, self.ratio, self.rotate = head_dim, rope_dim, ratio, rotate
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.linear_wkv = Linear(dim, coff * head_dim, params_dtype, std)
        self.linear_wgate = Linear(dim, coff * head_dim, params_dtype, std)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        mark_keep_in_fp32(self.ape)
        self.norm = RMSNorm(head_dim, norm_eps, keep_fp32=True, ops=ops)   # fp32 weight: the kernel takes it

    # the reference forward addresses the projections by their official names
    wkv = property(lambda self: self.linear_wkv)
    wgate = property(lambda self: self.linear_wgate)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        return _RefCompressor.forward(self, x, inv_freq)


class DSv4Indexer(nn.Module):
    """Lightning indexer (CSA layers) with native names; math of the reference ``Indexer``."""

    def __init__(self, c, params_dtype=torch.float32, std: float | None = 0.02, ops=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.ratio = 4
        self.linear_wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, params_dtype, std)
        self.linear_weights_proj = Linear(c.dim, c.index_n_heads, params_dtype, std)
        self.compressor = DSv4Compressor(c.dim, c.index_head_dim, c.rope_head_dim, 4, True, c.norm_eps,
                                         params_dtype, std, ops)

    wq_b = property(lambda self: self.linear_wq_b)
    weights_proj = property(lambda self: self.linear_weights_proj)

    def forward(self, x: torch.Tensor, cq: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``[B, S, min(topk, S//4)]`` compressed-entry ids, ``-1`` = none."""
        return _RefIndexer.forward(self, x, cq, inv_freq)


class DSv4CoreAttention(KeepFP32Module):
    """``core_attention``: the sink (fp32, this rank's heads), compressor and indexer."""

    def __init__(self, c, layer_id: int, n_local_heads: int, params_dtype=torch.float32,
                 std: float | None = 0.02, ops=None):
        super().__init__()
        self.ratio = c.compress_ratios[layer_id]
        self.attn_sink = nn.Parameter(torch.zeros(n_local_heads, dtype=torch.float32))
        mark_keep_in_fp32(self.attn_sink)
        mark_tp(self.attn_sink, 0)
        if self.ratio:
            self.compressor = DSv4Compressor(c.dim, c.head_dim, c.rope_head_dim, self.ratio, False, c.norm_eps,
                                             params_dtype, std, ops)
            if self.ratio == 4:
                self.indexer = DSv4Indexer(c, params_dtype, std, ops)


class DeepSeekV4Attention(nn.Module):
    """``self_attention`` of one block. ``forward(x [B,S,d]) -> [B,S,d]`` (TP-reduced)."""

    # QAT switch (``converters.schemes.QATScheme.install``): None = high precision (default); an int =
    # the FP8 e4m3 1 x block ue8m0 simulation of the KV nope dims (window KV and the main compressor's
    # entries, as the reference forward's ``act_quant``), straight-through gradients.
    qat_kv_block = None

    def _qat_kv(self, kv: torch.Tensor) -> torch.Tensor:
        if self.qat_kv_block is None:
            return kv
        from converters.fake_quant import fake_quant_kv_nope
        return fake_quant_kv_nope(kv, self.rope_dim, self.qat_kv_block)

    def __init__(self, c, tconfig, layer_id: int, ops, params_dtype=torch.float32, std: float | None = 0.02,
                 freeze_indexer: bool = True):
        super().__init__()
        ensure_megatron()
        from megatron.core import tensor_parallel

        tp = parallel_layout().tp
        if c.o_groups % tp:
            raise ValueError(f"tensor parallel {tp} must divide o_groups {c.o_groups}")
        self.ops = ops
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.rope_dim = c.n_heads, c.head_dim, c.rope_head_dim
        self.n_local_heads, self.n_local_groups = c.n_heads // tp, c.o_groups // tp
        self.o_lora_rank, self.window, self.eps = c.o_lora_rank, c.window_size, c.norm_eps
        self.ratio = c.compress_ratios[layer_id]
        self.scale = c.head_dim ** -0.5
        init = lambda w: torch.nn.init.normal_(w, 0.0, std)  # noqa: E731

        self.linear_q_down_proj = Linear(c.dim, c.q_lora_rank, params_dtype, std)
        self.q_layernorm = RMSNorm(c.q_lora_rank, c.norm_eps, params_dtype, ops=ops)
        self.linear_q_up_proj = tensor_parallel.ColumnParallelLinear(
            c.q_lora_rank, c.n_heads * c.head_dim, config=tconfig, init_method=init, bias=False,
            gather_output=False, tp_group=parallel_layout().group("tp"))
        self.linear_kv_proj = Linear(c.dim, c.head_dim, params_dtype, std)
        self.kv_layernorm = RMSNorm(c.head_dim, c.norm_eps, params_dtype, ops=ops)
        group_in = c.n_heads * c.head_dim // c.o_groups
        self.linear_o_group_proj = nn.Parameter(
            init_normal_(torch.empty(self.n_local_groups * c.o_lora_rank, group_in, dtype=params_dtype), std))
        mark_tp(self.linear_o_group_proj, 0)
        self.linear_proj = row_parallel_linear(
            c.o_groups * c.o_lora_rank, c.dim, config=tconfig, init_method=init, bias=False,
            input_is_parallel=True, skip_bias_add=False, tp_group=parallel_layout().group("tp"))
        self.core_attention = DSv4CoreAttention(c, layer_id, self.n_local_heads, params_dtype, std, ops)
        if self.ratio == 4:
            self.core_attention.indexer.ops = ops   # the run's indexer kernels, BSHD and THD alike
        if freeze_indexer and self.ratio == 4:
            for p in self.core_attention.indexer.parameters():
                p.requires_grad_(False)
        # RoPE inverse frequencies (float64, CPU): a plain attribute, not a buffer/parameter.
        self.inv_freq = layer_inv_freq(c, layer_id)

    def forward(self, x: torch.Tensor, thd: ThdContext | None = None) -> torch.Tensor:
        if thd is not None:
            return self._forward_thd(x, thd)
        B, S, _ = x.shape
        H, D = self.n_local_heads, self.head_dim
        inv_freq = attribute_on(self, "inv_freq", x.device)
        cos, sin = rope_cos_sin(inv_freq, torch.arange(S, device=x.device))
        ca = self.core_attention

        cq = self.q_layernorm(self.linear_q_down_proj(x))
        q, _ = self.linear_q_up_proj(cq)
        q = self.ops.rms_normalize(q.view(B, S, H, D), self.eps, x.dtype)
        q = self.ops.apply_rope(q, cos, sin)
        kv = self._qat_kv(self.ops.apply_rope(self.kv_layernorm(self.linear_kv_proj(x)), cos, sin))

        idx = window_indices(S, self.window, x.device).unsqueeze(0).expand(B, -1, -1)
        kv_all = kv
        if self.ratio:
            comp = ca.compressor(x, inv_freq)
            if self.ratio == 4:
                indexer = ca.indexer
                frozen = not any(p.requires_grad for p in indexer.parameters())
                with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
                    cidx = indexer(x.detach() if frozen else x, cq.detach() if frozen else cq, inv_freq)
            else:
                cidx = compressed_visible_indices(S, self.ratio, x.device).unsqueeze(0).expand(B, -1, -1)
            cidx = torch.where(cidx >= 0, cidx + S, cidx)
            idx = torch.cat((idx, cidx), dim=-1)
            kv_all = torch.cat((kv, self._qat_kv(comp.to(kv.dtype))), dim=1)
        return self._attend_and_project(q, kv_all, idx, cos, sin)

    def _attend_and_project(self, q, kv_all, idx, cos, sin):
        """Sparse attention with sink over the selected rows, inverse RoPE on the output, then the
        grouped low-rank output projection (``wo_a`` per group, ``wo_b``). Shared by BSHD and THD."""
        from megatron.core.tensor_parallel import mappings

        if parallel_layout().tp > 1:
            kv_all = mappings.copy_to_tensor_model_parallel_region(kv_all, parallel_layout().group("tp"))
        o = self.ops.sparse_attention_with_sink(q, kv_all, idx, self.core_attention.attn_sink, self.scale)
        o = self.ops.apply_rope(o, cos, sin, inverse=True)
        B, S, H, D = o.shape
        G, R = self.n_local_groups, self.o_lora_rank
        o = o.reshape(B, S, G, H * D // G)
        wo_a = self.linear_o_group_proj.to(o.dtype).view(G, R, H * D // G)
        out, _ = self.linear_proj(grouped_projection(o, wo_a).flatten(2))
        return out

    # ------------------------------------------------------------------ packed / context parallel
    def _indexer_picks(self, x, cq, thd: ThdContext, inv_freq, cos, sin) -> torch.Tensor:
        """Flat compressed ids ``[B, L, k]`` chosen by the indexer within each query's own segment."""
        ind = self.core_attention.indexer
        B, L, _ = x.shape
        frozen = not any(p.requires_grad for p in ind.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            xi, cqi = (x.detach(), cq.detach()) if frozen else (x, cq)
            k_rm = compressed_kv([ind.compressor], xi, thd, 4, inv_freq, self.ops.hadamard_transform)[0]
            k = k_rm.index_select(1, thd.seq_to_rank(4).to(x.device))            # [B, G, c_I] sequence-major
            ct, it = compute_dtype(xi), indexer_input_dtype(self.ops, xi.dtype)
            qi = self.ops.apply_rope(ind.wq_b(cqi).view(B, L, ind.n_heads, ind.head_dim), cos, sin)
            qi = self.ops.hadamard_transform(qi.to(ct)).to(it)
            w = ind.weights_proj(xi).to(ct) * (ind.head_dim * ind.n_heads) ** -0.5
            scores = self.ops.indexer_scores(qi, k.to(it), w)                        # [B, L, G]
            visible = indexer_visible_mask(thd, scores.shape[-1], x.device)
            scores = scores.masked_fill(~visible[None], float("-inf"))
            return replayed_segment_picks(ind, indexer_topk(scores, thd, ind.topk), thd.layout)  # indexer replay

    def _forward_thd(self, x: torch.Tensor, thd: ThdContext) -> torch.Tensor:
        B, L, _ = x.shape
        if L != thd.local_len:
            raise ValueError(f"attention input has {L} rows but the packed layout gives this rank {thd.local_len}")
        H, D = self.n_local_heads, self.head_dim
        inv_freq = attribute_on(self, "inv_freq", x.device)
        cos, sin = rope_cos_sin(inv_freq, thd.positions().to(x.device))   # positions restart per segment
        ca = self.core_attention

        cq = self.q_layernorm(self.linear_q_down_proj(x))
        q, _ = self.linear_q_up_proj(cq)
        q = self.ops.rms_normalize(q.view(B, L, H, D), self.eps, x.dtype)
        q = self.ops.apply_rope(q, cos, sin)
        kv = self._qat_kv(self.ops.apply_rope(self.kv_layernorm(self.linear_kv_proj(x)), cos, sin))

        T = thd.total_tokens
        kv_all = all_gather_cp(kv, thd, dim=1)                               # [B, T, D] whole stream
        idx = thd.window_indices(self.window).to(x.device).unsqueeze(0).expand(B, -1, -1)
        if self.ratio:
            comp = compressed_kv([ca.compressor], x, thd, self.ratio, inv_freq, self.ops.hadamard_transform)[0]
            if self.ratio == 4:
                cidx = picks_to_rows(self._indexer_picks(x, cq, thd, inv_freq, cos, sin), thd, 4, T)
            else:
                cidx = hca_indices(thd, self.ratio, T).to(x.device).unsqueeze(0).expand(B, -1, -1)
            idx = torch.cat((idx, cidx), dim=-1)
            kv_all = torch.cat((kv_all, self._qat_kv(comp.to(kv.dtype))), dim=1)
        return self._attend_and_project(q, kv_all, idx, cos, sin)
