"""DeepSeek-V4 MoE on megatron-core tensor-parallel building blocks.

Native names (``core.weight_contract``), relative to the block's ``mlp.``:

* ``router.weight [E, d]``; ``router.expert_bias [E]`` fp32 **buffer** (learned layers) or
  ``router.tid2eid [vocab, k]`` int64 **frozen nn.Parameter** (``requires_grad=False``; hash
  layers; a parameter so that weight sync, which reads parameters, publishes it);
* ``experts.linear_fc1.weight{e} [2I, d]`` = cat(gate, up), ``experts.linear_fc2.weight{e} [d, I]``;
* ``shared_experts.linear_fc1.weight [2I, d]`` (megatron ColumnParallelLinear),
  ``shared_experts.linear_fc2.weight [d, I]`` (megatron RowParallelLinear).

Math (reuses ``kernels.reference.moe.route`` / ``swiglu``)::

    s = sqrt(softplus(x W_r^T))            fp32
    idx = tid2eid[token]  (hash)  |  topk(s + expert_bias)  (bias for selection only)
    w = s[idx] / sum(s[idx]) * route_scale
    y = sum_k w_k * fc2_e(swiglu_clamped(fc1_e x)) + shared(x)     (shared clamp per config switch)

Dispatch: the ``T*k`` (token, slot) assignments are sorted by expert and every expert's rows run as one
group of a grouped GEMM (``torch._grouped_mm`` for bf16; a per-expert loop for fp32 / fp64 test models),
with no host synchronisation; an expert no token chose gets an exact-zero gradient (as in megatron's
grouped GEMM), not ``None``.

Routing seam (R3 record / replay, ``rollout.replay``): a learned-routing TRUNK layer's top-k ``idx``
goes through :func:`kernels.reference.moe.apply_routing_hook` at the same point as the reference
``Gate`` (after selection, before the weights are gathered), so a replayed pick gets this forward's
score as its weight. Hash layers (``tid2eid``) and MTP routers (``layer_id >= n_layers``) never do.

Tensor parallelism (megatron's expert-TP = TP layout): every expert's ffn dim is split over the TP
ranks (fc1 per half, fc2 along its input); the router is replicated. Inputs and routing weights
enter through ``copy_to_tensor_model_parallel_region`` (gradients all-reduced), the routed sum
leaves through ``reduce_from_tensor_model_parallel_region``.

Expert parallelism (``engine.expert_parallel``, megatron's expert-model-parallel group, TP 1): rank ``r``
holds experts ``[r*L, (r+1)*L)`` under their global names; assignments travel to their expert's rank and
back by an autograd-aware all-to-all. Routing stays on the token's own rank (replay and hash tables apply
unchanged), and with one rank the path is exactly the single-rank one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import wgrad
from kernels.reference.layers import compute_dtype
from kernels.reference.moe import route, row_invariant_active, row_invariant_mix, swiglu, weighted_swiglu
from kernels.reference.stacks import stacked_view

from .layers import KeepFP32Module, init_normal_, row_parallel_linear
from .layout import current as parallel_layout
from .permute import expand_to_slots, inverse_permutation, permute_rows
from .runtime import ensure_megatron
from .tp import mark_keep_in_fp32, mark_tp

__all__ = ["DSv4Router", "DSv4GroupedExperts", "DSv4SharedExperts", "DSv4MoE", "grouped_linear"]


class DSv4Router(KeepFP32Module):
    """Top-k router: sqrt(softplus) (or the config's score function) scores, expert bias for
    selection (learned layers) or the frozen ``tid2eid`` table (hash layers). ``layer_id``: the
    block's layer (``n_layers + k`` for MTP layer ``k``); ``replayable`` (a learned trunk layer) routers
    pass their picks through the routing seam."""

    def __init__(self, model_config, hash_layer: bool, params_dtype=torch.float32, std: float | None = 0.02,
                 layer_id: int | None = None):
        super().__init__()
        c = model_config
        self.topk, self.score_func, self.route_scale = c.n_activated_experts, c.score_func, c.route_scale
        self.hash = bool(hash_layer)
        self.layer_id = layer_id
        self.replayable = (not self.hash) and layer_id is not None and layer_id < c.n_layers
        self.weight = nn.Parameter(init_normal_(torch.empty(c.n_routed_experts, c.dim, dtype=params_dtype), std))
        if self.hash:
            self.tid2eid = nn.Parameter(
                torch.arange(c.vocab_size * self.topk, dtype=torch.int64).view(c.vocab_size, self.topk)
                % c.n_routed_experts, requires_grad=False)
        else:
            self.register_buffer("expert_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32))
            mark_keep_in_fp32(self.expert_bias)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None):
        """``x [T, d]`` -> ``(weights [T, k] fp32, indices [T, k] long)``; the reference routing decision."""
        return route(self, x, input_ids, None if self.hash else self.expert_bias)


class _WeightBank(nn.Module):
    """Holds ``weight{first} .. weight{first+n-1}`` (megatron's grouped-GEMM naming, global expert ids; under
    expert parallelism ``first`` is this rank's first expert). ``bank[i]`` is the ``i``-th LOCAL expert.

    The experts are views of ONE ``[n, *shape]`` buffer, registered from the last to the first: megatron-core's
    DDP lays parameters out in reverse registration order, so in its buffer too the bank's experts lie one after
    another in expert order. :meth:`stacked` then hands the grouped GEMM that memory as ``[n, *shape]`` without a
    copy (and a rollout engine sharing the trainer's weights reads the same memory, ``rollout.shared_weights``);
    when a move split them apart (``module.to`` moves each parameter on its own), it stacks a copy as before."""

    def __init__(self, n: int, shape, dtype, tp_dim: int, tp_chunks: int, std: float | None, first: int = 0):
        super().__init__()
        self.n, self.first = n, first
        bank = torch.empty(n, *shape, dtype=dtype)
        for i in range(n):             # one draw per expert, in expert order (the random init of a separate tensor each)
            init_normal_(bank[i], std)
        for i in reversed(range(n)):
            p = nn.Parameter(bank[i])
            mark_tp(p, tp_dim, tp_chunks)
            p.expert_parallel = True   # not replicated over the EP group: never averaged across it
            self.register_parameter(f"weight{first + i}", p)
        # the parameter objects in expert order (read every forward; a module's getattr is slow) and the last
        # stack view with the addresses it was made for (a moved expert shows another address)
        self._experts = tuple(self[i] for i in range(n))
        self._view = (None, None)
        # wgrad_fusion (engine.wgrad_fusion.enable): the bank's weight gradient goes straight into its fp32 buffers,
        # seen as one tensor
        self.wgrad_fused = False
        self._main_view = None

    def __getitem__(self, i: int) -> torch.Tensor:
        return getattr(self, f"weight{self.first + i}")

    def experts(self) -> list:
        return list(self._experts)

    def stacked(self) -> torch.Tensor:
        """``[n, *shape]``: the experts' own memory when they lie one after another (no copy; gradients flow
        to each ``weight{e}``), else ``torch.stack`` of them (a copy)."""
        experts = self._experts
        if torch.compiler.is_compiling():
            # Dynamo cannot trace the address check (data_ptr arithmetic: a graph break per bank, 11 in the tiny
            # model); a compiled block stacks the experts (a copy, but never a stale view)
            return torch.stack(experts)
        addresses = [p.data_ptr() for p in experts]
        if self._view[0] != addresses:
            view = stacked_view(experts)
            self._view = (addresses, None if view is None else view.detach())
        view = self._view[1]
        if view is not None:
            return _StackedExperts.apply(view, *experts)
        return torch.stack(experts)


    def fused_wgrad(self, x: torch.Tensor):
        """``(weights [n, *shape], fp32 gradient buffer [n, *shape])`` when the bank's weight gradient can go
        straight into its buffer (:class:`_FusedWgradGroupedLinear`), else None: the trainer turned the fusion on
        (``wgrad_fused``), eager with gradients, bf16 ``x``, and both the weights and their buffers lie one after
        another (megatron-core's DDP lays the bank's buffers out in expert order). Read after :meth:`stacked`, whose
        view of the weights it hands on."""
        experts = self._experts
        if not self.wgrad_fused or torch.compiler.is_compiling() or not torch.is_grad_enabled() \
                or x.dtype != experts[0].dtype or not experts[0].requires_grad:
            return None
        if self._main_view is None:
            self._main_view = stacked_view([p.main_grad for p in experts])
        view = self._view[1]
        if view is None or self._main_view is None:
            return None
        return view, self._main_view


class _FusedWgradGroupedLinear(torch.autograd.Function):
    """:func:`grouped_linear` whose backward writes the weight gradient of every expert straight into the bank's
    fp32 buffer (``kernels.wgrad.grouped_wgrad_gemms``: a mixed-dtype cuBLAS GEMM per expert over the row counts,
    copied to the host during the forward so that the backward does not wait), stored at a step's first
    micro-batch and added after, instead of a bf16 gradient per expert cast in by the DDP hook; the experts get
    markers (``kernels.wgrad.added_marker``). The input gradient is the grouped GEMM's as before."""

    @staticmethod
    def forward(ctx, x, ends, view, main, *experts):
        ctx.save_for_backward(x, ends)
        ctx.view, ctx.main, ctx.experts = view, main, experts
        ctx.host_ends = torch.empty(ends.shape, dtype=ends.dtype, pin_memory=ends.is_cuda)
        ctx.host_ends.copy_(ends, non_blocking=True)        # long done when the backward reads it
        ctx.copied = torch.cuda.Event() if ends.is_cuda else None
        if ctx.copied is not None:
            ctx.copied.record()
        return grouped_linear(x, view, ends)

    @staticmethod
    def backward(ctx, g):
        x, ends = ctx.saved_tensors
        g = g.contiguous()
        dx = grouped_linear(g, ctx.view.transpose(1, 2), ends) if ctx.needs_input_grad[0] else None
        overwrite = wgrad.claim_all([p.main_grad for p in ctx.experts])
        if ctx.copied is not None:
            ctx.copied.synchronize()
        wgrad.grouped_wgrad_gemms(ctx.main, x, g, [0] + ctx.host_ends.tolist(), not overwrite)
        return (dx, None, None, None, *(wgrad.added_marker(p, g.dtype) for p in ctx.experts))


def _bank_linear(bank: _WeightBank, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``grouped_linear(x, w, ends)`` with ``w`` the bank's stacked weights; the weight gradient fused into the
    bank's fp32 buffer where :meth:`_WeightBank.fused_wgrad` allows."""
    fused = bank.fused_wgrad(x) if w.dtype == x.dtype else None
    if fused is None:
        return grouped_linear(x, w.to(x.dtype), ends)
    view, main = fused
    return _FusedWgradGroupedLinear.apply(x.contiguous(), ends, view, main, *bank.experts())


class _StackedExperts(torch.autograd.Function):
    """The experts' memory seen as one ``[n, *shape]`` tensor (``view``, made by ``stacked_view``: no copy); the
    gradient of the stack goes back to each expert as its slice."""

    @staticmethod
    def forward(ctx, view, *experts):
        return view.view_as(view)

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.unbind(0))


class DSv4GroupedExperts(nn.Module):
    """Routed SwiGLU experts with the asymmetric clamp (``activation_func_clamp_value``)."""

    def __init__(self, model_config, params_dtype=torch.float32, std: float | None = 0.02, ops=None):
        super().__init__()
        c = model_config
        self.ops = ops                  # the run's kernel ops (``weighted_swiglu``); None: the reference op
        layout = parallel_layout()
        tp, ep = layout.tp, layout.ep
        if c.moe_inter_dim % tp:
            raise ValueError(f"moe_inter_dim {c.moe_inter_dim} is not divisible by tp={tp}")
        if c.n_routed_experts % ep:
            raise ValueError(f"n_routed_experts {c.n_routed_experts} is not divisible by ep={ep}")
        if ep > 1 and tp > 1:
            raise ValueError(f"expert parallelism runs with tensor parallel 1 (got tp={tp}, ep={ep})")
        self.limit = c.swiglu_limit
        self.ep = ep
        self.num_local_experts = c.n_routed_experts // ep
        first = parallel_layout().ep_rank * self.num_local_experts
        inter = c.moe_inter_dim // tp
        self.linear_fc1 = _WeightBank(self.num_local_experts, (2 * inter, c.dim), params_dtype, 0, 2, std, first)
        self.linear_fc2 = _WeightBank(self.num_local_experts, (c.dim, inter), params_dtype, 1, 1, std, first)

    # QAT switch (``converters.schemes.QATScheme.install``): None = high precision (default);
    # "mxfp4" / "nvfp4" = the forward sees quantize-dequantized expert weights, straight-through grads.
    qat_expert_format = None

    def expert_weights(self, e: int):
        """``(fc1 [2I, d], fc2 [d, I])`` of expert ``e`` as the forward uses them (fake-quantized under QAT).

        MXFP4: 1x32 ue8m0 blocks along the input dim, so fc1 = cat(gate, up) is quantized exactly as gate and
        up each on their own (no block spans both). NVFP4: gate and up share one global amax
        (``fake_quant_nvfp4_pair``; under TP > 1 that amax is this rank's slice's), fc2 its own."""
        w1, w2 = self.linear_fc1[e], self.linear_fc2[e]
        fmt = self.qat_expert_format
        if fmt is None:
            return w1, w2
        from converters import fake_quant as fq

        if fmt == "mxfp4":
            return fq.fake_quant_mxfp4(w1), fq.fake_quant_mxfp4(w2)
        if fmt == "nvfp4":
            gate, up = fq.fake_quant_nvfp4_pair(*w1.chunk(2, dim=0))
            return torch.cat((gate, up), dim=0), fq.fake_quant_nvfp4(w2)
        raise ValueError(f"unknown QAT expert format {fmt!r} (mxfp4 | nvfp4)")

    def stacked_weights(self):
        """``(fc1 [E, 2I, d], fc2 [E, d, I])``: every expert's forward weights stacked for the grouped GEMM
        (the bank's own memory, no copy, where the experts lie one after another: ``_WeightBank.stacked``; a
        copy under QAT, whose forward weights are computed); gradients flow back to each ``weight{e}``."""
        if self.qat_expert_format is None:
            return self.linear_fc1.stacked(), self.linear_fc2.stacked()
        pairs = [self.expert_weights(e) for e in range(self.num_local_experts)]
        return torch.stack([w1 for w1, _ in pairs]), torch.stack([w2 for _, w2 in pairs])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``x [T, d]``, ``weights / idx [T, k]`` -> ``[T, d]`` in compute dtype (TP-reduced).

        Dropless: the ``T*k`` (token, slot) assignments are sorted by expert, every expert's rows run as one
        group of a grouped GEMM (:func:`grouped_linear`), and the results go back to (token, slot) order and
        are summed over the slots. Free of host synchronisation without expert parallelism; with it, the rows
        travel to their expert's rank and back (``engine.expert_parallel.ExpertDispatch``)."""
        ensure_megatron()
        from megatron.core.tensor_parallel import mappings

        if row_invariant_active():
            return self._row_invariant(x, weights, idx)
        tp = parallel_layout().tp
        if tp > 1:
            x = mappings.copy_to_tensor_model_parallel_region(x, parallel_layout().group("tp"))
            weights = mappings.copy_to_tensor_model_parallel_region(weights, parallel_layout().group("tp"))
        ct = compute_dtype(x)
        T, k = idx.shape
        experts, order = idx.reshape(-1).sort(stable=True)      # assignments grouped by expert
        inv = inverse_permutation(order)
        rows = expand_to_slots(x, order, inv, k)                # gathers both ways (engine.permute)
        gate_w = permute_rows(weights.reshape(-1), order, inv)
        dispatch = None
        if self.ep > 1:
            from .expert_parallel import ExpertDispatch

            dispatch = ExpertDispatch(experts, self.num_local_experts, parallel_layout().group("ep"))
            experts, rows, gate_w = dispatch.local_experts, dispatch.scatter(rows), dispatch.scatter(gate_w)
        ends = torch.searchsorted(experts, torch.arange(self.num_local_experts, device=idx.device), right=True)
        w1, w2 = self.stacked_weights()
        fuse = self.qat_expert_format is None                   # QAT's forward weights are computed, not the bank's
        h = _bank_linear(self.linear_fc1, rows, w1, ends) if fuse else grouped_linear(rows, w1.to(x.dtype), ends)
        act = weighted_swiglu if self.ops is None else self.ops.weighted_swiglu
        a = act(h, gate_w, self.limit, x.dtype)                 # clamped SwiGLU x gate weight, in x's dtype
        out = (_bank_linear(self.linear_fc2, a, w2, ends) if fuse else grouped_linear(a, w2.to(x.dtype), ends)).to(ct)
        if dispatch is not None:
            out = dispatch.gather(out)
        y = permute_rows(out, inv, order).view(T, k, -1).sum(dim=1)      # back to (token, slot) order
        if tp > 1:
            y = mappings.reduce_from_tensor_model_parallel_region(y, parallel_layout().group("tp"))
        return y

    def _row_invariant(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Inside :func:`kernels.reference.moe.row_invariant_experts`: every expert over ALL ``T`` rows (weight 0
        where a row does not pick it), its result added to the rows that picked it, experts in id order. The
        GEMMs' shapes are then ``[T, d]`` whatever the routing, so a token's output depends on its own row and
        ``T`` only (``true_on_policy``: the rollout's forward over a prefix padded with stop tokens and the
        trainer's over the sampled sequence agree bit for bit), where the grouped GEMM's groups follow the
        routing of every token. One rank only (no tensor or expert parallelism: their collectives would mix the
        rows again); costs ``n_routed_experts / n_activated_experts`` times the routed FLOPs."""
        tp = parallel_layout().tp
        if self.ep > 1 or tp > 1:
            raise NotImplementedError(f"row-invariant experts (true_on_policy) run on one rank, not tp={tp} "
                                      f"ep={self.ep}")
        act = weighted_swiglu if self.ops is None else self.ops.weighted_swiglu    # elementwise: row-invariant

        def expert(e, w):
            w1, w2 = self.expert_weights(e)
            a = act(F.linear(x, w1.to(x.dtype)), w, self.limit, x.dtype)
            return F.linear(a, w2.to(x.dtype))

        return row_invariant_mix(x, weights, idx, self.num_local_experts, expert)


def _grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bf16 (its only dtype on CUDA and under
    ``torch.compile``), rows of 16-byte multiples. Other dtypes (fp32 / fp64 test models) run the loop."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    return (w.shape[1] * 2) % 16 == 0 and (w.shape[2] * 2) % 16 == 0


def grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` whose rows ``ends[e-1]:ends[e]`` belong to group ``e`` -> ``x_rows @ w[e]^T`` ``[N, out]``
    (``w [E, out, in]``). One grouped GEMM (``torch._grouped_mm``, no host sync) where supported, else a
    loop over the groups (reads ``ends`` on the host)."""
    if _grouped_mm_supported(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    return _per_group_linear(x, w, ends)


@torch.compiler.disable
def _per_group_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The loop fallback of :func:`grouped_linear`; it reads ``ends`` on the host, so compiled code calls it
    eagerly (one graph break instead of a recompilation per group layout)."""
    bounds = [0] + ends.tolist()
    return torch.cat([F.linear(x[s:e], w[g]) for g, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))], dim=0)


class DSv4SharedExperts(nn.Module):
    """The shared SwiGLU expert: megatron Column/RowParallelLinear; clamped only when the
    config's ``activation_func_clamp_shared_expert`` switch is on."""

    def __init__(self, model_config, tconfig, std: float | None = 0.02):
        super().__init__()
        ensure_megatron()
        from megatron.core import tensor_parallel

        c = model_config
        init = lambda w: torch.nn.init.normal_(w, 0.0, std)  # noqa: E731
        inter = c.moe_inter_dim * c.n_shared_experts
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            c.dim, 2 * inter, config=tconfig, init_method=init, bias=False, gather_output=False,
            tp_group=parallel_layout().group("tp"))
        self.linear_fc2 = row_parallel_linear(
            inter, c.dim, config=tconfig, init_method=init, bias=False, input_is_parallel=True,
            skip_bias_add=False, tp_group=parallel_layout().group("tp"))
        mark_tp(self.linear_fc1.weight, 0, 2)  # rank slice of gate and of up
        mark_tp(self.linear_fc2.weight, 1, 1)
        clamp = getattr(tconfig, "activation_func_clamp_shared_expert", c.shared_expert_clamp)
        self.limit = c.swiglu_limit if clamp else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = compute_dtype(x)
        h, _ = self.linear_fc1(x)
        gate, up = h.to(ct).chunk(2, dim=-1)
        out, _ = self.linear_fc2(swiglu(gate, up, self.limit).to(x.dtype))
        return out


class DSv4MoE(nn.Module):
    """``mlp``: ``router``, ``experts``, ``shared_experts``. ``forward(x [..., d], input_ids [...])``.
    ``std=None`` (with ``tconfig.perform_initialization`` off): the weights are not drawn, a checkpoint fills
    them; ``tid2eid`` and ``expert_bias`` are computed still (cheap)."""

    def __init__(self, model_config, tconfig, layer_id: int, params_dtype=torch.float32, std: float | None = 0.02,
                 ops=None):
        super().__init__()
        c = model_config
        if c.n_shared_experts != 1:
            raise ValueError("DeepSeek-V4 has exactly one shared expert")
        self.layer_id = layer_id
        self.router = DSv4Router(c, c.is_hash_layer(layer_id), params_dtype, std, layer_id=layer_id)
        self.experts = DSv4GroupedExperts(c, params_dtype, std, ops)
        self.shared_experts = DSv4SharedExperts(c, tconfig, std)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.router(x, input_ids)
        ct = compute_dtype(x)
        y = self.experts(x, weights, idx) + self.shared_experts(x).to(ct)
        return y.to(x.dtype).view(shape)
