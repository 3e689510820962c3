"""Lightning Indexer (CSA layers): picks the top-k visible compressed entries per query.

    q^I_t = Hadamard(RoPE_t(wq_b(cq_t)))            [H_I, c_I]   (cq = q_norm(wq_a x) shared with attention)
    K^I_j = indexer compressor output (ratio 4, overlap, Hadamard-rotated)
    w_{t,h} = weights_proj(x_t)_h * (c_I * H_I)^-1/2
    I_{t,j} = sum_h w_{t,h} * ReLU(q^I_{t,h} . K^I_j)
    mask j >= floor((t+1)/4); top-k with k = min(index_topk, floor(S/4)); invisible picks -> -1.

The top-k is :func:`.topk.stable_topk` (ties -> lowest entry id, picks in ascending id order, ``-1``
padding last), so a position's picks do not depend on how many tokens follow it.

The Hadamard rotation is orthonormal (scores are unchanged in exact arithmetic); it is kept because
it matters for the FP4 fake-quant of the official QAT path. ``topk`` is not differentiable.

Input precision: ``q`` and ``k`` reach ``indexer_scores`` in the dtype :func:`indexer_input_dtype` gives
(the one rule of every caller: this forward, the decode step, the miles and megatron indexers): the compute
dtype for the reference op, the model's activation dtype for a bf16/fp16 kernel; ``w`` in the compute dtype.

Indexer-replay seam (off by default; used by ``rollout.replay``): :func:`indexer_hook` installs, for the
current context, ``hook(indexer_module, picks [B,S,k]) -> picks``, called with the final top-k picks
(``-1`` = none). No hook installed = unchanged behaviour. The implementations' packed (THD) indexers call the
installed hook (:func:`current_indexer_hook`) through ``engine.thd_attention.replayed_segment_picks``.
"""

from __future__ import annotations

import torch
from torch import nn

from .compressor import Compressor, hadamard_transform
from .layers import Linear, compute_dtype
from .rope import apply_rope, rope_cos_sin
from .seam import HookSeam
from .topk import stable_topk

__all__ = ["Indexer", "indexer_scores", "indexer_input_dtype", "indexer_hook", "current_indexer_hook"]

_INDEXER = HookSeam("dsv4_indexer_hook")


def indexer_hook(hook):
    """Install ``hook(indexer_module, picks) -> picks`` for every Indexer in this context."""
    return _INDEXER.installed(hook)


def current_indexer_hook():
    """The hook installed in this context (None: none); for the packed (THD) indexers of the implementations,
    which compute their top-k outside :class:`Indexer` (``engine.thd_attention.replayed_segment_picks``)."""
    return _INDEXER.current()


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``I[b,t,j] = sum_h w[b,t,h] * relu(q[b,t,h,:] . k[b,j,:])``."""
    return torch.einsum("bshn,bsh->bsn", torch.relu(torch.einsum("bshd,bnd->bshn", q, k)), w)


def indexer_input_dtype(ops, activation: torch.dtype) -> torch.dtype:
    """The dtype ``q`` and ``k`` are cast to before ``ops.indexer_scores`` (``ops`` None: this module's
    :func:`indexer_scores`), given the model's ``activation`` dtype; ``w`` stays in the compute dtype.

    Why one rule, declared by the table (``core.kernel_ops.OpTable.indexer_inputs``): the reference op is the
    oracle and scores in the compute dtype (fp32; fp64 in fp64 tests), which the CPU parity tests rely on;
    the GPU backends' indexer kernels are bf16/fp16 kernels with fp32 accumulation (the official inference
    code also scores in low precision), and fp32 inputs would be refused (tilelang) or run as slow fp32 dots
    (triton). So a table declaring ``"activation"`` gets them in the activation dtype (bf16 in a bf16 run),
    any other the compute dtype."""
    compute = torch.promote_types(torch.float32, activation)   # compute_dtype's rule, for a dtype
    if ops is None or ops.indexer_inputs == "compute":
        return compute
    return activation


class Indexer(nn.Module):
    """``attn.indexer``: ``wq_b [H_I*c_I, q_lora]``, ``weights_proj [H_I, d]``, ``compressor``.

    ``ops``: a kernel op table (``core.kernel_ops.OpTable``) whose ``indexer_scores``, ``hadamard_transform``
    and ``apply_rope`` the forward calls; None (the reference model) = this package's functions."""

    ops = None

    def __init__(self, config):
        c = config
        super().__init__()
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.ratio = 4
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        self.weights_proj = Linear(c.dim, c.index_n_heads)
        self.compressor = Compressor(c.dim, c.index_head_dim, c.rope_head_dim, 4, rotate=True, norm_eps=c.norm_eps)

    def forward(self, x: torch.Tensor, cq: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``x [B,S,d]``, ``cq [B,S,q_lora]`` -> ``[B, S, min(topk, S//4)]`` entry ids, ``-1`` = none."""
        B, S, _ = x.shape
        nb = S // self.ratio
        if nb == 0:
            return torch.empty(B, S, 0, dtype=torch.long, device=x.device)
        ops = self.ops
        ct, it = compute_dtype(x), indexer_input_dtype(ops, x.dtype)
        k = self.compressor(x, inv_freq).to(it)  # [B, nb, c_I]
        cos, sin = rope_cos_sin(inv_freq.to(x.device), torch.arange(S, device=x.device))
        q = (apply_rope if ops is None else ops.apply_rope)(self.wq_b(cq).view(B, S, self.n_heads, self.head_dim),
                                                             cos, sin)
        q = (hadamard_transform if ops is None else ops.hadamard_transform)(q.to(ct)).to(it)
        w = self.weights_proj(x).to(ct) * (self.head_dim * self.n_heads) ** -0.5
        scores = (indexer_scores if ops is None else ops.indexer_scores)(q, k, w)  # [B, S, nb]
        limit = (torch.arange(S, device=x.device) + 1) // self.ratio  # visible: j < limit[t]
        invisible = torch.arange(nb, device=x.device)[None, :] >= limit[:, None]
        scores = scores.masked_fill(invisible, float("-inf"))
        picks = stable_topk(scores, self.topk)                                    # -1 where invisible
        hook = _INDEXER.current()
        return picks if hook is None else hook(self, picks)
