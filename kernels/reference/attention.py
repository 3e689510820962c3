"""DeepSeek-V4 attention: index builders, sparse attention with sink, and the attention module.

Per query ``t`` one softmax runs over the union of

* the sliding window ``{max(0, t-W+1), ..., t}`` (``W`` = window_size = 128 tokens incl. ``t``),
* compressed entries: all complete visible blocks ``j < floor((t+1)/m)`` on HCA layers, or the
  Lightning Indexer's top-k among them on CSA layers (``-1`` = no entry),

plus a per-head sink logit that appears only in the denominator (zero value vector). K = V is
the single shared KV head. Scale ``D^-1/2``.
"""

from __future__ import annotations

import torch
from torch import nn

from .compressor import Compressor
from .indexer import Indexer
from .layers import KeepFP32, Linear, RMSNorm, compute_dtype, rms_normalize
from .rope import apply_rope, layer_inv_freq, rope_cos_sin

__all__ = ["window_indices", "compressed_visible_indices", "sparse_attention_with_sink", "attention_inverse_rope",
           "Attention"]


def window_indices(seq_len: int, window: int, device=None) -> torch.Tensor:
    """``[S, min(S, window)]`` key positions of each query's window, ``-1`` where ``t-window+1+k < 0``.

    Row ``t`` = ``t-K+1 .. t`` (ascending) with ``K = min(S, window)``."""
    k = min(seq_len, window)
    t = torch.arange(seq_len, device=device)[:, None]
    idx = t - k + 1 + torch.arange(k, device=device)[None, :]
    return torch.where(idx >= 0, idx, torch.full_like(idx, -1))


def compressed_visible_indices(seq_len: int, ratio: int, device=None) -> torch.Tensor:
    """``[S, S // ratio]`` compressed-entry ids visible to each query (``j < floor((t+1)/ratio)``),
    ``-1`` for invisible ones. Entry ``j`` covers tokens ``[j*m, (j+1)*m - 1]``."""
    n = seq_len // ratio
    t = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :].expand(seq_len, n)
    return torch.where(j < (t + 1) // ratio, j, torch.full_like(j, -1))


def sparse_attention_with_sink(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                               sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse MQA attention over gathered rows of one shared K=V head, with a sink logit.

    ``q [B,S,H,D]``, ``kv [B,N,D]``, ``indices [B,S,K]`` or ``[S,K]`` (long, rows of ``kv``, ``-1`` =
    ignore), ``sink [H]`` (a logit, not multiplied by ``scale``). Returns ``o [B,S,H,D]`` (q.dtype)::

        z_s = scale * q.kv_s ;  p_s = exp(z_s) / (sum_{s'} exp(z_s') + exp(sink_h)) ;  o = sum_s p_s kv_s

    Logits, softmax and accumulation are done in fp32 (fp64 for fp64 inputs)."""
    B, S, H, D = q.shape
    if indices.dim() == 2:
        indices = indices.unsqueeze(0).expand(B, -1, -1)
    ct = compute_dtype(q, kv)
    valid = indices >= 0
    safe = indices.clamp(min=0)
    K = safe.shape[-1]
    gathered = torch.gather(kv.to(ct), 1, safe.reshape(B, S * K, 1).expand(-1, -1, D)).view(B, S, K, D)
    logits = torch.einsum("bshd,bskd->bshk", q.to(ct), gathered) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sink_logits = sink.to(ct).view(1, 1, H, 1).expand(B, S, H, 1)
    probs = torch.softmax(torch.cat((logits, sink_logits), dim=-1), dim=-1)[..., :K]
    out = torch.einsum("bshk,bskd->bshd", probs, gathered)
    return out.to(q.dtype)


def attention_inverse_rope(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
                           cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`sparse_attention_with_sink`, then its output rotated back (``apply_rope(..., inverse=True)``: the
    rotation the values carry, since V = K): what the eager decode step does with a layer's attention
    (``kernels.reference.decode._attend``; ``q [B, 1, H, D]``, ``cos``/``sin`` ``[B, 1, r/2]``). The contract of a GPU
    backend's one-launch op for that step (the triton backend's ``kernels/triton/attention.py``)."""
    return apply_rope(sparse_attention_with_sink(q, kv, indices, sink, scale), cos, sin, inverse=True)


class Attention(KeepFP32):
    """Attention sublayer of one block (``layers.N.attn``); ``layer_id`` selects the layer kind.

    ``ops``: a kernel op table (``core.kernel_ops.OpTable``) whose ``sparse_attention_with_sink``,
    ``rms_normalize`` (the query's per-head norm) and ``apply_rope`` the forward calls; None (the reference
    model) = this package's functions."""

    _fp32_names = ("attn_sink",)
    ops = None

    def __init__(self, config, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.rope_dim = c.n_heads, c.head_dim, c.rope_head_dim
        self.window = c.window_size
        self.ratio = c.compress_ratios[layer_id]
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.eps = c.norm_eps
        self.scale = c.head_dim ** -0.5
        self.wq_a = Linear(c.dim, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.n_heads * c.head_dim)
        self.wkv = Linear(c.dim, c.head_dim)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps)
        # wo_a: [G*R, H*D/G], used as G separate [R, H*D/G] maps (einsum, never called as a Linear).
        self.wo_a = Linear(c.n_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.dim)
        self.attn_sink = nn.Parameter(torch.zeros(c.n_heads, dtype=torch.float32))
        if self.ratio:
            self.compressor = Compressor(c.dim, c.head_dim, c.rope_head_dim, self.ratio, rotate=False,
                                         norm_eps=c.norm_eps)
            if self.ratio == 4:
                self.indexer = Indexer(c)
        # RoPE inverse frequencies (float64, CPU): a plain attribute, not a buffer, so that meta
        # construction + to_empty() cannot leave it uninitialised.
        self.inv_freq = layer_inv_freq(c, layer_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B,S,d]`` (already ``attn_norm``-ed) -> ``[B,S,d]``."""
        B, S, _ = x.shape
        H, D = self.n_heads, self.head_dim
        pos = torch.arange(S, device=x.device)
        inv_freq = self.inv_freq.to(x.device)
        cos, sin = rope_cos_sin(inv_freq, pos)

        # query: low rank + weighted norm, then unweighted per-head RMS, RoPE on the last dims
        ops = self.ops
        rope = apply_rope if ops is None else ops.apply_rope
        cq = self.q_norm(self.wq_a(x))
        q = self.wq_b(cq).view(B, S, H, D)
        q = (rms_normalize if ops is None else ops.rms_normalize)(q, self.eps, x.dtype)
        q = rope(q, cos, sin)

        # one shared K=V head
        kv = rope(self.kv_norm(self.wkv(x)), cos, sin)

        idx = window_indices(S, self.window, x.device).unsqueeze(0).expand(B, -1, -1)
        kv_all = kv
        if self.ratio:
            comp = self.compressor(x, inv_freq)  # [B, S // m, D]
            if self.ratio == 4:
                cidx = self.indexer(x, cq, inv_freq)  # [B, S, k], -1 = none
            else:
                cidx = compressed_visible_indices(S, self.ratio, x.device).unsqueeze(0).expand(B, -1, -1)
            cidx = torch.where(cidx >= 0, cidx + S, cidx)  # compressed rows follow the S window rows
            idx = torch.cat((idx, cidx), dim=-1)
            kv_all = torch.cat((kv, comp.to(kv.dtype)), dim=1)

        attend = sparse_attention_with_sink if ops is None else ops.sparse_attention_with_sink
        o = attend(q, kv_all, idx, self.attn_sink, self.scale)
        o = rope(o, cos, sin, inverse=True)  # undo the rotation carried by V = K

        # grouped low-rank output: group g = heads [g*H/G, (g+1)*H/G)
        G, R = self.o_groups, self.o_lora_rank
        o = o.reshape(B, S, G, H * D // G)
        wo_a = self.wo_a.weight.to(o.dtype).view(G, R, H * D // G)
        u = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(u.flatten(2))
