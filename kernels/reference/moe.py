"""MoE of DeepSeek-V4: sqrt(softplus) router, hash routing, clamped SwiGLU experts.

    s = sqrt(softplus(W_g x))  (fp32)                 ("softmax" / "sigmoid" also supported)
    learned layers: idx = topk_k(s + bias)            (bias [E] only for SELECTION; a buffer)
    hash layers:    idx = tid2eid[token_id]           (frozen table; weights still come from s)
    w = s[idx] / sum s[idx] * route_scale
    expert(x) = w2( silu(min(w1 x, L)) * clamp(w3 x, -L, L) )      (L = swiglu_limit; no clamp if L <= 0)
    y = sum_k w_k expert_k(x) + shared(x)             (shared clamped too unless shared_expert_clamp=False)

Routing seam (R3 routing record / replay; used by ``rollout.replay``): :func:`routing_hook` installs, for
the current context, ``hook(layer_id, idx [T,k]) -> idx [T,k]``. It is called with the top-k expert
indices of LEARNED-routing trunk layers only (``Gate.replayable``): hash layers (``tid2eid``) and MTP
routers (``layer_id >= n_layers``) never reach it. A recorder returns ``idx`` unchanged; a replayer
returns the recorded indices, so the weights come from this forward's scores at the replayed experts
(gradients flow through the scores as usual). No hook installed = unchanged behaviour. Other
implementations call :func:`apply_routing_hook` at the same point of their routers.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .layers import KeepFP32, Linear, compute_dtype
from .seam import HookSeam

__all__ = ["swiglu", "route_scores", "select_experts", "route", "route_experts", "Gate", "Expert", "MoE",
           "routing_hook", "apply_routing_hook", "current_routing_hook", "row_invariant_experts",
           "row_invariant_active", "row_invariant_mix", "inference_experts"]

_ROUTING = HookSeam("dsv4_routing_hook")
_ROW_INVARIANT = HookSeam("dsv4_row_invariant_experts")
_INFERENCE = HookSeam("dsv4_inference_experts")


def inference_experts(fn):
    """Within this context :meth:`MoE.forward` first offers its input to ``fn(moe, x, input_ids)``, which returns
    the layer's output or None (not taken: the loop over the experts runs). The rollout engine's prefill runs the
    experts as one grouped GEMM without host syncs this way (``kernels.reference.slots.prefill_experts``), where
    the loop below syncs the host for every expert."""
    return _INFERENCE.installed(fn)


def row_invariant_experts():
    """Within this context :meth:`MoE.forward` runs every routed expert over ALL the rows it is given (weight 0
    where a row does not pick it) instead of over the gathered rows that pick it, so the GEMM shapes do not
    depend on the routing of the other tokens, and a token's output is a function of its own row and the
    input's shape only (``true_on_policy``: the engine's forward over a padded prefix and the trainer's over
    the sampled sequence then agree bit for bit). Costs ``n_routed_experts / n_activated_experts`` times the
    routed experts' FLOPs."""
    return _ROW_INVARIANT.installed(True)


def row_invariant_active() -> bool:
    """Whether :func:`row_invariant_experts` is in force here (``engine.moe.DSv4GroupedExperts`` reads it too)."""
    return bool(_ROW_INVARIANT.current())


def row_invariant_mix(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, n_experts: int,
                      expert) -> torch.Tensor:
    """The routed experts' sum in the row-invariant mode (:func:`row_invariant_experts`), shared by this
    module's :class:`MoE` and ``engine.moe.DSv4GroupedExperts``: ``expert(e, w [T])`` runs expert ``e`` over ALL
    ``T`` rows of ``x`` (weight ``w``, 0 where a row did not pick it) and its result is added to the rows that
    picked it, experts in id order. Returns ``[T, d]`` in the compute dtype."""
    ct = compute_dtype(x)
    y = torch.zeros(x.shape, dtype=ct, device=x.device)
    for e in range(n_experts):
        pick = idx == e
        tok = torch.where(pick.any(-1))[0]
        if len(tok):
            w = torch.where(pick, weights, torch.zeros_like(weights)).sum(-1)   # one nonzero term: exact
            y = y.index_add(0, tok, expert(e, w)[tok].to(ct))
    return y


def routing_hook(hook):
    """Install ``hook(layer_id, idx) -> idx`` for learned-routing trunk layers in this context."""
    return _ROUTING.installed(hook)


def current_routing_hook():
    """The routing hook installed in this context, or None (activation recomputation replays through it)."""
    return _ROUTING.current()


def apply_routing_hook(layer_id: int, idx: torch.Tensor) -> torch.Tensor:
    """The seam: pass a learned trunk layer's top-k ``idx [T,k]`` through the installed hook (if any)."""
    hook = _ROUTING.current()
    return idx if hook is None else hook(layer_id, idx)


def swiglu(g: torch.Tensor, v: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(g) * v`` with the asymmetric clamp: ``g <= limit`` (no lower bound), ``|v| <= limit``."""
    if limit > 0:
        g = g.clamp(max=limit)
        v = v.clamp(min=-limit, max=limit)
    return F.silu(g) * v


def weighted_swiglu(h: torch.Tensor, w: torch.Tensor, limit: float, out_dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
    """The routed experts' activation: ``swiglu(gate, up, limit) * w`` of the first GEMM's output
    ``h = [gate | up]`` ``[N, 2F]`` with one gate weight per row ``w [N]``, in the compute dtype (fp32 for
    bf16 ``h``), cast to ``out_dtype`` when given (the second GEMM's input)."""
    ct = compute_dtype(h)
    gate, up = h.to(ct).chunk(2, dim=-1)
    a = swiglu(gate, up, limit) * w.to(ct).unsqueeze(-1)
    return a if out_dtype is None else a.to(out_dtype)


def route_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"unknown score_func {score_func!r}")


def _has_negative_ids(tid2eid: torch.Tensor) -> bool:
    """Whether a hash table holds negative ids. Checked once per version of the table (on a GPU the
    check is a host sync), not on every forward; compiled code skips it (it cannot branch on data)."""
    version = (tid2eid.data_ptr(), tid2eid._version)
    if getattr(tid2eid, "_dsv4_checked_version", None) == version:
        return False
    if bool((tid2eid < 0).any()):
        return True
    tid2eid._dsv4_checked_version = version
    return False


def select_experts(scores: torch.Tensor, *, topk: int, route_scale: float, score_func: str,
                   tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, replay_layer: int | None = None):
    """The routing decision shared by every implementation: ``(weights [T,k] fp32, indices [T,k])``.

    Hash layers (``tid2eid`` given) take the experts from the token id; learned layers take the
    top-k of ``scores + bias`` (the bias only selects). ``replay_layer`` routes the learned choice
    through the routing-replay hook. The weights always come from the gate scores at the chosen
    experts, renormalized (unless softmax) and scaled by ``route_scale``.
    """
    if tid2eid is not None:
        if input_ids is None:
            raise ValueError("hash-routed MoE layer needs input_ids")
        idx = tid2eid[input_ids.reshape(-1)].long()
        if not torch.compiler.is_compiling() and _has_negative_ids(tid2eid):
            raise ValueError("tid2eid holds negative expert ids (table not loaded?)")
    else:
        idx = (scores + bias.to(scores.dtype)).topk(topk, dim=-1).indices
        if replay_layer is not None:
            idx = apply_routing_hook(replay_layer, idx)
    w = scores.gather(-1, idx)
    if score_func != "softmax":
        w = w / w.sum(dim=-1, keepdim=True)
    return w * route_scale, idx


def route(router: nn.Module, x: torch.Tensor, input_ids: torch.Tensor | None, bias: torch.Tensor | None,
          replay: bool = True):
    """A router's forward, shared by the reference Gate and the megatron-core router: gate scores
    from ``router.weight``, then :func:`select_experts` with the router's settings (``topk``,
    ``route_scale``, ``score_func``, ``hash``/``tid2eid``, ``replayable``/``layer_id``). ``replay=False``
    skips the routing seam (the static decode step, which refuses an installed hook: its compiled layer
    then does not depend on the layer's id)."""
    ct = compute_dtype(x)
    scores = route_scores(F.linear(x.to(ct), router.weight.to(ct)), router.score_func)
    return select_experts(
        scores,
        topk=router.topk,
        route_scale=router.route_scale,
        score_func=router.score_func,
        tid2eid=router.tid2eid if router.hash else None,
        input_ids=input_ids,
        bias=bias,
        replay_layer=router.layer_id if (replay and router.replayable and not router.hash) else None,
    )


def route_experts(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None,
                  ids: torch.Tensor | None, topk: int, route_scale: float, score_func: str):
    """The ``route_experts`` op's torch contract (the GPU backends' one-launch router of the eager decode step,
    ``kernels/triton/routing.py``): :func:`route` of the router weight ``w`` with a learned layer's ``bias`` or a
    hash layer's ``table`` (``tid2eid``) at the tokens ``ids``, without the routing seam -> ``(weights, idx)``."""
    router = types.SimpleNamespace(weight=w, score_func=score_func, topk=topk, route_scale=route_scale,
                                   hash=table is not None, tid2eid=table, replayable=False, layer_id=None)
    return route(router, x, ids, bias, replay=False)


class Gate(KeepFP32):
    """``ffn.gate``: ``weight [E, d]``; ``bias [E]`` fp32 persistent buffer (learned layers) or
    ``tid2eid [vocab, k]`` int64 frozen Parameter (hash layers). ``replayable``: a learned-routing trunk
    layer (its top-k goes through the routing seam; hash layers and MTP routers never do)."""

    _fp32_names = ("bias",)

    def __init__(self, config, hash_layer: bool, layer_id: int | None = None):
        super().__init__()
        c = config
        self.topk, self.score_func, self.route_scale = c.n_activated_experts, c.score_func, c.route_scale
        self.hash = hash_layer
        self.layer_id = layer_id
        self.replayable = (not hash_layer) and layer_id is not None and layer_id < c.n_layers
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.dim))
        if hash_layer:
            self.tid2eid = nn.Parameter(torch.zeros(c.vocab_size, c.n_activated_experts, dtype=torch.int64),
                                        requires_grad=False)
        else:
            self.register_buffer("bias", torch.zeros(c.n_routed_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None):
        """``x [T,d]`` -> ``(weights [T,k] fp32, indices [T,k] long)``."""
        return route(self, x, input_ids, None if self.hash else self.bias)


class Expert(nn.Module):
    """SwiGLU expert ``w1`` (gate), ``w3`` (up), ``w2`` (down) with the asymmetric clamp."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float):
        super().__init__()
        self.limit = swiglu_limit
        self.w1 = Linear(dim, inter_dim)
        self.w2 = Linear(inter_dim, dim)
        self.w3 = Linear(dim, inter_dim)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        ct = compute_dtype(x)
        hid = swiglu(self.w1(x).to(ct), self.w3(x).to(ct), self.limit)
        if weights is not None:
            hid = hid * weights.to(ct).unsqueeze(-1)  # routing weight applied before w2 (fp32)
        return self.w2(hid.to(x.dtype))


class MoE(nn.Module):
    """``ffn``: ``gate``, ``experts.E`` and ``shared_experts`` (one shared expert)."""

    # a kernel op table (kernels.reference.model.ops_in_use): the decode step's grouped experts take its
    # weighted_swiglu, and its experts_grouped_mm where it has one (kernels.reference.slots); the forward here
    # never reads it
    ops = None

    def __init__(self, config, layer_id: int):
        super().__init__()
        c = config
        if c.n_shared_experts != 1:
            raise ValueError("DeepSeek-V4 has exactly one shared expert")
        self.gate = Gate(c, hash_layer=c.is_hash_layer(layer_id), layer_id=layer_id)
        self.experts = nn.ModuleList(Expert(c.dim, c.moe_inter_dim, c.swiglu_limit)
                                     for _ in range(c.n_routed_experts))
        self.shared_experts = Expert(c.dim, c.moe_inter_dim, c.swiglu_limit if c.shared_expert_clamp else 0.0)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        offered = _INFERENCE.current()
        if offered is not None and not _ROW_INVARIANT.current():
            y = offered(self, x, input_ids)
            if y is not None:
                return y
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x, input_ids)
        ct = compute_dtype(x)
        y = torch.zeros(x.shape, dtype=ct, device=x.device)
        if _ROW_INVARIANT.current():            # every expert over every row (row_invariant_experts)
            y = row_invariant_mix(x, weights, idx, len(self.experts), lambda e, w: self.experts[e](x, w))
            y = y + self.shared_experts(x).to(ct)
            return y.to(x.dtype).view(shape)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            y.index_add_(0, tok, self.experts[e](x[tok], weights[tok, slot]).to(ct))
        y = y + self.shared_experts(x).to(ct)
        return y.to(x.dtype).view(shape)
