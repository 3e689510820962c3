"""DeepSeek-V4 attention of the native design (``dsv4_hybrid``), THD only, tensor parallel 1.

Module tree and parameter names (= the weight contract's native names)::

    self_attention.linear_q_down_proj.weight    [q_lora, C]
    self_attention.q_layernorm.weight           [q_lora]
    self_attention.linear_q_up_proj.weight      [H*D, q_lora]
    self_attention.linear_kv_proj.weight        [D, C]
    self_attention.kv_layernorm.weight          [D]
    self_attention.linear_o_group_proj          [G*R, H*D/G]   (bare Parameter, grouped_projection)
    self_attention.linear_proj.weight           [C, G*R]
    self_attention.core_attention.attn_sink     [H] fp32
    self_attention.core_attention.compressor.{linear_wkv.weight, linear_wgate.weight, ape, norm.weight}
    self_attention.core_attention.indexer.{linear_wq_b.weight, linear_weights_proj.weight, compressor.*}

Inputs are one packed stream ``[T, 1, C]`` (sequence first) with its :class:`core.thd.ThdLayout`;
RoPE positions restart at every segment, windows and compressed groups never cross a segment
boundary (``core.thd`` builders). The math is the reference model's (``kernels.reference``), with the
sparse attention / indexer scores / Hadamard ops taken from the selected kernel backend.

Indexer training (CSA layers): the indexer sees ``x`` and ``cq`` **detached**, so neither the LM loss
nor the indexer loss reaches the trunk through it (top-k is discrete: the LM loss gives the indexer no
gradient either). With ``dsa_indexer_loss_coeff`` set (``None`` = off) and the module in training
mode, each CSA layer adds ``coeff * KL(p || softmax(I))`` where the teacher ``p`` is the main
attention's head-summed, L1-normalised probability of every visible compressed entry, computed
from the detached query and keys with the window logits and the sink in the softmax normaliser.

Context parallelism (``layout`` an :class:`engine.thd_attention.ThdContext` with ``cp > 1``): the
rank holds a contiguous slice of the stream; token KV is all-gathered, the compressors run on
compacted slots (left-boundary rows from the previous rank) and are all-gathered rank-major
(``engine.thd_attention``). The indexer KL loss is not built under CP (raises).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from torch import nn

from core.thd import ThdLayout
from engine.layers import KeepFP32Module, RMSNorm, attribute_on, row_parallel_linear
from engine.thd_attention import (
    ThdContext,
    all_gather_cp,
    compressed_kv,
    hca_indices,
    indexer_topk,
    picks_to_rows,
    replayed_segment_picks,
    segment_topk,
)
from engine.tp import mark_keep_in_fp32

from .config import indexer_loss_enabled
from kernels.reference.indexer import indexer_input_dtype
from kernels.reference.layers import compute_dtype, grouped_projection, linear_fp32
from kernels.reference.rope import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = [
    "Compressor", "Indexer", "CompressedSparseAttention", "DSv4HybridAttention",
    "layer_inv_freq", "indexer_teacher_probs", "indexer_kl_loss",
]


# ---------------------------------------------------------------------------- small pieces
def _column(config, n_in: int, n_out: int) -> tensor_parallel.ColumnParallelLinear:
    return tensor_parallel.ColumnParallelLinear(n_in, n_out, config=config, init_method=config.init_method,
                                                bias=False, gather_output=False, skip_bias_add=True)


def _row(config, n_in: int, n_out: int) -> tensor_parallel.RowParallelLinear:
    return row_parallel_linear(n_in, n_out, config=config, init_method=config.output_layer_init_method,
                                             bias=False, input_is_parallel=True, skip_bias_add=True)


def _call(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """megatron-core linears return ``(out, bias)``; bias is None here."""
    return linear(x)[0]


def _f32_linear(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``x W^T`` computed in fp32 (fp64 for fp64 inputs): the compressor GEMMs (bf16 in, fp32 out)."""
    return linear_fp32(x, linear.weight)


def layer_inv_freq(config, layer_id: int) -> torch.Tensor:
    """Window-only layers: ``rotary_base`` without YaRN; compressed layers: ``csa_compress_rotary_base``
    with YaRN (``rotary_scaling_factor``, ``original_max_position_embeddings``, ``beta_fast/slow``).
    No mscale anywhere (the reference inference math)."""
    rd = config.qk_pos_emb_head_dim
    if config.compress_ratio(layer_id) == 0:
        return rope_inv_freq(rd, config.rotary_base)
    return rope_inv_freq(rd, config.csa_compress_rotary_base, config.rotary_scaling_factor,
                         config.original_max_position_embeddings, config.beta_fast, config.beta_slow)


# ---------------------------------------------------------------------------- compressor
def _groups_tile_stream(layout: ThdLayout, ratio: int) -> bool:
    """Whether group ``g`` covers stream rows ``[g*ratio, (g+1)*ratio)``: every segment but the last is a whole
    number of groups (tails are dropped, so only the last segment may have one). Decided on the host from the
    layout's kept host ``cu_seqlens`` (no device read once the layout has it)."""
    cu = layout.host_cu_seqlens()
    return layout.global_start == 0 and all((b - a) % ratio == 0 for a, b in zip(cu[:-2], cu[1:-1]))


def _group_slots(t: torch.Tensor, groups, layout: ThdLayout) -> torch.Tensor:
    """Rows ``t [T, n]`` -> the groups' slots ``[G, m, n]``: a view of the first ``G*m`` rows when the groups tile
    the stream (:func:`_groups_tile_stream`), else a gather of the groups' rows (``gather_index``)."""
    G, m = groups.num_groups, groups.ratio
    if _groups_tile_stream(layout, m):
        return t[:G * m].reshape(G, m, t.shape[-1])
    return t[groups.gather_index()]


def _previous_group(t: torch.Tensor) -> torch.Tensor:
    """``[G, m, n]`` -> row ``g`` holds row ``g - 1`` (row 0: zeros; callers mask the segments' first groups)."""
    return torch.cat((t.new_zeros((1,) + tuple(t.shape[1:])), t[:-1]), dim=0)


class Compressor(KeepFP32Module, MegatronModule):
    """THD compressor: ``linear_wkv``, ``linear_wgate`` ``[coff*c, C]``, ``ape [m, coff*c]`` (fp32),
    ``norm [c]`` (fp32); ``coff = 2`` for the overlapping ratio-4 compressor.

    Groups are formed within each segment (``core.thd.compressed_groups``; tails dropped). Entry ``g``
    pools its ``m`` tokens (ratio 4: also the previous group of the same segment on the first ``c``
    channels) with a per-channel softmax over the slots, then RMSNorm, RoPE at the group's first
    position, and (``rotate``, the indexer's copy) the Hadamard rotation."""

    def __init__(self, config, head_dim: int, ratio: int, rotate: bool, ops):
        super().__init__(config=config)
        self.head_dim, self.ratio, self.rotate, self.ops = head_dim, ratio, rotate, ops
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.linear_wkv = _column(config, config.hidden_size, coff * head_dim)
        self.linear_wgate = _column(config, config.hidden_size, coff * head_dim)
        self.ape = mark_keep_in_fp32(nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32)))
        self.norm = RMSNorm(head_dim, config.layernorm_epsilon, keep_fp32=True, ops=ops)   # fp32 weight: served

    def forward(self, x: torch.Tensor, layout: ThdLayout, inv_freq: torch.Tensor) -> torch.Tensor:
        """``x [T, C]`` -> compressed entries ``[G, c]`` (segment-major flat list; dtype of x).

        No host synchronisation and no gather where a view does (same values, same gradients):

        * the fill values of the first groups' missing previous group are Python scalars: a 0-dim CPU tensor
          there (``torch.zeros(())``) made ``torch.where`` copy it to the device, a blocking host-to-device copy
          (4 host syncs per CSA layer and micro-batch on a GPU);
        * when the groups tile the stream's first ``G*m`` rows (every segment but the last a multiple of ``m``,
          e.g. ``pack_rows`` of ``[B, S]`` rows with ``m | S``) the slots are a view of the projections, not a
          gather (whose backward is an accumulating ``index_put_``);
        * the previous group of entry ``g`` is ``g - 1`` (``core.thd``: ``prev_group``): a shift by one group
          of the ``c`` channels it feeds, not a gather of all ``coff*c`` channels.
        """
        m, c = self.ratio, self.head_dim
        groups = layout.compressed_groups(m)
        if groups.num_groups == 0:
            return x.new_zeros(0, c)
        a = _group_slots(_f32_linear(x, self.linear_wkv), groups, layout)     # [G, m, coff*c]
        z = _group_slots(_f32_linear(x, self.linear_wgate), groups, layout) + self.ape.to(a.dtype)
        if self.overlap:
            has_prev = (groups.prev_group >= 0)[:, None, None]
            prev_a = torch.where(has_prev, _previous_group(a[..., :c]), 0.0)
            prev_z = torch.where(has_prev, _previous_group(z[..., :c]), float("-inf"))
            a = torch.cat((prev_a, a[..., c:]), dim=1)               # [G, 2m, c]
            z = torch.cat((prev_z, z[..., c:]), dim=1)
        comp = (torch.softmax(z, dim=1) * a).sum(dim=1)
        comp = self.norm(comp.to(x.dtype))
        cos, sin = rope_cos_sin(inv_freq.to(x.device), groups.rope_positions.to(x.device))
        comp = apply_rope(comp.unsqueeze(0), cos, sin).squeeze(0)
        if self.rotate:
            comp = self.ops.hadamard_transform(comp)
        return comp


# ---------------------------------------------------------------------------- indexer
class Indexer(MegatronModule):
    """Lightning indexer (CSA layers): ``linear_wq_b [H_I*c_I, q_lora]``, ``linear_weights_proj [H_I, C]``,
    ``compressor`` (ratio 4, rotated). ``I[t, j] = sum_h w[t,h] relu(q[t,h] . k[j])`` over the flat
    compressed list, ``-inf`` outside the query's visible range ``[ks, ke)``."""

    def __init__(self, config, ops):
        super().__init__(config=config)
        self.ops = ops
        self.n_heads, self.head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.topk = config.dsa_indexer_topk
        self.linear_wq_b = _column(config, config.q_lora_rank, self.n_heads * self.head_dim)
        self.linear_weights_proj = _column(config, config.hidden_size, self.n_heads)
        self.compressor = Compressor(config, self.head_dim, 4, rotate=True, ops=ops)

    def forward(self, x: torch.Tensor, cq: torch.Tensor, layout: ThdLayout, inv_freq: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, with_grad: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(scores [T, G] fp32, top-k ids [T, k])`` of :meth:`scores` and :meth:`topk_indices`; the scores build an
        autograd graph only with ``with_grad`` (the indexer KL loss: its parameters learn from that alone).

        The attention calls the indexer as a module (this forward), not through its methods, so that module
        hooks see it: the trainer's profiler ranges (``reporting.profiling``) then charge its work to the budget's
        ``indexer`` / ``indexer top-k`` rows, as for miles' indexer, not to ``attention other``."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and with_grad):
            scores = self.scores(x, cq, layout, inv_freq, cos, sin)
        return scores, self.topk_indices(scores, layout)

    def scores(self, x: torch.Tensor, cq: torch.Tensor, layout: ThdLayout, inv_freq: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, C]``, ``cq [T, q_lora]`` (callers pass them detached) -> fp32 ``[T, G]``."""
        k = self.compressor(x, layout, inv_freq)                     # [G, c_I]
        return self.scores_with_keys(x, cq, k, layout, cos, sin)

    def scores_with_keys(self, x: torch.Tensor, cq: torch.Tensor, k: torch.Tensor, layout: ThdLayout,
                         cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Scores of this rank's queries ``x [T, C]`` against the flat (sequence-major) keys ``k [G, c_I]``."""
        T = x.shape[0]
        ct, it = compute_dtype(x), indexer_input_dtype(self.ops, x.dtype)
        q = _call(self.linear_wq_b, cq).view(1, T, self.n_heads, self.head_dim)
        q = self.ops.hadamard_transform(self.ops.apply_rope(q, cos, sin).to(ct)).to(it)
        w = _call(self.linear_weights_proj, x).to(ct) * (self.head_dim * self.n_heads) ** -0.5
        s = self.ops.indexer_scores(q, k.to(it).unsqueeze(0), w.unsqueeze(0)).squeeze(0)  # [T, G]
        ks, ke = layout.indexer_ranges(4)
        j = torch.arange(s.shape[1], device=s.device)[None, :]
        visible = (j >= ks[:, None]) & (j < ke[:, None])
        return s.masked_fill(~visible, float("-inf"))

    def topk_indices(self, scores: torch.Tensor, layout: ThdLayout) -> torch.Tensor:
        """``[T, min(topk, max_seqlen // 4)]`` flat compressed ids (ascending per row), ``-1`` where fewer
        are visible: the stable top-k per segment (``engine.thd_attention.segment_topk``), the picks of
        the sample run alone and of the reference model; replaced by the recorded ones under indexer replay."""
        return replayed_segment_picks(self, segment_topk(scores.unsqueeze(0), layout, self.topk), layout)[0]


# ---------------------------------------------------------------------------- indexer loss (pure)
def indexer_teacher_probs(q: torch.Tensor, kv_all: torch.Tensor, window_idx: torch.Tensor,
                          comp_idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Teacher distribution over each query's visible compressed entries.

    ``q [T,H,D]``, ``kv_all [N,D]`` (window rows then compressed rows), ``window_idx [T,W]`` and
    ``comp_idx [T,Gw]`` rows of ``kv_all`` (``-1`` = none), ``sink [H]``. Per head, one softmax over
    {window keys, ALL visible compressed keys, sink}; the compressed columns' probabilities are summed
    over heads and L1-normalised -> ``[T, Gw]`` (zero rows where no compressed entry is visible).
    Callers pass detached tensors; computed in fp32 (fp64 for fp64 inputs)."""
    ct = compute_dtype(q, kv_all)
    idx = torch.cat((window_idx, comp_idx), dim=1)
    valid = idx >= 0
    keys = kv_all.to(ct)[idx.clamp(min=0)]                                   # [T, K, D]
    z = torch.einsum("thd,tkd->thk", q.to(ct), keys) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    s = sink.to(ct).view(1, -1, 1).expand(z.shape[0], -1, 1)
    p = torch.softmax(torch.cat((z, s), dim=-1), dim=-1)[..., window_idx.shape[1]:-1]  # [T, H, Gw]
    p = p.sum(dim=1)
    return p / p.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(ct).tiny)


def indexer_kl_loss(teacher: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean_t KL(p_t || softmax(I_t))`` over the ``mask``-ed columns, averaged over rows with at least one
    masked-in column (0 when there is none). ``teacher [T,K]`` (rows sum to 1 over ``mask``),
    ``student_logits [T,K]``, ``mask [T,K]`` bool.

    Written without host reads or data-dependent shapes (rows with nothing masked in contribute 0 instead
    of being dropped), so a compiled step traces it in one graph: a graph break here made dynamo recompile
    the rest of the layer at every step, and CUDA graphs re-record."""
    rows = mask.any(dim=-1, keepdim=True)                                   # [T, 1]
    logits = student_logits.masked_fill(~mask, float("-inf"))
    logits = torch.where(rows, logits, torch.zeros_like(logits))            # no all -inf row: no NaN
    p = teacher.to(logits.dtype) * mask
    log_q = torch.log_softmax(logits, dim=-1).masked_fill(~mask, 0.0)
    kl = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)                        # 0 on rows without entries
    return kl.sum() / rows.sum().clamp(min=1)


def _qat_kv(module, kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """QAT (``converters.schemes.QATScheme.install`` sets ``module.qat_kv_block``): the FP8 e4m3 1 x block
    ue8m0 simulation of the KV nope dims (the reference ``act_quant``), straight-through gradients;
    identity when the switch is off (the default)."""
    if module.qat_kv_block is None:
        return kv
    from converters.fake_quant import fake_quant_kv_nope
    return fake_quant_kv_nope(kv, rope_dim, module.qat_kv_block)


# ---------------------------------------------------------------------------- core attention
class CompressedSparseAttention(KeepFP32Module, MegatronModule):
    """``core_attention``: ``attn_sink [H]`` (fp32), ``compressor`` (CSA/HCA layers), ``indexer`` (CSA)."""

    qat_kv_block = None     # QAT switch for the main compressor's entries (see _qat_kv)

    def __init__(self, config, layer_id: int, ops):
        super().__init__(config=config)
        self.ops = ops
        self.ratio = config.compress_ratio(layer_id)
        self.window = config.csa_window_size
        self.scale = config.v_head_dim ** -0.5
        self.attn_sink = mark_keep_in_fp32(nn.Parameter(torch.zeros(config.num_attention_heads, dtype=torch.float32)))
        if self.ratio:
            self.compressor = Compressor(config, config.v_head_dim, self.ratio, rotate=False, ops=ops)
            if self.ratio == 4:
                self.indexer = Indexer(config, ops)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, cq: torch.Tensor, layout: ThdLayout,
                inv_freq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``q [T,H,D]``, ``kv [T,D]``, ``x [T,C]``, ``cq [T,q_lora]`` -> ``(o [T,H,D], indexer KL or None)``."""
        T = q.shape[0]
        want_kl = self._wants_indexer_loss()
        idx = layout.window_indices(self.window)                                # [T, W] stream rows
        kv_all = kv
        kl = None
        if self.ratio:
            comp = self.compressor(x, layout, inv_freq)                          # [G, D]
            comp = _qat_kv(self, comp.to(kv.dtype), self.config.qk_pos_emb_head_dim)
            kv_all = torch.cat((kv, comp), dim=0)
            if self.ratio == 4:
                # the indexer sees detached inputs (no gradient to the trunk); its own parameters get gradients
                # only from the KL loss, so without it the scores build no autograd graph (none to keep alive)
                scores, top = self.indexer(x.detach(), cq.detach(), layout, inv_freq, cos, sin, with_grad=want_kl)
                cidx = torch.where(top >= 0, top + T, top)
                if want_kl:
                    kl = self._indexer_loss(q, kv_all, idx, scores, top, layout)
            else:
                cidx = layout.compressed_visible_indices(self.ratio, offset=T)
            idx = torch.cat((idx, cidx), dim=1)
        o = self.ops.sparse_attention_with_sink(q.unsqueeze(0), kv_all.unsqueeze(0), idx.unsqueeze(0),
                                                self.attn_sink, self.scale).squeeze(0)
        return o, kl

    def forward_cp(self, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, cq: torch.Tensor, ctx: ThdContext,
                   inv_freq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Context-parallel forward: ``q [L,H,D]``, ``kv [L,D]``, ``x [L,C]``, ``cq [L,q_lora]`` of this rank."""
        want_kl = self._wants_indexer_loss()
        kl = None
        T = ctx.total_tokens
        idx = ctx.window_indices(self.window).to(q.device)                     # [L, W] stream rows
        kv_all = all_gather_cp(kv, ctx, dim=0)                                 # [T, D]
        if self.ratio:
            hadamard = self.ops.hadamard_transform
            comp = compressed_kv([self.compressor], x.unsqueeze(0), ctx, self.ratio, inv_freq, hadamard)[0][0]
            comp = _qat_kv(self, comp.to(kv.dtype), self.config.qk_pos_emb_head_dim)
            kv_all = torch.cat((kv_all, comp), dim=0)
            if self.ratio == 4:
                # the indexer sees detached inputs; its own parameters get gradients only from the KL loss
                with torch.set_grad_enabled(torch.is_grad_enabled() and want_kl):
                    xd, cqd = x.detach(), cq.detach()
                    k = compressed_kv([self.indexer.compressor], xd.unsqueeze(0), ctx, 4, inv_freq, hadamard)[0][0]
                    k = k.index_select(0, ctx.seq_to_rank(4).to(k.device))  # sequence-major [G, c_I]
                    scores = self.indexer.scores_with_keys(xd, cqd, k, ctx.layout, cos, sin)
                picks = indexer_topk(scores.detach().unsqueeze(0), ctx, self.indexer.topk)[0]
                cidx = picks_to_rows(picks, ctx, 4, T)
                if want_kl:
                    kl = self._indexer_loss_cp(q, kv_all, idx, scores, picks, ctx)
            else:
                cidx = hca_indices(ctx, self.ratio, T).to(q.device)
            idx = torch.cat((idx, cidx), dim=1)
        o = self.ops.sparse_attention_with_sink(q.unsqueeze(0), kv_all.unsqueeze(0), idx.unsqueeze(0),
                                                self.attn_sink, self.scale).squeeze(0)
        return o, kl

    def _wants_indexer_loss(self) -> bool:
        """Whether this forward computes the indexer KL loss: a CSA layer, training, coefficient set. Only then
        do the indexer's scores build an autograd graph (its parameters learn from that loss alone)."""
        return self.ratio == 4 and self.training and indexer_loss_enabled(self.config)

    def _kl_mask(self, top: torch.Tensor, layout: ThdLayout):
        """``(flat [T, Gw] sequence-major visible ids, mask [T, Gw])``: every visible compressed entry, or only
        the top-k picks with ``dsa_indexer_use_sparse_loss``."""
        flat = layout.compressed_visible_indices(4)                             # [T, Gw] flat ids
        mask = flat >= 0
        if getattr(self.config, "dsa_indexer_use_sparse_loss", False) and top.shape[1]:
            ks, _ = layout.indexer_ranges(4)
            col = (top - ks[:, None]).clamp(min=0)
            picked = torch.zeros_like(mask).scatter_(1, col, top >= 0)
            mask = mask & picked
        return flat, mask

    def _indexer_loss_cp(self, q, kv_all, window_idx, scores, picks, ctx: ThdContext) -> torch.Tensor:
        """This CP rank's share of the stream's indexer KL loss: the sum over its query rows divided by the
        stream's number of rows that see a compressed entry (so the shares add up to the cp-1 mean)."""
        lay = ctx.layout
        flat, mask = self._kl_mask(picks, lay)
        comp_rows = torch.where(mask, picks_to_rows(flat, ctx, 4, ctx.total_tokens), torch.full_like(flat, -1))
        with torch.no_grad():
            p = indexer_teacher_probs(q.detach(), kv_all.detach(), window_idx, comp_rows,
                                      self.attn_sink.detach(), self.scale)
        student = scores.gather(1, flat.clamp(min=0))
        local_rows = mask.any(dim=-1).sum()                                  # a tensor: no host read
        cu = lay.host_cu_seqlens()
        seen = sum(max(0, b - a - 3) for a, b in zip(cu[:-1], cu[1:]))    # rows at position >= 3
        return indexer_kl_loss(p, student, mask) * (local_rows / max(seen, 1))

    def _indexer_loss(self, q, kv_all, window_idx, scores, top, layout) -> torch.Tensor:
        """``KL(p || softmax(I))`` over all visible compressed entries (dense), or over the top-k picks
        with ``dsa_indexer_use_sparse_loss``. Teacher from detached q / K; not yet scaled by the coeff."""
        T = q.shape[0]
        flat, mask = self._kl_mask(top, layout)
        comp_rows = torch.where(mask, flat + T, torch.full_like(flat, -1))
        with torch.no_grad():
            p = indexer_teacher_probs(q.detach(), kv_all.detach(), window_idx, comp_rows,
                                      self.attn_sink.detach(), self.scale)
        student = scores.gather(1, flat.clamp(min=0))
        return indexer_kl_loss(p, student, mask)


# ---------------------------------------------------------------------------- attention
class DSv4HybridAttention(MegatronModule):
    """``self_attention`` of one layer; ``layer_id`` (0-based; MTP layers ``num_layers + k``) selects the kind."""

    qat_kv_block = None     # QAT switch for the window KV (see _qat_kv)

    def __init__(self, config, layer_id: int, ops):
        super().__init__(config=config)
        c = config
        if c.tensor_model_parallel_size != 1:
            raise ValueError("the megatron implementation requires tensor-model-parallel-size 1")
        self.layer_id, self.ops = layer_id, ops
        self.n_heads, self.head_dim = c.num_attention_heads, c.v_head_dim
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        H, D, G, R = self.n_heads, self.head_dim, self.o_groups, self.o_lora_rank
        pdt = c.params_dtype
        self.linear_q_down_proj = _column(c, c.hidden_size, c.q_lora_rank)
        self.q_layernorm = RMSNorm(c.q_lora_rank, c.layernorm_epsilon, dtype=pdt, ops=ops)
        self.linear_q_up_proj = _column(c, c.q_lora_rank, H * D)
        self.linear_kv_proj = _column(c, c.hidden_size, D)
        self.kv_layernorm = RMSNorm(D, c.layernorm_epsilon, dtype=pdt, ops=ops)
        self.linear_o_group_proj = nn.Parameter(torch.empty(G * R, H * D // G, dtype=pdt))
        if c.perform_initialization:   # off: a checkpoint fills it (build_model(initialize=False))
            with torch.no_grad():
                c.init_method(self.linear_o_group_proj)
        self.linear_proj = _row(c, G * R, c.hidden_size)
        self.core_attention = CompressedSparseAttention(c, layer_id, ops)
        # float64 CPU tensor; a plain attribute (not a buffer) so it is never part of the state dict
        self.inv_freq = layer_inv_freq(c, layer_id)

    def forward(self, hidden_states: torch.Tensor, layout
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``hidden_states [T, 1, C]`` (normed) -> ``(out [T, 1, C], indexer KL or None)``. ``layout``: a
        ``ThdLayout``, or a ``ThdContext`` (context parallel: this rank's rows of the stream)."""
        ctx = layout if isinstance(layout, ThdContext) else None
        if ctx is not None:
            layout = ctx.layout
        T, B, _ = hidden_states.shape
        if B != 1:
            raise ValueError(f"THD input must be one packed stream [T, 1, C], got batch {B}")
        x = hidden_states[:, 0]
        H, D = self.n_heads, self.head_dim
        inv_freq = attribute_on(self, "inv_freq", x.device)
        cos, sin = rope_cos_sin(inv_freq, layout.positions.to(x.device))

        cq = self.q_layernorm(_call(self.linear_q_down_proj, x))
        q = _call(self.linear_q_up_proj, cq).view(1, T, H, D)
        q = self.ops.rms_normalize(q, self.config.layernorm_epsilon, x.dtype)
        q = self.ops.apply_rope(q, cos, sin).squeeze(0)
        kv = self.ops.apply_rope(self.kv_layernorm(_call(self.linear_kv_proj, x)).unsqueeze(0), cos, sin)
        kv = kv.squeeze(0)
        kv = _qat_kv(self, kv, self.config.qk_pos_emb_head_dim)

        if ctx is not None and ctx.cp > 1:
            o, kl = self.core_attention.forward_cp(q, kv, x, cq, ctx, inv_freq, cos, sin)
        else:
            o, kl = self.core_attention(q, kv, x, cq, layout, inv_freq, cos, sin)
        o = self.ops.apply_rope(o.unsqueeze(0), cos, sin, inverse=True).squeeze(0)    # undo V = K's rotation

        G, R = self.o_groups, self.o_lora_rank
        o = o.reshape(T, G, H * D // G)
        u = grouped_projection(o, self.linear_o_group_proj.to(o.dtype).view(G, R, H * D // G))
        out = _call(self.linear_proj, u.reshape(T, G * R))
        return out.unsqueeze(1), kl
