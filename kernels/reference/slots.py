"""A decode step with static shapes and no host synchronisation, so that a CUDA graph can record it.

:func:`kernels.reference.decode.decode_step` is exact but dynamic: finished rows leave the batch, the rows
that complete a compressor block are found from host positions, and the reference MoE loops over the experts
that were hit (``torch.unique(...).tolist()``, a host sync per layer). None of that can be replayed from a
CUDA graph, whose shapes, launches and addresses are fixed at capture. This module keeps the same math with
fixed shapes:

* :class:`SlotCache`: the caches of a fixed number of slots ``M`` (each tensor ``[M, ...]``, allocated
  once), with the positions ``pos [M]`` on the device. A prefill's :class:`~kernels.reference.decode.DecodeCache`
  rows are copied into free slots in place (:meth:`SlotCache.load`), rows move between slots in place
  (:meth:`SlotCache.move`), so every address a graph recorded stays valid;
* :func:`static_decode_step` feeds one token to each of the first ``b`` slots; inactive slots (``active``
  False) run too and do not advance (a slot's garbage stays in its own rows: every op is per row);
* compressor blocks: every row's entry is pooled each step and written only where the token completes a
  block (``torch.where`` on device positions), instead of selecting the completing rows on the host;
* the MoE (:func:`moe_decode`) reads each layer's experts as one stacked tensor (:func:`stack_expert_weights`
  re-points the expert parameters into it, so weight updates still land there): on CUDA in bf16, the
  (token, expert) assignments are sorted by expert and run as ``torch._grouped_mm`` with device offsets
  ("grouped"); elsewhere every expert runs on every token as one batched matmul, weighted 0 where it was not
  picked ("dense": ``E / k`` times the routed work, meant for small models and the CPU).

The step is two parts: :func:`static_step_checks` (host-side: refusals, each layer's MoE path, RoPE frequencies
put on the device once) and :func:`static_step_body` (the device work, plain tensor code that ``torch.compile``
can trace whole: no pointer reads, no device queries, no Python state changed).

The step returns the fp32 logits ``[b, V]`` and the learned-routing layers' experts ``[b, layers, k]`` (the
routing seam is not consulted: a replay hook cannot be recorded into a graph, so an installed one is
refused); with ``indexer_picks=True`` also each CSA layer's indexer top-k ``[b, n_csa, index_topk]`` (long,
``-1`` padded; what indexer replay records, an output like the routes). As in
:func:`~kernels.reference.decode.decode_step`, the indexer-replay seam is not consulted, and the
kernel ops are those of the model's modules (``kernels.reference.model.ops_in_use``; the reference functions by
default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .compressor import Compressor, hadamard_transform
from .decode import (CompressorCache, DecodeCache, LayerCache, _attend, angle_table, device_inv_freq,
                     eager_linear, eager_op, pool_slots, projected, step_once, table_angles, to_device)
from .layers import compute_dtype, linear_fp32
from .mhc import hc_post
from .moe import _has_negative_ids, current_routing_hook, route, swiglu, weighted_swiglu
from .rope import apply_rope, rope_cos_sin
from .stacks import stacked_view

__all__ = ["SlotCache", "stack_expert_weights", "moe_decode", "moe_decode_path", "prefill_experts",
           "gather_grouped_mm", "scatter_grouped_mm", "swiglu_scatter_grouped_mm", "combine_pairs", "combine_post",
           "PAIR_KERNELS", "SWIGLU_SCATTER", "COMBINE_POST",
           "grouped_decode_ok", "static_decode_step", "static_step_checks", "static_step_body", "StepRegions",
           "EAGER_REGIONS", "decode_embed", "decode_layer", "decode_head"]


def _map_tensors(obj, fn, other=None):
    """Apply ``fn(tensor[, other's tensor])`` to every tensor field of a cache dataclass (recursively);
    returns a new dataclass of the results."""
    changes = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        w = getattr(other, f.name) if other is not None else None
        if isinstance(v, torch.Tensor):
            changes[f.name] = fn(v) if other is None else fn(v, w)
        elif isinstance(v, CompressorCache):
            changes[f.name] = _map_tensors(v, fn, w)
    return replace(obj, **changes)


@dataclass
class SlotCache:
    """The caches of ``M`` slots for every trunk layer; ``pos [M]`` long on the device."""

    layers: List[LayerCache]
    pos: torch.Tensor
    max_len: int

    @property
    def slots(self) -> int:
        return int(self.pos.shape[0])

    @classmethod
    def like(cls, template: DecodeCache, slots: int) -> "SlotCache":
        """``slots`` empty slots shaped like ``template``'s rows (same capacity, dtypes and device)."""
        layers = [_map_tensors(lc, lambda t: t.new_zeros((slots,) + tuple(t.shape[1:]))) for lc in template.layers]
        dev = template.layers[0].window.device
        return cls(layers, torch.zeros(slots, dtype=torch.long, device=dev), template.max_len)

    def view(self, b: int) -> "SlotCache":
        """The first ``b`` slots, as views (in-place updates reach this cache)."""
        return SlotCache([_map_tensors(lc, lambda t: t[:b]) for lc in self.layers], self.pos[:b], self.max_len)

    def load(self, slots: Sequence[int], cache: DecodeCache, rows: Sequence[int]) -> None:
        """Copy ``cache``'s rows ``rows`` into ``slots`` (in place)."""
        if cache.max_len != self.max_len:
            raise ValueError(f"SlotCache.load: the prefill's capacity {cache.max_len} is not the slots' "
                             f"{self.max_len} (prefill with max_len={self.max_len})")
        dev = self.pos.device
        dst, src = to_device(slots, dev), to_device(rows, dev)
        for mine, theirs in zip(self.layers, cache.layers):
            _map_tensors(mine, lambda d, s: d.index_copy_(0, dst, s.index_select(0, src)), theirs)
        self.pos.index_copy_(0, dst, cache.pos.to(dev).index_select(0, src))

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy slots ``src`` to slots ``dst`` (in place; e.g. packing the live slots at the front)."""
        dev = self.pos.device
        d, s = to_device(dst, dev), to_device(src, dev)
        for lc in self.layers:
            _map_tensors(lc, lambda t: t.index_copy_(0, d, t.index_select(0, s)))
        self.pos.index_copy_(0, d, self.pos.index_select(0, s))


# ------------------------------------------------------------ compressors
def _compress_masked(comp: Compressor, x: torch.Tensor, cc: CompressorCache, pos: torch.Tensor,
                     inv_freq: torch.Tensor, memo: Optional[dict] = None, into: Optional[tuple] = None) -> None:
    """``decode._compress_step`` with device positions: every row's entry is pooled and written where the
    token completes a block, so the launches do not depend on the positions (in place). ``memo``: the step's
    shared values (:func:`~.decode.step_once`): compressors of one ratio share their slots and blocks, and of
    one set of frequencies their blocks' angles. ``into``: ``(buffer, first row)`` where the pooled entries go
    (default ``(cc.entries, 0)``; the attention's compressor: the layer's buffer after its ring). Written by index
    into the buffer itself, not through a view of it: a compiled step then updates the rows in place (through a
    view, Inductor wrote the whole buffer back every step). In the eager step, a table with ``compressor_step``
    (the triton backend's: ``kernels/triton/compress.py``; :func:`~.decode.eager_op`, the memo's capacity sizing
    the blocks' angle table) runs everything after the two GEMMs as that one kernel."""
    B = x.shape[0]
    m, c = comp.ratio, comp.head_dim
    ct = cc.a.dtype
    buf, first = (cc.entries, 0) if into is None else into
    N = buf.shape[1] - first
    # a layer's projections in one launch where the table has linear_group (decode.layer_projections)
    kv = projected(memo, comp.wkv.weight, lambda: linear_fp32(x, comp.wkv.weight))[:, 0].to(ct)
    gate = projected(memo, comp.wgate.weight, lambda: linear_fp32(x, comp.wgate.weight))[:, 0].to(ct)
    kernel = eager_op(comp.ops, memo, "compressor_step")
    if kernel is not None:
        table = angle_table(inv_freq, m, memo["max_len"], compute_dtype(x))
        kernel(kv, gate, comp.ape, cc.a, cc.z, cc.prev_a, cc.prev_z, pos, buf, first, comp.norm.weight,
               comp.norm.eps, table, comp.rotate)
        return
    rows, slot, done, block, at = step_once(memo, ("blocks", m, N), lambda: _blocks(B, m, N, pos))
    cc.a[rows, slot] = kv
    cc.z[rows, slot] = gate + comp.ape.to(ct)[slot]
    if N == 0:          # capacity below one block: no token can complete one
        return
    a, z = cc.a, cc.z
    if comp.overlap:    # entry i pools block i-1's first-half channels and block i's second half (2m slots)
        a = torch.cat((cc.prev_a, a[..., c:]), dim=1)
        z = torch.cat((cc.prev_z, z[..., c:]), dim=1)
    pooled = comp.norm(pool_slots(a, z).to(buf.dtype))

    def angles():
        if memo is not None and "max_len" in memo:      # the eager static step: a row of the blocks' table
            return table_angles(angle_table(inv_freq, m, memo["max_len"], compute_dtype(x)), block)
        return rope_cos_sin(inv_freq, (block * m)[:, None], compute_dtype(x))

    # the memo names the frequencies by their shared device tensor (decode.device_inv_freq; never read compiled)
    cos, sin = angles() if memo is None else step_once(memo, ("block-rope", m, id(inv_freq)), angles)
    pooled = (apply_rope if comp.ops is None else comp.ops.apply_rope)(pooled[:, None], cos, sin)[:, 0]
    if comp.rotate:
        pooled = (hadamard_transform if comp.ops is None else comp.ops.hadamard_transform)(pooled)
    at = at + first if first else at
    buf[rows, at] = torch.where(done[:, None], pooled, buf[rows, at])
    if comp.overlap:
        cc.prev_a.copy_(torch.where(done[:, None, None], cc.a[..., :c], cc.prev_a))
        cc.prev_z.copy_(torch.where(done[:, None, None], cc.z[..., :c], cc.prev_z))


def _blocks(B: int, m: int, N: int, pos: torch.Tensor):
    """``(rows, slot, done, block, at)`` of a ratio-``m`` compressor's step: the rows, each token's slot in its
    block, whether it completes the block, the block, and the entry it writes (``block`` within the ``N``
    entries: a row that completes nothing writes its entry back unchanged)."""
    block = pos // m
    return (torch.arange(B, device=pos.device), pos % m, (pos + 1) % m == 0, block, block.clamp(max=max(N - 1, 0)))


# -------------------------------------------------------------------- MoE
def stack_expert_weights(model) -> int:
    """Hold each trunk MoE layer's experts as two stacked tensors, ``w13 [E, 2I, d]`` (expert ``e``'s ``w1`` in
    rows ``:I``, its ``w3`` in rows ``I:``: one grouped GEMM computes gate and up) and ``w2 [E, d, I]``, the
    expert parameters being views of them (their values, names and ``state_dict`` are unchanged; in-place
    weight updates land in the stacks). Where the expert tensors already lie that way in memory - an engine
    that shares the trainer's weights (``rollout.shared_weights``): the trainer's ``linear_fc1.weight{e}`` is
    ``cat(w1, w3)`` and its expert bank is one buffer - the stacks are views of that memory and nothing is
    copied (:func:`kernels.reference.stacks.stacked_view`). The shared expert's ``w1`` and ``w3`` likewise as one
    ``[2I, d]`` (one GEMM for gate and up; the trainer's ``shared_experts.linear_fc1.weight`` is that tensor).
    Call again whenever the expert tensors are replaced (a dtype or device move, shared weights). Returns the
    bytes it copied (0 when every stack is a view)."""
    copied = 0
    for layer in model.layers:
        moe = layer.ffn
        w1s = [e.w1.weight for e in moe.experts]
        w3s = [e.w3.weight for e in moe.experts]
        w2s = [e.w2.weight for e in moe.experts]
        shared = moe.shared_experts
        w13, w2 = _w13_stack(w1s, w3s), _stack(w2s)
        shared13 = _w13_stack([shared.w1.weight], [shared.w3.weight])
        copied += sum(t.numel() * t.element_size() for t, made in (w13, w2, shared13) if made)
        moe._expert_stacks = {"w13": w13[0], "w2": w2[0], "shared_w13": shared13[0][0]}
    return copied


def _w13_stack(w1s, w3s):
    """``(w13, copied)``: a view of the experts' memory where gate and up halves alternate evenly, else a copy."""
    inter, dim = w1s[0].shape
    pair = inter * dim
    gates = stacked_view([w.detach() for w in w1s], step=2 * pair)
    ups = stacked_view([w.detach() for w in w3s], step=2 * pair)
    if (gates is not None and ups is not None and gates.dtype == ups.dtype
            and ups.storage_offset() == gates.storage_offset() + pair):
        return gates.as_strided((len(w1s), 2 * inter, dim), (2 * pair, dim, 1)), False
    stack = torch.cat((torch.stack([w.detach() for w in w1s]), torch.stack([w.detach() for w in w3s])), dim=1)
    for i, (w1, w3) in enumerate(zip(w1s, w3s)):
        w1.data, w3.data = stack[i, :inter], stack[i, inter:]
    return stack, True


def _stack(ws):
    """``(stack, copied)``: a view of the experts' memory where they lie one after another, else a copy."""
    view = stacked_view([w.detach() for w in ws])
    if view is not None:
        return view, False
    stack = torch.stack([w.detach() for w in ws])
    for i, w in enumerate(ws):
        w.data = stack[i]
    return stack, True


def _stacks(moe):
    st = getattr(moe, "_expert_stacks", None)
    if st is not None:
        w13, w2, shared13 = st["w13"], st["w2"], st["shared_w13"]
        inter = w13.shape[1] // 2
        shared = moe.shared_experts
        fresh = all(e.w1.weight.data_ptr() == w13[i, :inter].data_ptr()
                    and e.w3.weight.data_ptr() == w13[i, inter:].data_ptr()
                    and e.w2.weight.data_ptr() == w2[i].data_ptr() for i, e in enumerate(moe.experts))
        fresh = (fresh and shared.w1.weight.data_ptr() == shared13[:inter].data_ptr()
                 and shared.w3.weight.data_ptr() == shared13[inter:].data_ptr())
        if fresh:
            return w13, w2
    raise RuntimeError("the decode MoE reads each layer's experts as one stacked tensor: call "
                       "kernels.reference.slots.stack_expert_weights(model) after building the model or "
                       "replacing its expert tensors")


def grouped_decode_ok(device, dtype: torch.dtype, rows13: int, dim: int) -> bool:
    """Whether the decode MoE takes the grouped path for experts ``w13 [E, rows13, dim]`` of ``dtype`` on
    ``device``: bf16 on a CUDA GPU of compute capability 9.0+ with aligned expert dims, what
    ``torch._grouped_mm`` runs there. One rule for the step (:func:`moe_decode_path`) and for the engine's
    record of the kernels its decode step calls (:func:`rollout.engine_ops.decode_choices`)."""
    device = torch.device(device)
    return (device.type == "cuda" and dtype == torch.bfloat16 and rows13 % 16 == 0 and dim % 8 == 0
            and torch.cuda.get_device_capability(device) >= (9, 0))


def moe_decode_path(x: torch.Tensor, moe) -> str:
    """``"grouped"`` (:func:`grouped_decode_ok`) or ``"dense"``."""
    w13 = moe._expert_stacks["w13"] if hasattr(moe, "_expert_stacks") else None
    ok = (w13 is not None and x.dtype == w13.dtype
          and grouped_decode_ok(x.device, x.dtype, w13.shape[1], w13.shape[2]))
    return "grouped" if ok else "dense"


def _grouped_mm(x, w, offs):
    """torch's grouped GEMM of rows sorted by group: ``x [R, K]``, ``w [E, N, K]``, ``offs [E]`` end rows."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def expert_order(flat: torch.Tensor, n_experts: int, weights: Optional[torch.Tensor] = None, tail: int = 0):
    """``(order, ends)`` of the pairs' expert ids ``flat [R]``: ``order`` is ``flat.argsort(stable=True)`` (each
    expert's pairs in their own order) and ``ends [E]`` int32 each expert's end row in it, counted instead of
    sorted. Why: a decode step sorts a few hundred ids per layer, and torch's sort ran four radix passes of 27 us
    each at 64 sequences (``bench/results/rollout-h200-flash-shaped-triton-compile-mix-finish.json``); counting
    is a comparison with every expert id and two prefix sums, which Inductor fuses. The one-hot is expert-major
    ``[E, R]`` so that the running count scans its innermost dim, in int32: eager torch scans an outer dim one
    column per thread, and an int32 cumsum promotes to int64 unless told (the ``[R, E]`` form took 69 us a layer
    eagerly at 64 sequences, ``bench/results/rollout-h200-flash-shaped-triton-eager-expert-order.json``). With
    ``weights [R]`` (the pairs' routing weights) a third output: those weights in that order, then ``tail`` ones
    (the shared expert's rows, :func:`_grouped`), ``[R + tail]`` fp32."""
    hit = (torch.arange(n_experts, device=flat.device)[:, None] == flat).to(torch.int32)     # [E, R]
    counts = hit.sum(1, dtype=torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    seen = (hit.cumsum(1, dtype=torch.int32) * hit).sum(0)        # 1 + the pairs of its expert before it
    pos = (ends - counts).index_select(0, flat) + seen - 1        # where the pair goes in expert order
    order = torch.empty_like(flat).index_copy_(0, pos.long(), torch.arange(flat.shape[0], device=flat.device))
    if weights is None:
        return order, ends
    ones = torch.ones(tail, dtype=torch.float32, device=flat.device)
    return order, ends, torch.cat((weights.float().index_select(0, order), ones))


def _grouped(x, weights, idx, w13, w2, limit, ct, mm=_grouped_mm, act=weighted_swiglu, order=expert_order,
             pair_mms=None, shared=None, act_scatter=None):
    """(token, expert) pairs sorted by expert, each expert's rows one group of a grouped GEMM ``mm`` (gate and
    up in one: ``w13``): torch's, or the op table's ``experts_grouped_mm``; ``act``: the activation with the
    routing weight applied before ``w2`` (the reference's :func:`~.moe.weighted_swiglu` or the table's);
    ``order``: the pairs' expert order (:func:`expert_order`, or the table's one-launch ``expert_order``).
    Returns the routed experts' sum ``[T, d]`` in ``ct``; with ``pair_mms``, the table's ``(experts_gather_mm,
    experts_scatter_mm)`` (which read the tokens and write the pairs through the order, no copies), each pair's
    output ``[T * k, d]`` token-major in ``x``'s dtype instead (the caller sums them: ``moe_combine``), and with
    ``shared`` (the shared expert's ``(w13 [2I, d], w2 [d, I])``, at weight 1) its output on every token as
    ``T`` rows more (``[T * k + T, d]``): one expert more in the same two GEMMs. ``act_scatter`` (with
    ``pair_mms``): the table's :data:`SWIGLU_SCATTER`, the activation and the second GEMM in one launch
    (:func:`swiglu_scatter_grouped_mm`'s contract), else ``act`` and then ``experts_scatter_mm``."""
    T, k = idx.shape
    if pair_mms is not None:     # the weights in expert order from the ordering itself (the shared rows' ones after)
        gather, scatter = pair_mms
        s13, s2 = (None, None) if shared is None else shared
        order, offs, w = order(idx.reshape(-1), w13.shape[0], weights.reshape(-1), 0 if shared is None else T)
        h = gather(x, w13, offs, order, k, s13)
        if act_scatter is not None:
            return act_scatter(h, w, limit, w2, offs, order, s2)
        return scatter(act(h, w, limit, x.dtype), w2, offs, order, s2)
    order, offs = order(idx.reshape(-1), w13.shape[0])
    w = weights.reshape(-1).index_select(0, order)
    hid = act(mm(x.index_select(0, order // k), w13, offs), w, limit, x.dtype)
    out = mm(hid, w2, offs).to(ct)
    return torch.empty_like(out).index_copy_(0, order, out).view(T, k, -1).sum(dim=1)


def gather_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor,
                      topk: int, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``experts_gather_mm`` op's torch contract: torch's grouped GEMM of the tokens ``x [T, K]`` read in
    the pairs' expert order ``order [T * topk]`` (row ``r`` is token ``order[r] // topk``); with ``shared [N, K]``
    (the shared expert) ``x @ shared^T`` after them (rows ``T * topk + t``)."""
    y = _grouped_mm(x.index_select(0, order // topk), w, offs)
    return y if shared is None else torch.cat((y, F.linear(x, shared)))


def scatter_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor,
                       shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``experts_scatter_mm`` op's torch contract: torch's grouped GEMM of rows in expert order, row ``r``
    written to row ``order[r]`` (the pairs token-major); with ``shared [N, K]`` the rows of ``x`` after the
    pairs' (``x [R + T, K]``) go through the shared expert to rows ``R + t``."""
    R = order.shape[0]
    y = _grouped_mm(x[:R], w, offs)
    y = torch.empty_like(y).index_copy_(0, order, y)
    return y if shared is None else torch.cat((y, F.linear(x[R:], shared)))


def swiglu_scatter_grouped_mm(h: torch.Tensor, weights: torch.Tensor, limit: float, w: torch.Tensor,
                              offs: torch.Tensor, order: torch.Tensor,
                              shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``experts_swiglu_scatter_mm`` op's torch contract: the experts' activation at the rows' weights
    ``weights`` (:func:`~.moe.weighted_swiglu` of ``h = [gate | up]``, cast to ``h``'s dtype) followed by
    :func:`scatter_grouped_mm`: what the eager step's pair path runs as two ops without it (:func:`_grouped`)."""
    return scatter_grouped_mm(weighted_swiglu(h, weights, limit, h.dtype), w, offs, order, shared)


def combine_post(pairs: torch.Tensor, shared: torch.Tensor, topk: int, x: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor:
    """The ``moe_combine_post`` op's torch contract: the MoE's output summed from its pairs and shared expert
    (:func:`combine_pairs`), then the site's mHC post (:func:`~.mhc.hc_post`; ``x [..., n, d]``): what the eager
    step runs as two ops without it (:func:`decode_layer`)."""
    return hc_post(combine_pairs(pairs, shared, topk).view(*x.shape[:-2], x.shape[-1]), x, post, comb)


def linear_post(u: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """The ``linear_post`` op's torch contract: the attention's output projection ``u @ weight^T`` (``wo_b``, in
    ``u``'s dtype, as ``linear_group`` computes it), then the site's mHC post (:func:`~.mhc.hc_post`; ``x [..., n,
    d]``): what the eager step runs as two ops without it (:func:`decode_layer`)."""
    return hc_post(F.linear(u, weight.to(u.dtype)), x, post, comb)


def _ones_like_rows(T: int, device) -> torch.Tensor:
    """``[T]`` fp32 ones: the shared expert's weights (made once per token count by static_step_checks, eagerly)."""
    ones = None if torch.compiler.is_compiling() else _ONES.get((T, str(device)))
    return torch.ones(T, dtype=torch.float32, device=device) if ones is None else ones


def combine_pairs(pairs: torch.Tensor, shared: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``moe_combine`` op's torch contract: each token's ``topk`` pairs ``pairs [T * topk, d]`` summed in
    fp32, plus its shared expert's ``shared [T, d]``, cast to ``shared``'s dtype (the MoE's output)."""
    ct = compute_dtype(shared)
    return (pairs.view(shared.shape[0], topk, -1).to(ct).sum(dim=1) + shared.to(ct)).to(shared.dtype)


def _dense(x, weights, idx, w13, w2, limit, ct):
    """Every expert on every token (one batched matmul), weighted 0 where the token did not pick it."""
    hid = swiglu(*torch.matmul(x, w13.transpose(1, 2)).to(ct).chunk(2, dim=-1), limit)
    gate = torch.zeros(x.shape[0], w13.shape[0], dtype=ct, device=x.device).scatter(1, idx, weights.to(ct))
    hid = hid * gate.t()[:, :, None]                                              # [E, T, I]
    return torch.matmul(hid.to(x.dtype), w2.transpose(1, 2)).to(ct).sum(dim=0)


# the grouped path with the op table's experts_grouped_mm (the triton backend's decode kernel) for its GEMMs
GROUPED_KERNEL = "grouped-kernel"


def _with_kernel(moe, path: str) -> str:
    """``path``, or :data:`GROUPED_KERNEL` for the grouped path of a layer whose op table has
    ``experts_grouped_mm``: decided on the host, so traced code reads only an attribute that exists."""
    if path == "grouped" and moe.ops is not None and "experts_grouped_mm" in moe.ops.names():
        return GROUPED_KERNEL
    return path


def _eager_kernel(moe, path: str, name: str):
    """The op table's ``name`` (``route_experts``, ``expert_order``) on the grouped-kernel path of an eager step,
    else None: traced, the torch code is what Inductor fuses, where the table's kernel is one opaque launch
    (``rollout.engine_ops.decode_choices`` records which ran)."""
    if path == GROUPED_KERNEL and not torch.compiler.is_compiling() and name in moe.ops.names():
        return getattr(moe.ops, name)
    return None


def _route(moe, x: torch.Tensor, input_ids: torch.Tensor, path: str):
    """``(weights [T, k], idx [T, k])`` of the layer's router (the routing seam is not consulted:
    static_step_checks refuses a hook; the hash table's ids were checked with the host-side checks,
    :func:`_host_checks`): the table's one-launch ``route_experts`` (:func:`_eager_kernel`), else
    :func:`~.moe.route`."""
    gate = moe.gate
    kernel = _eager_kernel(moe, path, "route_experts")
    if kernel is None:
        return route(gate, x, input_ids, None if gate.hash else gate.bias, replay=False)
    return kernel(x, gate.weight.detach(), None if gate.hash else gate.bias, gate.tid2eid if gate.hash else None,
                  input_ids.reshape(-1) if gate.hash else None, gate.topk, gate.route_scale, gate.score_func)


def moe_decode(moe, x: torch.Tensor, input_ids: torch.Tensor, path: Optional[str] = None):
    """``MoE.forward`` without host syncs: ``x [..., d]`` -> ``(y [..., d], idx [T, k])``. ``path``: None
    (:func:`moe_decode_path`), ``"grouped"`` (its GEMMs the op table's ``experts_grouped_mm`` where the layer's
    table has one, else torch's) or ``"dense"``."""
    _host_checks(moe)
    path = path or moe_decode_path(x.reshape(-1, x.shape[-1]), moe)
    if path not in ("grouped", "dense"):
        raise ValueError(f"moe_decode: path must be 'grouped' or 'dense', got {path!r}")
    return _moe_decode(moe, x, input_ids, _with_kernel(moe, path))


def _host_checks(moe) -> None:
    """The decode MoE's checks before its device work: its expert stacks are current (:func:`_stacks`), and a
    hash layer's table holds no negative id (checked once per version of the table: on a GPU a host sync)."""
    _stacks(moe)
    gate = moe.gate
    if gate.hash and _has_negative_ids(gate.tid2eid):
        raise ValueError("tid2eid holds negative expert ids (table not loaded?)")


def _moe_decode(moe, x: torch.Tensor, input_ids: torch.Tensor, path: str, combine=None):
    """:func:`moe_decode` once its host-side checks have passed (traceable: no ``data_ptr``, no device query).
    ``combine(pairs, shared, topk)``: where the pair kernels run, called in ``moe_combine``'s place and its result
    returned as it is (:func:`decode_layer`'s MoE with its mHC post, ``moe_combine_post``)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, idx = _route(moe, x, input_ids, path)
    ct = compute_dtype(x)
    st = moe._expert_stacks
    w13, w2 = (st[n].to(x.dtype) for n in ("w13", "w2"))
    act = weighted_swiglu if moe.ops is None else moe.ops.weighted_swiglu
    if path == "dense":
        y = _dense(x, weights, idx, w13, w2, moe.experts[0].limit, ct)
    else:
        mm = moe.ops.experts_grouped_mm if path == GROUPED_KERNEL else _grouped_mm
        pairs = _pair_kernels(moe, path)
        merged = _merged_shared(moe, st, w13) if pairs else None
        y = _grouped(x, weights, idx, w13, w2, moe.experts[0].limit, ct, mm, act,
                     _eager_kernel(moe, path, "expert_order") or expert_order, pairs and pairs[:2], merged,
                     pairs and _eager_kernel(moe, path, SWIGLU_SCATTER))
        if pairs:                      # the pairs' outputs, summed with the shared expert's (its rows after theirs)
            R = idx.numel()
            routed, shared = ((y[:R], y[R:]) if merged is not None
                              else (y, _shared_expert(moe.shared_experts, st["shared_w13"], x, act)))
            if combine is not None:
                return combine(routed, shared, idx.shape[1]), idx
            return pairs[2](routed, shared, idx.shape[1]).view(shape), idx
    y = y + _shared_expert(moe.shared_experts, st["shared_w13"], x, act).to(ct)
    return y.to(x.dtype).view(shape), idx


PAIR_KERNELS = ("experts_gather_mm", "experts_scatter_mm", "moe_combine")
# the pair path's activation and second GEMM in one launch, where the table has it besides PAIR_KERNELS (_grouped;
# without it the step runs the table's weighted_swiglu, then experts_scatter_mm)
SWIGLU_SCATTER = "experts_swiglu_scatter_mm"
# the pair path's sum of the pairs and the MoE's mHC post in one launch, where the table has it besides
# PAIR_KERNELS (decode_layer; without it the step runs moe_combine, then hc_post)
COMBINE_POST = "moe_combine_post"
# the attention's wo_b and its site's mHC post in one launch, where the eager step's table has it (decode_layer;
# without it the step runs linear_group, then hc_post)
LINEAR_POST = "linear_post"


def _merged_shared(moe, st, w13: torch.Tensor):
    """The shared expert's ``(w13 [2I, d], w2 [d, I])`` where it runs as one expert more in the pair kernels'
    GEMMs (:func:`_grouped`): shaped like a routed expert and clamped alike (one activation for all rows), else
    None (it runs apart, :func:`_shared_expert`)."""
    shared = moe.shared_experts
    s13, s2 = st["shared_w13"], shared.w2.weight
    if s13.shape != w13.shape[1:] or s2.shape != st["w2"].shape[1:] or shared.limit != moe.experts[0].limit:
        return None
    return s13.to(w13.dtype), s2.to(w13.dtype)


def _pair_kernels(moe, path: str):
    """The table's :data:`PAIR_KERNELS` on the grouped-kernel path of an eager step where it has all three
    (:func:`_eager_kernel`), else None: the routed experts' GEMMs read the tokens and write the pairs through
    the expert order, and one launch sums a token's pairs with its shared expert, where torch's path gathers,
    scatters, casts, sums and adds (six launches a layer)."""
    kernels = tuple(_eager_kernel(moe, path, name) for name in PAIR_KERNELS)
    return kernels if all(k is not None for k in kernels) else None


def prefill_experts(moe, x: torch.Tensor, input_ids: torch.Tensor):
    """``MoE.forward`` for a prefill (``kernels.reference.moe.inference_experts``' offer; None: not taken): on
    the grouped path (:func:`moe_decode_path`) the routed experts as torch's grouped GEMM over the (token,
    expert) pairs in expert order, with no host sync, where the reference loops over the experts with a host
    sync each (about 130 a Flash-shaped prefill). Always torch's grouped GEMM, not the table's decode kernel:
    a prefill gives each expert hundreds of rows. The routing seam sees the picks after routing, so only a
    hook that records (``records_only``, ``rollout.replay.RoutingRecorder``) lets it run; a replay keeps the
    loop."""
    hook = current_routing_hook()
    if hook is not None and not getattr(hook, "records_only", False):
        return None
    if moe_decode_path(x.reshape(-1, x.shape[-1]), moe) != "grouped":
        return None
    _host_checks(moe)
    y, idx = _moe_decode(moe, x, input_ids, "grouped")
    gate = moe.gate
    if hook is not None and gate.replayable:                       # a learned trunk layer (never a hash one)
        hook(gate.layer_id, idx)
    return y


def _shared_expert(shared, w13: torch.Tensor, x: torch.Tensor, act) -> torch.Tensor:
    """``shared(x)`` (``Expert.forward``) with gate and up in one GEMM of the stacked ``w13 [2I, d]`` and the
    activation ``act`` (``weighted_swiglu``'s contract) at weight 1: one GEMM and one kernel where the module
    runs two GEMMs, casts, clamps, a SiLU and a product (a weight of 1 changes no bit of the reference's)."""
    h = F.linear(x, w13.to(x.dtype))
    return F.linear(act(h, _ones_like_rows(x.shape[0], x.device), shared.limit, x.dtype), shared.w2.weight.to(x.dtype))


# the shared expert's weights of 1 per token count and device, made by static_step_checks before a CUDA graph
# records the step (a fill a layer less), read only eagerly; never written
_ONES: Dict[Tuple[int, str], torch.Tensor] = {}


# ------------------------------------------------------------------- step
def static_step_checks(model, tokens: torch.Tensor, moe_path: Optional[str] = None,
                       max_len: Optional[int] = None) -> Tuple[str, ...]:
    """The host-side part of :func:`static_decode_step`, run before the step's device work (and outside
    ``torch.compile``'s tracing: it reads pointers, the device's compute capability, module state): refuses an
    installed routing hook, stale expert stacks and hash tables with negative ids, puts each attention's RoPE
    frequencies on the device (and, given the slots' capacity ``max_len``, the eager step's angle tables:
    :func:`~.decode.angle_table`, made here so that no CUDA graph records their making), and returns each
    layer's MoE path (``moe_path`` for all, or :func:`moe_decode_path`)."""
    if current_routing_hook() is not None:
        raise RuntimeError("static_decode_step returns the routed experts instead of calling the routing seam; "
                           "uninstall the routing hook (routing replay is not supported while decoding)")
    if moe_path not in (None, "grouped", "dense"):
        raise ValueError(f"static_decode_step: moe_path must be 'grouped' or 'dense', got {moe_path!r}")
    dev = tokens.device
    x = model.embed.weight[:1]                                  # the dtype and device the MoE sees
    if (len(tokens), str(dev)) not in _ONES:                    # the shared expert's weights (_shared_expert)
        _ONES[(len(tokens), str(dev))] = torch.ones(len(tokens), dtype=torch.float32, device=dev)
    paths = []
    for layer in model.layers:
        _host_checks(layer.ffn)
        inv_freq = device_inv_freq(layer.attn, dev)
        if max_len is not None:            # the positions' angles, and each compressor's blocks' (_compress_masked)
            ct = compute_dtype(x)
            for stride in (1, layer.attn.ratio) if layer.attn.ratio else (1,):
                angle_table(inv_freq, stride, max_len, ct)
        paths.append(_with_kernel(layer.ffn, moe_path or moe_decode_path(x, layer.ffn)))
    return tuple(paths)


def static_decode_step(model, cache: SlotCache, tokens: torch.Tensor, active: torch.Tensor,
                       moe_path: Optional[str] = None, indexer_picks: bool = False):
    """Feed ``tokens [b]`` (long, device) to the ``b = cache.slots`` slots at ``cache.pos``; slots with
    ``active [b]`` (bool, device) False compute too but do not advance. Returns the fp32 logits ``[b, V]``
    and the learned-routing layers' experts ``[b, n_learned, k]``. Every shape depends on ``b`` only and no
    value is read on the host; the caller keeps every active slot's position below ``cache.max_len``.

    This is :func:`static_step_checks` followed by :func:`static_step_body`; ``torch.compile`` takes the body
    (``rollout.slot_decoder.compiled_decode_step``). ``indexer_picks``: also return the CSA layers' indexer
    top-k ``[b, n_csa, index_topk]`` (a third output)."""
    return static_step_body(model, cache, tokens, active, static_step_checks(model, tokens, moe_path, cache.max_len),
                            indexer_picks)


def decode_embed(model, ids: torch.Tensor) -> torch.Tensor:
    """``ids [b, 1]`` -> the trunk's ``hc_mult`` residual streams ``[b, 1, n, d]`` (the embedding, copied)."""
    return model.embed(ids).unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()


def decode_layer(layer, lc: LayerCache, x: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, path: str,
                 want_picks: bool = False, memo: Optional[dict] = None):
    """``Block.forward`` for one token per slot: ``x [b, 1, n, d]`` -> ``(x, experts [b, k], picks)``, the
    layer's cache updated in place; ``picks``: the CSA indexer's top-k ``[b, k]`` with ``want_picks`` on a
    CSA layer, else None. One layer's device work, so a compiler can compile it once for every layer of the
    same structure (``rollout.slot_decoder.compiled_decode_step``). ``memo``: the eager step's values shared
    by its layers (:func:`~.decode.step_once`)."""
    picks = [] if want_picks else None
    h, post, comb = _pre_normed(layer, "attn", x, layer.attn_norm, memo)
    fused = eager_op(layer.ops, memo, LINEAR_POST)
    if fused is not None and layer.attn.wo_b.weight.dtype == x.dtype:     # eager_linear's condition for wo_b
        x = _attend(layer.attn, h, lc, pos, _compress_masked, picks, memo,
                    lambda u, w, x=x, post=post, comb=comb: fused(u, w, x, post, comb))
    else:
        x = layer.hc_post(_attend(layer.attn, h, lc, pos, _compress_masked, picks, memo), x, post, comb)
    h, post, comb = _pre_normed(layer, "ffn", x, layer.ffn_norm, memo)
    x, idx = _moe_posted(layer, h, ids, path, x, post, comb, memo)
    return x, idx, (picks[0] if picks else None)


def _moe_posted(layer, h: torch.Tensor, ids: torch.Tensor, path: str, x: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, memo: Optional[dict]):
    """The MoE of ``h`` and the site's mHC post: ``(x', experts [b, k])``. Where the eager step's table has
    :data:`COMBINE_POST` (:func:`~.decode.eager_op`) and the pair kernels run, the pairs' sum and the post are that
    one launch (:func:`combine_post`'s contract), else ``moe_combine`` (or torch's sum) and ``hc_post``."""
    fused = eager_op(layer.ops, memo, COMBINE_POST)
    if fused is not None and _pair_kernels(layer.ffn, path) is not None:      # _moe_decode's pair path
        return _moe_decode(layer.ffn, h, ids, path, lambda pairs, shared, topk: fused(pairs, shared, topk, x, post,
                                                                                      comb))
    f, idx = _moe_decode(layer.ffn, h, ids, path)
    return layer.hc_post(f, x, post, comb), idx


def _pre_normed(layer, site: str, x: torch.Tensor, rms, memo: Optional[dict]):
    """A site's mHC pre and its sublayer's norm ``rms``: ``(rms(u), post, comb)``, in one launch where the eager
    step's table has ``hc_pre_norm`` (:func:`~.decode.eager_op`; ``kernels/triton/mhc_decode.py``), else
    ``hc_pre`` and the norm."""
    fused = eager_op(layer.ops, memo, "hc_pre_norm")
    if fused is None:
        u, post, comb = layer._hc(site, x)
        return rms(u), post, comb
    return fused(x, getattr(layer, f"hc_{site}_fn"), getattr(layer, f"hc_{site}_scale"),
                 getattr(layer, f"hc_{site}_base"), layer.norm_eps, layer.hc_eps, layer.hc_iters, rms.weight, rms.eps)


def decode_head(model, x: torch.Tensor, memo: Optional[dict] = None) -> torch.Tensor:
    """The trunk's streams ``[b, 1, n, d]`` -> fp32 logits ``[b, V]``; the collapse and the final norm in one
    launch where the eager step's table has ``hc_head_norm`` (:func:`~.decode.eager_op`), the head GEMM through its
    ``linear_group`` where it has that (:func:`~.decode.eager_linear`)."""
    fused = eager_op(model.ops, memo, "hc_head_norm")
    if fused is None:
        y = model.collapse(x)
    else:
        c = model.config
        y = fused(x, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, c.norm_eps, c.hc_eps,
                  model.norm.weight, model.norm.eps)
    w = model.head.weight
    return eager_linear(model.ops, memo, y, w, True, lambda: linear_fp32(y, w))[:, 0]


@dataclass(frozen=True)
class StepRegions:
    """The three parts of a step's device work: the embedding, one layer, the head. The plain functions by
    default; the rollout engine's ``compile`` option passes compiled ones (one compiled layer serves every
    layer of its structure, instead of one graph of the whole unrolled model)."""
    embed: Callable = decode_embed
    layer: Callable = decode_layer
    head: Callable = decode_head


EAGER_REGIONS = StepRegions()


def static_step_body(model, cache: SlotCache, tokens: torch.Tensor, active: torch.Tensor,
                     moe_paths: Sequence[str], indexer_picks: bool = False,
                     regions: StepRegions = EAGER_REGIONS):
    """The device work of :func:`static_decode_step` (``moe_paths``: one per layer, from
    :func:`static_step_checks`): pure tensor code, no host sync, traceable by ``torch.compile``. ``regions``:
    the functions that run its parts (:class:`StepRegions`)."""
    ids = tokens[:, None]
    x = regions.embed(model, ids)
    routes = []
    picks = [] if indexer_picks else None
    # eager layers share the step's positions-derived values; a compiled layer computes its own (step_once)
    shared = (dict(memo={"max_len": cache.max_len}) if regions.layer is decode_layer else {})
    for layer, lc, path in zip(model.layers, cache.layers, moe_paths):
        x, idx, pick = regions.layer(layer, lc, x, ids, cache.pos, path, indexer_picks, **shared)
        if not layer.ffn.gate.hash:
            routes.append(idx)
        if pick is not None:
            picks.append(pick)
    cache.pos.add_(active)                         # a bool adds as 0 or 1: one kernel, no cast first
    k = model.config.n_activated_experts
    routes = torch.stack(routes, dim=1) if routes else torch.empty(len(tokens), 0, k, dtype=torch.long,
                                                                   device=tokens.device)
    logits = regions.head(model, x, **shared)
    if picks is None:
        return logits, routes
    topk = model.config.index_topk
    picks = (torch.stack([F.pad(p, (0, topk - p.shape[-1]), value=-1) for p in picks], dim=1) if picks
             else torch.empty(len(tokens), 0, topk, dtype=torch.long, device=tokens.device))
    return logits, routes, picks
