"""DeepSeek-V4 reference model (single device, readable; follows the official ``inference/model.py``).

``state_dict()`` keys are exactly the official checkpoint names (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.hc_attn_fn``, ``layers.N.ffn.experts.E.w1.weight``, ``mtp.0.e_proj.weight``, ...). FP8/FP4 scales
are not part of this model (weights are dense). Parameters that stay fp32 when the model is cast to bf16:
every ``hc_*`` tensor, ``attn_sink``, compressor ``ape``, every RMSNorm weight (incl. the compressor norms)
and the router ``bias`` buffer; ``tid2eid`` stays int64.

Forward::

    X = [embed(ids)] * hc_mult                       (streams [B,S,n,d])
    for block: X = hc_post(attn(attn_norm(hc_pre(X)))); X = hc_post(moe(ffn_norm(hc_pre(X)), ids))
    logits = head(norm(hc_head(X)))                  (fp32)

MTP (``mtp.i``, window-only layer ``n_layers + i``, non-hash MoE with bias, own mHC and ``hc_head_*``; shares
``embed`` and ``head`` with the trunk): for depth ``k`` at position ``i`` it takes the previous depth's final
streams at ``i`` (the trunk's for ``k = 0``) and the embedding of token ``t_{i+k+1}`` and predicts ``t_{i+k+2}``
(DeepSeek-V3 convention)::

    X = e_proj(enorm(embed(tau)))[:, :, None] + h_proj(hnorm(H)) ;  X = Block(X) ;  logits = head(norm(hc_head_mtp(X)))

Kernel ops: by default every module computes with this package's functions (the oracle). A module's ``ops``
attribute (a ``core.kernel_ops.OpTable``) makes it call that table's ops instead: the blocks' ``hc_pre`` /
``hc_post``, the model's ``hc_head``, attention's ``sparse_attention_with_sink`` and ``rms_normalize`` (the query's
per-head norm), the indexer's ``indexer_scores`` and ``hadamard_transform``, the rotating compressor's
``hadamard_transform``, ``apply_rope`` wherever attention, the indexer and the compressors rotate, every
``RMSNorm``'s ``rms_norm``; the decode MoE's (``slots``) ``weighted_swiglu`` and ``experts_grouped_mm``.
:func:`ops_in_use` sets one table on every such module for a ``with`` block (the rollout engine's prefill and
decode steps run the run's kernel backend this way).
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .layers import KeepFP32, Linear, RMSNorm, compute_dtype
from .mhc import hc_head, hc_post, hc_pre
from .moe import MoE

__all__ = ["Block", "MTPBlock", "DeepseekV4Model", "init_weights", "balanced_tid2eid", "ops_in_use"]


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Block(KeepFP32):
    """One transformer block ``layers.N`` (also the body of an MTP block)."""

    _fp32_names = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale")
    ops = None      # a kernel op table for hc_pre / hc_post (module docstring); None = this package's functions

    def __init__(self, config, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.norm_eps, self.hc_eps, self.hc_iters = c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters
        n, d = c.hc_mult, c.dim
        mix = (2 + n) * n
        self.attn_norm = RMSNorm(d, c.norm_eps)
        self.ffn_norm = RMSNorm(d, c.norm_eps)
        self.attn = Attention(c, layer_id)
        self.ffn = MoE(c, layer_id)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mix, n * d, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _hc(self, site: str, x: torch.Tensor):
        return (hc_pre if self.ops is None else self.ops.hc_pre)(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                      getattr(self, f"hc_{site}_base"), self.norm_eps, self.hc_eps, self.hc_iters)

    def hc_post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return (hc_post if self.ops is None else self.ops.hc_post)(f, x, post, comb)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x [B,S,n,d]`` streams -> ``[B,S,n,d]``."""
        u, post, comb = self._hc("attn", x)
        x = self.hc_post(self.attn(self.attn_norm(u)), x, post, comb)
        u, post, comb = self._hc("ffn", x)
        x = self.hc_post(self.ffn(self.ffn_norm(u), input_ids), x, post, comb)
        return x


class MTPBlock(Block):
    """``mtp.i``: a window-only block plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``, ``hc_head_*``."""

    _fp32_names = Block._fp32_names + ("hc_head_fn", "hc_head_base", "hc_head_scale")

    def __init__(self, config, mtp_id: int):
        super().__init__(config, config.n_layers + mtp_id)
        c = config
        n, d = c.hc_mult, c.dim
        self.e_proj = Linear(d, d)
        self.h_proj = Linear(d, d)
        self.enorm = RMSNorm(d, c.norm_eps)
        self.hnorm = RMSNorm(d, c.norm_eps)
        self.norm = RMSNorm(d, c.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """``h [B,L,n,d]`` previous streams, ``input_ids [B,L]`` the next tokens -> streams ``[B,L,n,d]``."""
        e = self.enorm(embed(input_ids))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(h))
        return super().forward(x, input_ids)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm((hc_head if self.ops is None else self.ops.hc_head)(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm_eps,
                                 self.hc_eps))


class DeepseekV4Model(KeepFP32):
    """DeepSeek-V4 causal LM. ``DeepseekV4Model(config, device=None)``; any device incl. ``"meta"``.

    Parameters are allocated uninitialised (except ones/zeros of norms, biases, sinks); call
    ``init_weights(model, seed)`` or ``load_state_dict``."""

    _fp32_names = ("hc_head_fn", "hc_head_base", "hc_head_scale")
    ops = None      # a kernel op table for hc_head (module docstring); None = this package's functions

    def __init__(self, config, device=None):
        super().__init__()
        if device is not None:
            with torch.device(device):
                self._build(config)
        else:
            self._build(config)

    def _build(self, config) -> None:
        c = config
        self.config = c
        n, d = c.hc_mult, c.dim
        self.embed = Embedding(c.vocab_size, d)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.n_layers))
        self.norm = RMSNorm(d, c.norm_eps)
        self.head = Linear(d, c.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.mtp = nn.ModuleList(MTPBlock(c, i) for i in range(c.n_mtp_layers))

    # ------------------------------------------------------------------ trunk
    def hidden_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final trunk streams ``[B,S,n,d]`` (before ``hc_head``)."""
        h = self.embed(input_ids)
        x = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            x = layer(x, input_ids)
        return x

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        ct = compute_dtype(y)
        return F.linear(y.to(ct), self.head.weight.to(ct))

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """Final trunk streams ``[B,S,n,d]`` -> ``norm(hc_head(x))`` ``[B,S,d]``."""
        c = self.config
        head = hc_head if self.ops is None else self.ops.hc_head
        return self.norm(head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.norm_eps, c.hc_eps))

    def forward(self, input_ids: torch.Tensor, return_hidden_streams: bool = False):
        """``input_ids [B,S]`` -> logits ``[B,S,V]`` in fp32 (fp64 if the model is fp64);
        with ``return_hidden_streams=True`` -> ``(logits, streams [B,S,n,d])``."""
        x = self.hidden_streams(input_ids)
        logits = self._logits(self.collapse(x))
        return (logits, x) if return_hidden_streams else logits

    def logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S-1]``: ``log P(t_{i+1} | t_{<=i})``."""
        logits = self.forward(input_ids)[:, :-1]
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    # -------------------------------------------------------------------- MTP
    def mtp_logits(self, input_ids: torch.Tensor, hidden_streams: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One ``[B, S-1-k, V]`` fp32 tensor per MTP depth ``k``; row ``i`` predicts ``t_{i+k+2}``
        from the previous depth's streams at ``i`` and the embedding of ``t_{i+k+1}``."""
        if hidden_streams is None:
            hidden_streams = self.hidden_streams(input_ids)
        out = []
        h = hidden_streams
        for k, block in enumerate(self.mtp):
            tau = input_ids[:, k + 1:]
            h = block(h[:, :-1], tau, self.embed)
            out.append(self._logits(block.collapse(h)))
        return out


@contextlib.contextmanager
def ops_in_use(model: nn.Module, ops):
    """Within the ``with`` block every module of ``model`` that takes a kernel op table (an ``ops`` attribute:
    blocks, the model, attention, indexers, compressors) computes with ``ops`` (None: this package's
    functions); each module's previous table is restored on exit."""
    mods = [m for m in model.modules() if hasattr(m, "ops")]
    before = [m.__dict__.get("ops", _CLASS_OPS) for m in mods]
    for m in mods:
        m.ops = ops
    try:
        yield model
    finally:
        for m, b in zip(mods, before):
            if b is _CLASS_OPS:
                m.__dict__.pop("ops", None)
            else:
                m.ops = b


_CLASS_OPS = object()    # ops_in_use: "the module had no table of its own" (it read the class's None)


# ---------------------------------------------------------------------- init
def balanced_tid2eid(vocab_size: int, n_experts: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``[vocab, k]`` int64: ``k`` distinct experts per token; every expert gets ``floor`` or ``ceil`` of
    ``vocab*k/E`` tokens. Tokens are filled in groups of ``E // k`` from the currently least-loaded
    experts (random tie-break), shuffled within the group."""
    per = max(1, n_experts // k)
    counts = torch.zeros(n_experts, dtype=torch.float64, device="cpu")
    out = torch.empty(vocab_size, k, dtype=torch.int64, device="cpu")
    for start in range(0, vocab_size, per):
        nb = min(per, vocab_size - start)
        key = counts + torch.rand(n_experts, generator=generator, dtype=torch.float64, device="cpu")
        chosen = key.argsort()[: nb * k]
        chosen = chosen[torch.randperm(nb * k, generator=generator, device="cpu")]
        out[start:start + nb] = chosen.view(nb, k)
        counts[chosen] += 1
    return out


_ZERO_SUFFIXES = ("attn_sink", ".ape", "_base", "gate.bias")
_ONE_SUFFIXES = ("_scale",)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02, *, draw_on_device: bool = False) -> None:
    """Deterministic HF-like init. Each tensor draws from its own generator seeded by
    ``(seed, crc32(name))``, so a tensor's values depend only on ``seed`` and its name.

    ``draw_on_device=True``: the normal draws of a tensor on a GPU use a generator on that device (the same
    seed), so the values also depend on the device type. For benchmarks of large models: one CPU core draws
    about 70-150 M normals/s, minutes for the Flash-shaped preset's 5.8 B, while a GPU draws them at once.

    normal(0, std): linears, embed, head, router weight, every ``hc_*_fn``; 1: RMSNorm weights and
    ``hc_*_scale``; 0: ``hc_*_base``, ``attn_sink``, ``ape``, router ``bias``; ``tid2eid``: balanced random
    assignment (``balanced_tid2eid``). Meta tensors are skipped."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    named = list(model.named_parameters()) + list(model.named_buffers())
    cfg = getattr(model, "config", None)
    for name, t in named:
        if t.is_meta:
            continue
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        if name.endswith("tid2eid"):
            n_exp = cfg.n_routed_experts if cfg is not None else int(t.max()) + 1
            t.copy_(balanced_tid2eid(t.shape[0], n_exp, t.shape[1], g).to(t.device))
        elif id(t) in norm_params or name.endswith(_ONE_SUFFIXES):
            t.fill_(1.0)
        elif name.endswith(_ZERO_SUFFIXES):
            t.zero_()
        elif t.is_floating_point() and draw_on_device and t.device.type != "cpu":
            t.normal_(0.0, std, generator=torch.Generator(device=t.device).manual_seed(g.initial_seed()))
        elif t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32, device="cpu").mul_(std).to(t.device, t.dtype))
