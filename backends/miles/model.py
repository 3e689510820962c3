"""The ``miles`` DeepSeek-V4 model: megatron-core building blocks, native (megatron) names.

Layout (names exactly as ``core.weight_contract.native_names``)::

    embedding.word_embeddings.weight                 megatron VocabParallelEmbedding (vocab split)
    decoder.layers.N.input_layernorm / pre_mlp_layernorm
    decoder.layers.N.self_attention.*                backends.miles.attention.DeepSeekV4Attention
    decoder.layers.N.self_attention_hyper_connection.{mapping_proj.weight, bias,
                                                      alpha_pre, alpha_post, alpha_res}   (fp32)
    decoder.layers.N.mlp.*                           engine.moe.DSv4MoE
    decoder.layers.N.mlp_hyper_connection.*
    decoder.final_layernorm, decoder.hc_head_{fn,base,scale}
    output_layer.weight                              megatron ColumnParallelLinear (vocab split)
    mtp.layers.K.{enorm, hnorm, e_proj, h_proj, final_layernorm, hc_head_*}, mtp.layers.K.mtp_model_layer.*

Activations are batch-first (BSHD): residual streams ``[B, S, hc_mult, d]``. The mHC math is the
kernel backend's ``hc_pre`` / ``hc_post`` / ``hc_head`` with ``scale = cat(alpha_pre, alpha_post,
alpha_res)``. Logits are computed in fp32 (fp64 for an fp64 model) and gathered over TP.

Packed sequences (THD): ``forward(input_ids [1, T] or [T], cu_seqlens=cu)`` runs one packed stream
whose segments never see each other (RoPE restarts per segment); under context parallelism
(megatron's CP group, size > 1) ``input_ids`` is this rank's contiguous slice of the stream and
``cu_seqlens`` numbers the whole stream. BSHD with CP > 1 (no ``cu_seqlens``): ``input_ids
[B, S_local]`` is this rank's contiguous slice of every sample (the all-gather CP design).
Everything outside attention is per token, so only the attention sees the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import KeepFP32Module, Linear, RMSNorm, init_normal_
from engine.moe import DSv4MoE
from engine.pipeline import active_layers
from engine.layout import current as parallel_layout
from engine.runtime import ensure_megatron
from engine.thd_attention import ThdContext, cp_group_info, gather_sequence_cp
from engine.tp import mark_keep_in_fp32, mark_tp

from kernels.reference.layers import label_logprobs, linear_fp32

from .attention import DeepSeekV4Attention

__all__ = ["MappingProj", "HyperConnection", "DeepSeekV4Layer", "DeepSeekV4Decoder", "DeepSeekV4MTPLayer",
           "DeepSeekV4MTP", "DeepSeekV4MilesModel"]


def _fp32_param(shape, fill=None, std=0.02):
    t = torch.empty(*shape, dtype=torch.float32)
    if fill is None:
        init_normal_(t, std)
    else:
        t.fill_(fill)
    return mark_keep_in_fp32(nn.Parameter(t))


class MappingProj(KeepFP32Module):
    """``mapping_proj``: ``weight [(2+n)n, n d]`` rows [pre(n), post(n), res(n^2)]; fp32, no bias (the
    static bias is the site's own ``bias`` Parameter, as in upstream Megatron)."""

    def __init__(self, n: int, dim: int, std: float | None = 0.02):
        super().__init__()
        self.weight = _fp32_param(((2 + n) * n, n * dim), std=std)


class HyperConnection(KeepFP32Module):
    """miles-style mHC site (``self_attention_hyper_connection`` / ``mlp_hyper_connection``)."""

    def __init__(self, c, ops, std: float | None = 0.02):
        super().__init__()
        self.ops = ops
        self.norm_eps, self.hc_eps, self.iters = c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters
        self.mapping_proj = MappingProj(c.hc_mult, c.dim, std)
        self.alpha_pre = _fp32_param((1,), fill=1.0)
        self.alpha_post = _fp32_param((1,), fill=1.0)
        self.alpha_res = _fp32_param((1,), fill=1.0)
        self.bias = _fp32_param(((2 + c.hc_mult) * c.hc_mult,), fill=0.0)

    def scale(self) -> torch.Tensor:
        return torch.cat((self.alpha_pre, self.alpha_post, self.alpha_res))

    def pre(self, x: torch.Tensor):
        """``x [B,S,n,d]`` -> ``(layer input [B,S,d], post [B,S,n], comb [B,S,n,n])``."""
        return self.ops.hc_pre(x, self.mapping_proj.weight, self.scale(), self.bias,
                               self.norm_eps, self.hc_eps, self.iters)

    def post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return self.ops.hc_post(f, x, post, comb)


class DeepSeekV4Layer(nn.Module):
    """One block (``decoder.layers.N`` / ``mtp.layers.K.mtp_model_layer``)."""

    def __init__(self, c, tconfig, layer_id: int, ops, params_dtype=torch.float32, std: float | None = 0.02,
                 freeze_indexer: bool = True):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps, params_dtype, ops=ops)
        self.self_attention = DeepSeekV4Attention(c, tconfig, layer_id, ops, params_dtype, std, freeze_indexer)
        self.self_attention_hyper_connection = HyperConnection(c, ops, std)
        self.pre_mlp_layernorm = RMSNorm(c.dim, c.norm_eps, params_dtype, ops=ops)
        self.mlp = DSv4MoE(c, tconfig, layer_id, params_dtype, std, ops=ops)
        self.mlp_hyper_connection = HyperConnection(c, ops, std)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, thd: ThdContext | None = None) -> torch.Tensor:
        hc = self.self_attention_hyper_connection
        u, post, comb = hc.pre(x)
        x = hc.post(self.self_attention(self.input_layernorm(u), thd), x, post, comb)
        hc = self.mlp_hyper_connection
        u, post, comb = hc.pre(x)
        x = hc.post(self.mlp(self.pre_mlp_layernorm(u), input_ids), x, post, comb)
        return x


class _HCHead(KeepFP32Module):
    """Holds ``hc_head_fn [n, n d]``, ``hc_head_base [n]``, ``hc_head_scale [1]`` (fp32)."""

    def _init_hc_head(self, c, std):
        n = c.hc_mult
        self.hc_head_fn = _fp32_param((n, n * c.dim), std=std)
        self.hc_head_base = _fp32_param((n,), fill=0.0)
        self.hc_head_scale = _fp32_param((1,), fill=1.0)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm_eps, self.hc_eps)
        return self.final_layernorm(y)


class DeepSeekV4Decoder(_HCHead):
    """``decoder``: ``layers``, ``final_layernorm``, ``hc_head_*``."""

    def __init__(self, c, tconfig, ops, params_dtype=torch.float32, std: float | None = 0.02, freeze_indexer=True):
        super().__init__()
        self.ops, self.norm_eps, self.hc_eps = ops, c.norm_eps, c.hc_eps
        self.layers = nn.ModuleList(DeepSeekV4Layer(c, tconfig, i, ops, params_dtype, std, freeze_indexer)
                                    for i in range(c.n_layers))
        self.final_layernorm = RMSNorm(c.dim, c.norm_eps, params_dtype, ops=ops)
        self._init_hc_head(c, std)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, thd: ThdContext | None = None) -> torch.Tensor:
        for layer in active_layers(self.layers):     # pipeline parallel: this stage's (chunk's) layers
            x = layer(x, input_ids, thd)
        return x


class DeepSeekV4MTPLayer(_HCHead):
    """``mtp.layers.K``: ``enorm``, ``hnorm``, ``e_proj [d, d]``, ``h_proj [d, d]``, ``mtp_model_layer``
    (window-only block ``n_layers + K``), ``final_layernorm``, ``hc_head_*``."""

    def __init__(self, c, tconfig, k: int, ops, params_dtype=torch.float32, std: float | None = 0.02,
                 freeze_indexer=True):
        super().__init__()
        self.ops, self.norm_eps, self.hc_eps, self.dim = ops, c.norm_eps, c.hc_eps, c.dim
        self.enorm = RMSNorm(c.dim, c.norm_eps, params_dtype, ops=ops)
        self.hnorm = RMSNorm(c.dim, c.norm_eps, params_dtype, ops=ops)
        self.e_proj = Linear(c.dim, c.dim, params_dtype, std)
        self.h_proj = Linear(c.dim, c.dim, params_dtype, std)
        self.mtp_model_layer = DeepSeekV4Layer(c, tconfig, c.n_layers + k, ops, params_dtype, std,
                                                 freeze_indexer)
        self.final_layernorm = RMSNorm(c.dim, c.norm_eps, params_dtype, ops=ops)
        self._init_hc_head(c, std)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, embedded: torch.Tensor,
                thd: ThdContext | None = None) -> torch.Tensor:
        """``h [B,L,n,d]`` previous streams, ``embedded [B,L,d]`` embeddings of ``input_ids``."""
        e = self.enorm(embedded)
        x = F.linear(e, self.e_proj.weight.to(e.dtype)).unsqueeze(2)
        hn = self.hnorm(h)
        x = x + F.linear(hn, self.h_proj.weight.to(hn.dtype))
        return self.mtp_model_layer(x, input_ids, thd)


class DeepSeekV4MTP(nn.Module):
    def __init__(self, c, tconfig, ops, params_dtype=torch.float32, std: float | None = 0.02, freeze_indexer=True):
        super().__init__()
        self.layers = nn.ModuleList(DeepSeekV4MTPLayer(c, tconfig, k, ops, params_dtype, std, freeze_indexer)
                                    for k in range(c.n_mtp_layers))


class _Embedding(nn.Module):
    def __init__(self, c, tconfig, std):
        super().__init__()
        from megatron.core import tensor_parallel

        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            c.vocab_size, c.dim, init_method=lambda w: torch.nn.init.normal_(w, 0.0, std), config=tconfig,
            tp_group=parallel_layout().group("tp"))
        mark_tp(self.word_embeddings.weight, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)


class DeepSeekV4MilesModel(nn.Module):
    """DeepSeek-V4 causal LM (``miles`` implementation). Same API as the reference model:
    ``forward(input_ids) -> logits [B,S,V]`` (fp32), ``logprobs``, ``hidden_streams``,
    ``mtp_logits``."""

    def __init__(self, model_config, tconfig, ops, params_dtype=torch.float32, std: float | None = 0.02,
                 freeze_indexer: bool = True):
        super().__init__()
        ensure_megatron()
        from megatron.core import tensor_parallel

        c = model_config
        self.config, self.tconfig, self.ops = c, tconfig, ops
        if c.vocab_size % parallel_layout().tp:
            raise ValueError(f"vocab_size {c.vocab_size} is not divisible by tp={parallel_layout().tp}")
        self.embedding = _Embedding(c, tconfig, std)
        self.decoder = DeepSeekV4Decoder(c, tconfig, ops, params_dtype, std, freeze_indexer)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            c.dim, c.vocab_size, config=tconfig, init_method=lambda w: torch.nn.init.normal_(w, 0.0, std),
            bias=False, gather_output=True, tp_group=parallel_layout().group("tp"))
        mark_tp(self.output_layer.weight, 0)
        if c.n_mtp_layers:
            self.mtp = DeepSeekV4MTP(c, tconfig, ops, params_dtype, std, freeze_indexer)

    # ------------------------------------------------------------------ layout
    @staticmethod
    def thd_context(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> ThdContext | None:
        """The packed / context-parallel layout of a forward (None: plain BSHD without CP)."""
        if cu_seqlens is not None:
            if input_ids.dim() == 2 and input_ids.shape[0] != 1:
                raise ValueError(f"a packed (THD) stream is one row: input_ids [1, T] or [T], got {tuple(input_ids.shape)}")
            return ThdContext.build(cu_seqlens.to(input_ids.device), local_len=input_ids.shape[-1])
        if cp_group_info()[0] > 1:
            return ThdContext.bshd(input_ids.shape[-1])
        return None

    @staticmethod
    def _rows(input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids

    # ------------------------------------------------------------------ trunk
    def hidden_streams(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                       thd: ThdContext | None = None, streams: torch.Tensor | None = None) -> torch.Tensor:
        """The residual streams after the decoder layers this model holds. ``streams [B, S, hc, d]``: a later
        pipeline stage's input (the previous stage's output) instead of the embedding (engine.pipeline)."""
        input_ids = self._rows(input_ids)
        if thd is None:
            thd = self.thd_context(input_ids, cu_seqlens)
        if streams is None:
            h = self.embedding(input_ids)
            streams = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        return self.decoder(streams, input_ids, thd)

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits in fp32 (vocab-parallel GEMM, then TP all-gather)."""
        from megatron.core.tensor_parallel import mappings

        tp = parallel_layout().tp
        if tp > 1:
            y = mappings.copy_to_tensor_model_parallel_region(y, parallel_layout().group("tp"))
        logits = linear_fp32(y, self.output_layer.weight)
        if tp > 1:
            logits = mappings.gather_from_tensor_model_parallel_region(logits, parallel_layout().group("tp"))
        return logits

    def forward(self, input_ids: torch.Tensor, return_hidden_streams: bool = False, *,
                cu_seqlens: torch.Tensor | None = None, thd: ThdContext | None = None,
                streams: torch.Tensor | None = None, labels: torch.Tensor | None = None, temperature: float = 1.0):
        """``logits [B, L, V]`` (THD: ``[1, T_local, V]``); with ``labels`` (shaped as the ids) the labels' fp32
        log-probs under ``softmax(logits / temperature)`` instead, ``[B, L]``: what a trainer needs, through the
        op table's ``head_logprobs`` (a kernel backend may fuse the passes after the head's GEMM); ``streams``:
        see :meth:`hidden_streams`."""
        x = self.hidden_streams(input_ids, cu_seqlens, thd, streams)
        y = self.decoder.collapse(x)
        out = self._logits(y) if labels is None else self._label_logprobs(y, self._rows(labels), temperature)
        return (out, x) if return_hidden_streams else out

    def _label_logprobs(self, y: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        if parallel_layout().tp > 1:       # vocab-parallel GEMM, then the all-gather: the op would see a slice
            return label_logprobs(self._logits(y), labels, temperature)
        lp = self.ops.head_logprobs(y.reshape(-1, y.shape[-1]), self.output_layer.weight, labels.reshape(-1),
                                    temperature)
        return lp.view(labels.shape)

    def logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """BSHD: ``[B, S-1]``: ``log P(t_{i+1} | t_{<=i})``. Packed (``cu_seqlens``) or context parallel:
        one value per local row (``[T_local]`` for THD, ``[B, S_local]`` for BSHD + CP), 0 at each
        segment's last row (no next token)."""
        thd = self.thd_context(self._rows(input_ids), cu_seqlens)
        if thd is None:
            logits = self.forward(input_ids)[:, :-1]
            return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        ids = self._rows(input_ids)
        labels, valid = self.shifted_labels(ids, thd, 1)
        lp = self.token_logprobs(ids, labels, thd=thd).masked_fill(~valid, 0.0)
        return lp[0] if input_ids.dim() == 1 or cu_seqlens is not None else lp

    @staticmethod
    def shifted_labels(ids: torch.Tensor, thd: ThdContext, shift: int):
        """``(labels [B, L], valid [B, L])``: the token ``shift`` rows later in the same segment, for this
        rank's rows (the ids are all-gathered over CP); ``valid`` is False where that is past the segment."""
        full = gather_sequence_cp(ids, thd, dim=1)
        s, n = thd.layout.global_start, thd.local_len
        labels = torch.roll(full, -shift, dims=1)[:, s:s + n]
        lay = thd.layout
        valid = (lay.positions + shift < lay.segment_ends - lay.segment_starts).to(ids.device)
        return labels, valid.unsqueeze(0).expand_as(labels)

    def token_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                       cu_seqlens: torch.Tensor | None = None, thd: ThdContext | None = None) -> torch.Tensor:
        """``log P(labels[b, i] | row i)`` for every local row: ``[B, L]``."""
        ids = self._rows(input_ids)
        logits = self.forward(ids, cu_seqlens=cu_seqlens, thd=thd)
        return torch.log_softmax(logits, dim=-1).gather(-1, self._rows(labels)[..., None]).squeeze(-1)

    # -------------------------------------------------------------------- MTP
    def mtp_logits(self, input_ids: torch.Tensor, hidden_streams: torch.Tensor | None = None, *,
                   cu_seqlens: torch.Tensor | None = None, embedded: torch.Tensor | None = None) -> list:
        """One ``[B, S-1-k, V]`` tensor per MTP depth ``k`` (row ``i`` predicts ``t_{i+k+2}``).

        Packed / context parallel: one ``[B, L, V]`` tensor per depth over the same rows and layout
        (row ``i`` predicts the token ``k+2`` rows later in its segment; rows past the segment end
        are meaningless and must be masked, see ``shifted_labels``). The MTP blocks are window-only
        and causal, so keeping the layout equals dropping each segment's last rows."""
        ids = self._rows(input_ids)
        thd = self.thd_context(ids, cu_seqlens)
        if thd is not None:
            h = self.hidden_streams(ids, thd=thd) if hidden_streams is None else hidden_streams
            out = []
            for k, layer in enumerate(self.mtp.layers if hasattr(self, "mtp") else []):
                tau, _ = self.shifted_labels(ids, thd, k + 1)
                h = layer(h, tau, self.embedding(tau), thd)
                out.append(self._logits(layer.collapse(h)))
            return out
        if hidden_streams is None:
            hidden_streams = self.hidden_streams(input_ids)
        out = []
        h = hidden_streams
        layers = self.mtp.layers if hasattr(self, "mtp") else []
        for k, layer in enumerate(layers):
            tau = input_ids[:, k + 1:]
            # embedded: the embeddings of input_ids [B, S, d] (a pipeline's last stage holds no embedding)
            h = layer(h[:, :-1], tau, self.embedding(tau) if embedded is None else embedded[:, k + 1:])
            out.append(self._logits(layer.collapse(h)))
        return out
