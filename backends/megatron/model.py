"""The Megatron-native DeepSeek-V4 model (``dsv4_hybrid`` design): THD, tensor parallel 1.

Module tree (names = ``core.weight_contract`` native names)::

    embedding.word_embeddings.weight                     megatron LanguageModelEmbedding
    decoder.layers.N.self_attention_hyper_connection.*   HyperConnectionModule (mapping_proj, bias, alpha_*)
    decoder.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.*                    DSv4HybridAttention (attention.py)
    decoder.layers.N.mlp_hyper_connection.*
    decoder.layers.N.pre_mlp_layernorm.weight
    decoder.layers.N.mlp.*                               engine.moe.DSv4MoE (shared with `miles`)
    decoder.final_layernorm.weight, decoder.hc_head_{fn,base,scale}
    output_layer.weight                                  megatron ColumnParallelLinear
    mtp.layers.K.{enorm,hnorm,e_proj,h_proj,final_layernorm,hc_head_*}, mtp.layers.K.mtp_model_layer.*

Forward (one packed stream ``input_ids [T]`` with ``cu_seqlens``)::

    X = [embedding(ids)] * n                               streams [T, 1, n, C]
    per layer: X = hc_post(attn(input_layernorm(hc_pre(X)))); X = hc_post(mlp(pre_mlp_layernorm(hc_pre(X))))
    logits = output_layer(final_layernorm(hc_head(X)))     fp32 [T, V]

The indexer KL losses of the CSA layers (training mode, ``dsa_indexer_loss_coeff`` not None) are
summed, scaled by the coefficient, and returned as ``indexer_loss`` (also kept in
``model.last_indexer_loss``); with the coefficient ``None`` nothing is computed and it is ``None``.
Under context parallelism each rank returns its rows' share (the shares add up to the cp-1 loss).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from torch import nn

from core.thd import ThdLayout
from engine.thd_attention import ThdContext, cp_group_info, gather_sequence_cp
from engine.layers import KeepFP32Module, RMSNorm
from kernels.reference.layers import linear_fp32
from engine.moe import DSv4MoE
from engine.pipeline import active_layers

from .attention import DSv4HybridAttention
from .config import indexer_loss_enabled
from .mhc import HyperConnectionModule, apply_head, register_head_params

__all__ = ["DSv4TransformerLayer", "DSv4TransformerBlock", "DSv4MTPLayer", "DSv4NativeModel"]


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if a is None:
        return b
    return a if b is None else a + b


class DSv4TransformerLayer(MegatronModule):
    """One block (trunk layer ``layer_id`` or MTP layer ``num_layers + k``)."""

    def __init__(self, config, layer_id: int, ops):
        super().__init__(config=config)
        c = config
        self.layer_id = layer_id
        self.self_attention_hyper_connection = HyperConnectionModule(c, ops)
        self.input_layernorm = RMSNorm(c.hidden_size, c.layernorm_epsilon, dtype=c.params_dtype, ops=ops)
        self.self_attention = DSv4HybridAttention(c, layer_id, ops)
        self.mlp_hyper_connection = HyperConnectionModule(c, ops)
        self.pre_mlp_layernorm = RMSNorm(c.hidden_size, c.layernorm_epsilon, dtype=c.params_dtype, ops=ops)
        self.mlp = DSv4MoE(c.dsv4_model_config, c, layer_id, params_dtype=c.params_dtype,
                           std=c.init_method_std if c.perform_initialization else None, ops=ops)

    def forward(self, streams: torch.Tensor, layout: ThdLayout, input_ids: torch.Tensor):
        """``streams [T, 1, n, C]`` -> ``(streams, indexer KL or None)``."""
        hc = self.self_attention_hyper_connection
        u, post, comb = hc.pre(streams)
        out, kl = self.self_attention(self.input_layernorm(u), layout)
        streams = hc.post(out, streams, post, comb)
        hc = self.mlp_hyper_connection
        u, post, comb = hc.pre(streams)
        out = self.mlp(self.pre_mlp_layernorm(u), input_ids.view(-1, 1))
        return hc.post(out, streams, post, comb), kl


class DSv4TransformerBlock(KeepFP32Module, MegatronModule):
    """``decoder``: the trunk layers, ``final_layernorm`` and the mHC exit head (``hc_head_*``)."""

    def __init__(self, config, ops):
        super().__init__(config=config)
        self.ops = ops
        self.layers = nn.ModuleList(DSv4TransformerLayer(config, i, ops) for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype=config.params_dtype,
                                       ops=ops)
        register_head_params(self, config)

    def forward(self, streams: torch.Tensor, layout: ThdLayout, input_ids: torch.Tensor):
        """-> ``(final streams [T,1,n,C], summed unscaled indexer KL or None)``. Pipeline parallel: only the layers
        this stage holds run (another stage's are ``engine.pipeline.OtherStage`` placeholders; with ``--vpp``, those of
        the model chunk that runs now: ``engine.pipeline.active_layers``)."""
        kl = None
        for layer in active_layers(self.layers):
            streams, k = layer(streams, layout, input_ids)
            kl = _add(kl, k)
        return streams, kl

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(apply_head(self, streams, self.config, self.ops))


class DSv4MTPLayer(KeepFP32Module, MegatronModule):
    """``mtp.layers.K``: ``enorm``, ``hnorm``, ``e_proj [C, C]`` and ``h_proj [C, C]`` (separate, as upstream
    builds them with hyper-connections on), a window-only ``mtp_model_layer``, ``final_layernorm`` and its
    own ``hc_head_*``."""

    def __init__(self, config, k: int, ops):
        super().__init__(config=config)
        c = config
        self.ops = ops
        self.enorm = RMSNorm(c.hidden_size, c.layernorm_epsilon, dtype=c.params_dtype, ops=ops)
        self.hnorm = RMSNorm(c.hidden_size, c.layernorm_epsilon, dtype=c.params_dtype, ops=ops)
        self.e_proj = tensor_parallel.ColumnParallelLinear(
            c.hidden_size, c.hidden_size, config=c, init_method=c.init_method, bias=False,
            gather_output=True, skip_bias_add=True)
        self.h_proj = tensor_parallel.ColumnParallelLinear(
            c.hidden_size, c.hidden_size, config=c, init_method=c.init_method, bias=False,
            gather_output=True, skip_bias_add=True)
        self.mtp_model_layer = DSv4TransformerLayer(c, c.num_layers + k, ops)
        self.final_layernorm = RMSNorm(c.hidden_size, c.layernorm_epsilon, dtype=c.params_dtype, ops=ops)
        register_head_params(self, c)

    def forward(self, streams: torch.Tensor, emb: torch.Tensor, layout: ThdLayout, input_ids: torch.Tensor):
        """``streams [T,1,n,C]`` previous depth, ``emb [T,1,C]`` embedding of the next tokens."""
        e = self.e_proj(self.enorm(emb))[0].unsqueeze(2)                       # [T, 1, 1, C]
        h = self.hnorm(streams)                                                # [T, 1, n, C]
        # megatron's linear backward takes at most [s, b, h] inputs: run it on [T, n, C]
        x = e + self.h_proj(h.flatten(1, 2))[0].view(*h.shape[:-1], -1)
        x, _ = self.mtp_model_layer(x, layout, input_ids)
        return x

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        return self.final_layernorm(apply_head(self, streams, self.config, self.ops))


class _MTPBlock(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        self.layers = nn.ModuleList(DSv4MTPLayer(config, k, ops) for k in range(config.mtp_num_layers or 0))


class DSv4NativeModel(MegatronModule):
    """DeepSeek-V4 causal LM, Megatron-native design. ``DSv4NativeModel(config, ops)``: ``ops`` is the
    kernel backend's op namespace."""

    def __init__(self, config, ops):
        super().__init__(config=config)
        if config.tensor_model_parallel_size != 1:
            raise ValueError("the megatron implementation requires tensor-model-parallel-size 1")
        self.ops = ops
        c = config
        self.embedding = LanguageModelEmbedding(c, vocab_size=c.vocab_size, max_sequence_length=c.max_sequence_length,
                                                position_embedding_type="none")
        self.decoder = DSv4TransformerBlock(c, self.ops)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            c.hidden_size, c.vocab_size, config=c, init_method=c.init_method, bias=False, gather_output=True,
            skip_bias_add=True)
        if c.mtp_num_layers:
            self.mtp = _MTPBlock(c, self.ops)
        self.last_indexer_loss: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ helpers
    def cuda_graphs_refusal(self) -> Optional[str]:
        """Why this model's blocks must not be recorded as CUDA graphs (``engine.compile``), or None.

        With the indexer KL loss on, the indexer compressor's tensors saved for the backward live for a
        different span in replay than in recording, so CUDA-graph trees record the step again at every step
        (measured on an H200: 0.76-1.14 s per step against 52 ms with the loss off)."""
        if indexer_loss_enabled(self.config):
            return ("the megatron model trains its indexer with the KL loss (dsa_indexer_loss_coeff="
                    f"{self.config.dsa_indexer_loss_coeff}), and CUDA-graph trees record such a step again "
                    "at every step; compile without CUDA graphs (compile_blocks(model, cuda_graphs=False)) "
                    "or turn the indexer loss off (dsa_indexer_loss_coeff=None)")
        return None

    @staticmethod
    def layout_for(input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor]):
        """``ThdLayout`` of the stream, or (context parallel, megatron's CP group > 1) a ``ThdContext``
        for this rank's contiguous slice ``input_ids`` of the stream ``cu_seqlens`` numbers."""
        T = input_ids.numel()
        cp = cp_group_info()[0]
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, T * cp], dtype=torch.int64, device=input_ids.device)
        if cp > 1:
            return ThdContext.build(cu_seqlens.to(input_ids.device), local_len=T)
        layout = ThdLayout(cu_seqlens.to(input_ids.device))
        if layout.total_tokens != T:
            raise ValueError(f"cu_seqlens covers {layout.total_tokens} tokens, input_ids has {T}")
        return layout

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear_fp32(h, self.output_layer.weight)

    @property
    def row_stage(self):
        """This model as a pipeline stage over rows (the trainer's ``--pp``; ``backends.megatron.stage``)."""
        from .stage import RowStage

        return RowStage(self)

    def hidden_streams(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, *, layout=None,
                       streams: Optional[torch.Tensor] = None):
        """``(final streams [T,1,n,C], unscaled summed indexer KL or None, layout)``. ``layout``: a prebuilt
        ``layout_for(input_ids, cu_seqlens)`` to reuse (it keeps what it derives: no host sync when reused).
        ``streams [T,1,n,C]``: a later pipeline stage's input (the previous stage's output) instead of the
        embedding (``backends.megatron.stage``)."""
        ids = input_ids.reshape(-1)
        if layout is None:
            layout = self.layout_for(ids, cu_seqlens)
        if isinstance(layout, ThdLayout):  # derive the attention indices eagerly, before compiled blocks
            layout.prepare(self.config.csa_window_size, self.config.csa_compress_ratios)
        if streams is None:
            emb = self.embedding(ids.view(1, -1), position_ids=None)                 # [T, 1, C]
            n = self.config.num_residual_streams
            streams = emb.unsqueeze(2).expand(-1, -1, n, -1).contiguous()
        streams, kl = self.decoder(streams, layout, ids)
        return streams, kl, layout

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, *,
                return_indexer_loss: bool = False, layout=None, labels: Optional[torch.Tensor] = None,
                temperature: float = 1.0):
        """``input_ids [T]`` (or ``[1, T]``), ``cu_seqlens [n_seg+1]`` (default: one sequence) ->
        fp32 logits ``[T, V]``; with ``return_indexer_loss=True`` -> ``(logits, indexer_loss)`` where
        ``indexer_loss = dsa_indexer_loss_coeff * sum_layers KL`` or None (coefficient None / eval).
        ``layout``: a prebuilt ``layout_for(input_ids, cu_seqlens)`` to reuse across steps. ``labels`` (shaped as
        the ids): the labels' fp32 log-probs ``[T]`` under ``softmax(logits / temperature)`` in place of the
        logits, through the op table's ``head_logprobs`` (a kernel backend may fuse the passes after the GEMM)."""
        streams, kl, _ = self.hidden_streams(input_ids, cu_seqlens, layout=layout)
        y = self.decoder.collapse(streams)[:, 0]
        logits = self._logits(y) if labels is None else \
            self.ops.head_logprobs(y, self.output_layer.weight, labels.reshape(-1), temperature)
        coeff = self.config.dsa_indexer_loss_coeff
        self.last_indexer_loss = None if (kl is None or coeff is None) else kl * coeff
        if return_indexer_loss:
            return logits, self.last_indexer_loss
        return logits

    def mtp_logits(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None):
        """One ``(logits [T_k, V] fp32, cu_seqlens_k)`` per MTP depth ``k``. Depth ``k`` drops the last
        row of every segment of depth ``k-1`` (each segment is one shorter); its row ``i`` predicts
        ``t_{i+k+2}`` from the previous depth's streams at ``i`` and the embedding of ``t_{i+k+1}``.

        Context parallel (megatron's CP group > 1; ``input_ids`` is this rank's slice of the stream): one
        ``logits [T_local, V]`` per depth over this rank's rows instead, see :meth:`_mtp_logits_cp`."""
        if not hasattr(self, "mtp"):
            return []
        ids = input_ids.reshape(-1)
        if cp_group_info()[0] > 1:
            return self._mtp_logits_cp(ids, cu_seqlens)
        streams, _, layout = self.hidden_streams(ids, cu_seqlens)
        return self.mtp_from_streams(ids, streams, layout)

    def mtp_from_streams(self, ids: torch.Tensor, streams: torch.Tensor, layout: ThdLayout,
                         embedded: Optional[torch.Tensor] = None) -> list:
        """:meth:`mtp_logits` (one process, no context parallelism) from the trunk's final ``streams [T,1,n,C]``
        over ``ids [T]`` laid out by ``layout``. ``embedded [T,1,C]``: the embeddings of ``ids`` (a pipeline's
        last stage holds no embedding): each depth takes the rows of its next tokens from them, the very
        values the embedding looks up."""
        out = []
        tokens = ids
        for layer in self.mtp.layers:
            keep, layout = layout.shortened()       # kept with the layout: no host read
            nxt = torch.roll(tokens, -1).index_select(0, keep)
            if embedded is None:
                emb = self.embedding(nxt.view(1, -1), position_ids=None)
            else:
                emb = embedded = torch.roll(embedded, -1, 0).index_select(0, keep)
            streams = layer(streams.index_select(0, keep), emb, layout, nxt)
            out.append((self._logits(layer.collapse(streams)[:, 0]), layout.cu_seqlens))
            tokens = nxt
        return out

    def _mtp_logits_cp(self, ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> list:
        """MTP under context parallelism: every depth keeps this rank's rows and the stream's layout; row
        ``i`` of depth ``k`` predicts the token ``k+2`` rows later in its segment. Rows within ``k+1`` of a
        segment's end are meaningless (they see the next segment's tokens) and must be masked by the
        caller. The valid rows equal the cp-1 result: the MTP blocks are window-only and causal within a
        segment, so a segment's trailing rows never reach its earlier ones."""
        streams, _, ctx = self.hidden_streams(ids, cu_seqlens)
        lay = ctx.layout
        full = gather_sequence_cp(ids, ctx)                                   # the whole stream's ids
        out = []
        for k, layer in enumerate(self.mtp.layers):
            nxt = torch.roll(full, -(k + 1))[lay.global_start:lay.global_start + lay.local_len]
            emb = self.embedding(nxt.view(1, -1), position_ids=None)
            streams = layer(streams, emb, ctx, nxt)
            out.append(self._logits(layer.collapse(streams)[:, 0]))
        return out

    def logprobs(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[T]``: ``log P(t_{i+1} | t_{<=i})`` at row ``i``; 0 at each segment's last row (no next token)."""
        ids = input_ids.reshape(-1)
        logits = self.forward(ids, cu_seqlens)
        layout = self.layout_for(ids, cu_seqlens)
        if isinstance(layout, ThdContext):  # context parallel: the next token may live on the next rank
            ctx, layout = layout, layout.layout
            full = gather_sequence_cp(ids, ctx)
            nxt = torch.roll(full, -1)[layout.global_start:layout.global_start + layout.local_len]
        else:
            nxt = torch.roll(ids, -1)
        lp = torch.log_softmax(logits, dim=-1).gather(-1, nxt[:, None]).squeeze(-1)
        last = layout.positions == (layout.segment_ends - layout.segment_starts - 1)
        return lp.masked_fill(last, 0.0)
