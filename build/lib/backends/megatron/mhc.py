"""Hyper-connections (mHC) in the native design: ``HyperConnectionModule`` and the block-exit head.

``HyperConnectionModule`` (one per sublayer site: ``self_attention_hyper_connection`` and
``mlp_hyper_connection``) holds

* ``mapping_proj``: ``Linear(n*C -> n^2 + 2n, bias=False)``, rows ordered ``[pre(n), post(n), res(n^2)]``;
* ``bias``: the static bias ``[n^2 + 2n]``, a Parameter of its own (as upstream Megatron's
  ``HyperConnectionModule``);
* three separate scalar gains ``alpha_pre``, ``alpha_post``, ``alpha_res`` (``[1]`` each, initialised to
  ``config.mhc_init_gating_factor``);

all fp32. With ``r = rsqrt(mean(x^2) + eps)`` over the flattened ``n*C`` streams::

    h = r * (x @ mapping_proj.weight^T) * alpha_vec + bias
    alpha_vec = [alpha_pre x n, alpha_post x n, alpha_res x n^2]
    pre = sigmoid(h_pre) + eps ; post = 2 sigmoid(h_post) ; comb = sinkhorn(h_res.view(n, n))
    layer_in = sum_i pre_i x_i ;  x'_j = post_j F(layer_in) + sum_i comb[i, j] x_i

The arithmetic is the kernel backend's ``hc_pre`` / ``hc_post`` / ``hc_head`` (the reference ops on CPU);
this module only owns the parameters and their layout. Streams are ``[S, B, n, C]`` (sequence first).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from torch import nn

from engine.layers import KeepFP32Module
from engine.tp import mark_keep_in_fp32

from .config import mhc_eps

__all__ = ["HyperConnectionModule", "register_head_params", "apply_head"]


class _Fp32Linear(KeepFP32Module):
    """``mapping_proj``: ``weight [out, in]``, fp32-kept, no bias. Never called as a layer: the mixing
    math (``hc_pre``) reads the weight directly."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = mark_keep_in_fp32(nn.Parameter(torch.empty(n_out, n_in, dtype=torch.float32)))


class HyperConnectionModule(KeepFP32Module, MegatronModule):
    def __init__(self, config, ops):
        super().__init__(config=config)
        n, c = config.num_residual_streams, config.hidden_size
        self.n = n
        self.ops = ops
        self.mapping_proj = _Fp32Linear(n * c, n * n + 2 * n)
        alpha = float(getattr(config, "mhc_init_gating_factor", 1.0))
        self.alpha_pre = mark_keep_in_fp32(nn.Parameter(torch.full((1,), alpha, dtype=torch.float32)))
        self.alpha_post = mark_keep_in_fp32(nn.Parameter(torch.full((1,), alpha, dtype=torch.float32)))
        self.alpha_res = mark_keep_in_fp32(nn.Parameter(torch.full((1,), alpha, dtype=torch.float32)))
        self.bias = mark_keep_in_fp32(nn.Parameter(torch.zeros(n * n + 2 * n, dtype=torch.float32)))
        if config.perform_initialization:   # off: a checkpoint fills it (build_model(initialize=False))
            with torch.no_grad():
                config.init_method(self.mapping_proj.weight)

    def alphas(self) -> torch.Tensor:
        """``[3]`` = ``[alpha_pre, alpha_post, alpha_res]`` (the official ``hc_*_scale`` packing)."""
        return torch.cat((self.alpha_pre, self.alpha_post, self.alpha_res))

    def pre(self, streams: torch.Tensor):
        """``streams [S,B,n,C]`` -> ``(layer_in [S,B,C], post [S,B,n], comb [S,B,n,n])``."""
        c = self.config
        return self.ops.hc_pre(streams, self.mapping_proj.weight, self.alphas(), self.bias,
                               c.layernorm_epsilon, mhc_eps(c), c.mhc_sinkhorn_iterations)

    def post(self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """``x'_j = post_j out + sum_i comb[i, j] x_i``."""
        return self.ops.hc_post(out, streams, post, comb)


def register_head_params(module: nn.Module, config) -> None:
    """Block exit parameters ``hc_head_fn [n, n*C]``, ``hc_head_base [n]``, ``hc_head_scale [1]`` (fp32),
    registered directly on ``module`` (the decoder / an MTP layer), as in the native names."""
    n, c = config.num_residual_streams, config.hidden_size
    module.hc_head_fn = mark_keep_in_fp32(nn.Parameter(torch.empty(n, n * c, dtype=torch.float32)))
    module.hc_head_base = mark_keep_in_fp32(nn.Parameter(torch.zeros(n, dtype=torch.float32)))
    module.hc_head_scale = mark_keep_in_fp32(nn.Parameter(torch.ones(1, dtype=torch.float32)))
    if config.perform_initialization:
        with torch.no_grad():
            config.init_method(module.hc_head_fn)


def apply_head(module: nn.Module, streams: torch.Tensor, config, ops) -> torch.Tensor:
    """``out = sum_i (sigmoid(scale * r * (fn @ x) + base) + eps)_i x_i``: ``[S,B,n,C] -> [S,B,C]``."""
    return ops.hc_head(streams, module.hc_head_fn, module.hc_head_scale, module.hc_head_base,
                       config.layernorm_epsilon, mhc_eps(config))
