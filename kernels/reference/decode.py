"""KV-cached generation with the reference model: batched prefill, then one-token decode steps.

The math is the reference model's (``model.py``); this module only keeps what a new token needs from the
tokens before it, per sequence (one cache row = one sequence, "slot"):

* **window KV** (every layer): a ring of ``W = window_size`` rows ``[B, W, D]``; position ``p`` lives in row
  ``p % W``, and a query at ``p`` attends to rows ``s < min(p + 1, W)`` (the last ``W`` positions, itself
  included);
* **compressor state** (CSA and HCA layers, and the indexer's compressor on CSA layers): the fp32
  projections ``a = W_kv x`` and gate scores ``z = W_gate x + ape[p % m]`` of the current, incomplete block
  (``[B, m, kappa*c]``), and for the overlapping ratio-4 compressor the first-half channels of the previous
  complete block (``[B, m, c]``; kv 0 / score -inf before block 0). When a token completes block ``i``
  (``(p + 1) % m == 0``) the entry ``C_i`` is pooled exactly as in prefill and the current block becomes
  the previous one;
* **compressed entries**: the attention compressor's entries ``[B, N, D]`` and, on CSA layers, the indexer's
  compressed keys ``[B, N, c_I]``, ``N = max_len // m``; entry ``j`` is visible to ``p`` when
  ``j < (p + 1) // m``. The attention's entries follow the window ring in one buffer (``LayerCache.window``
  ``[B, W + N, D]`` on compressed layers): the sparse attention reads both through one index, and a step need
  not concatenate them (a copy of every row's cache, per layer and step, that grows with the context);
* **positions** ``pos [B]``: how many tokens each row holds (the next token's position), kept on the host
  so that which rows complete a block is known without a device sync.

Hyper-connections (mHC) and the MoE act on each token alone: they need no state. The MTP block is not run
while generating (no speculative decoding), so nothing is cached for it.

:func:`prefill` runs the reference forward itself (``DeepseekV4Model.hidden_streams``) on the prompts,
right-padded to one length, and forward hooks copy out what the caches hold; padding sits after every real
token and the model is causal, so it changes nothing a real position computes. Each row's state is read at
its own length. :func:`decode_step` then feeds one token per row at that row's position. The logits of
both equal the full forward's at the same positions (up to float summation order): the Lightning Indexer's
top-k is :func:`.topk.stable_topk` here and in the forward, so an exact score tie picks the same entries on
the cache's ``max_len // 4``-entry rows as on the forward's. Both call the kernel ops of the model's modules
(``model.ops_in_use``; the reference functions by default). The routing seam (``moe.routing_hook``) sees
every token once: the prompt in prefill, each new
token in the decode step that feeds it. The indexer-replay seam is not consulted by :func:`decode_step`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .attention import sparse_attention_with_sink
from .compressor import Compressor, hadamard_transform
from .indexer import indexer_input_dtype, indexer_scores
from .layers import compute_dtype, grouped_projection, linear_fp32, rms_normalize
from .rope import apply_rope, rope_cos_sin
from .topk import decode_topk, window_rows as _window

__all__ = ["CompressorCache", "LayerCache", "DecodeCache", "prefill", "decode_step", "to_device", "kv_read_bytes"]


@dataclass
class CompressorCache:
    """One compressor's state for ``B`` rows (see the module docstring)."""

    a: torch.Tensor                  # [B, m, kappa*c] fp32: W_kv x of the current block's tokens (slot p % m)
    z: torch.Tensor                  # [B, m, kappa*c] fp32: W_gate x + ape
    prev_a: Optional[torch.Tensor]   # [B, m, c] overlap only: the previous block's a[..., :c] (0 before block 0)
    prev_z: Optional[torch.Tensor]   # [B, m, c] overlap only: the previous block's z[..., :c] (-inf before block 0)
    # [B, N, c] compressed entries (the model's dtype); row j valid if j < pos // m. None for the attention's
    # compressor: its entries are LayerCache.window[:, W:]
    entries: Optional[torch.Tensor]


@dataclass
class LayerCache:
    """One layer's caches: the window ring, and on compressed layers the compressor(s)."""

    window: torch.Tensor                     # [B, W, D] ring of rotated KV rows; [B, W + N, D] with the entries
    compressor: Optional[CompressorCache]    # attention compressor (CSA and HCA layers)
    indexer: Optional[CompressorCache]       # the Lightning Indexer's compressor (CSA layers)


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """Host values (a sequence or a CPU tensor) as a tensor on ``device`` without waiting for the GPU: a copy
    from pageable host memory synchronizes (the host waits for every kernel queued before it, and a rollout
    engine's step bookkeeping then keeps the GPU idle), so on CUDA the values go through pinned memory with a
    non-blocking copy, in stream order like any other."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def kv_read_bytes(config, positions: int, elem: int) -> int:
    """Cache bytes one sequence's decode step reads at least when its token attends ``positions`` positions (itself
    included; the token fed at position ``p`` attends ``p + 1``): in each trunk layer the window rows (up to
    ``window_size``), the compressed entries its attention reads (a CSA layer's indexer top-k of its
    ``positions // 4``, an HCA layer's all ``positions // ratio``) and a CSA layer's index keys, every one of
    which its indexer scores; ``elem`` bytes a value (the cache holds the model's dtype). The compressors'
    running state is not counted. Why: issue #32's roofline of a decode step counts the KV bytes it reads next
    to the weights; the rollout engine sums this over its decode steps (``decode_kv_bytes`` of
    ``generate_timing``) and ``bench.rollout`` over a call's."""
    D, W = config.head_dim, config.window_size
    values = 0
    for layer in range(config.n_layers):
        values += min(positions, W) * D
        kind, ratio = config.layer_kind(layer), config.compress_ratios[layer]
        if kind == "csa":
            values += min(positions // ratio, config.index_topk) * D + (positions // ratio) * config.index_head_dim
        elif kind == "hca":
            values += (positions // ratio) * D
    return values * elem


def _select_tensors(obj, rows: torch.Tensor, on: Dict[torch.device, torch.Tensor]):
    """A copy of a cache dataclass with every tensor field indexed by ``rows`` along dim 0; ``on``: ``rows`` on
    each device seen so far (one copy a device, not a waiting copy a tensor)."""
    changes = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            if v.device not in on:
                on[v.device] = to_device(rows, v.device)
            changes[f.name] = v.index_select(0, on[v.device])
        elif isinstance(v, CompressorCache):
            changes[f.name] = _select_tensors(v, rows, on)
    return replace(obj, **changes)


@dataclass
class DecodeCache:
    """The caches of ``B`` sequences (rows) for every trunk layer."""

    layers: List[LayerCache]
    pos: torch.Tensor        # [B] long, on the CPU: tokens each row holds (= the next token's position)
    max_len: int             # capacity: positions 0 .. max_len - 1

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    def select(self, rows) -> "DecodeCache":
        """The cache of rows ``rows`` (a list or a long tensor; repeats copy a row, e.g. one prompt's prefill
        for its ``n`` samples; leaving rows out drops finished sequences)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        on: Dict[torch.device, torch.Tensor] = {}
        return DecodeCache([_select_tensors(lc, rows, on) for lc in self.layers], self.pos.index_select(0, rows),
                           self.max_len)


# ------------------------------------------------------------------ prefill
def _tail_state(comp: Compressor, x: torch.Tensor, lengths: torch.Tensor, n_entries: int,
                entries: Optional[torch.Tensor]) -> CompressorCache:
    """The state a compressor holds after ``lengths[b]`` tokens of ``x [B, S, d]`` (its input), with
    ``entries [B, >=, c]`` the prefill's pooled entries (None: none were pooled)."""
    B, S, _ = x.shape
    m, c = comp.ratio, comp.head_dim
    ct = compute_dtype(x)
    start = (lengths // m) * m - (m if comp.overlap else 0)          # first position of the slots to fill
    slots = (m * 2) if comp.overlap else m
    posn = (start.to(x.device)[:, None] + torch.arange(slots, device=x.device)[None, :]).clamp(0, S - 1)
    xs = torch.gather(x, 1, posn[..., None].expand(-1, -1, x.shape[-1]))
    a = linear_fp32(xs, comp.wkv.weight).to(ct)
    ape = comp.ape.to(ct).repeat(slots // m, 1)
    z = linear_fp32(xs, comp.wgate.weight).to(ct) + ape
    prev_a = prev_z = None
    if comp.overlap:
        has_prev = (lengths >= m).to(x.device)[:, None, None]
        prev_a = torch.where(has_prev, a[:, :m, :c], torch.zeros_like(a[:, :m, :c]))
        prev_z = torch.where(has_prev, z[:, :m, :c], torch.full_like(z[:, :m, :c], float("-inf")))
        a, z = a[:, m:], z[:, m:]
    out = x.new_zeros(B, n_entries, c)
    if entries is not None and entries.shape[1]:
        k = min(entries.shape[1], n_entries)
        out[:, :k] = entries[:, :k].to(out.dtype)
    return CompressorCache(a.contiguous(), z.contiguous(), prev_a, prev_z, out)


def _layer_cache(attn, got: dict, lengths: torch.Tensor, max_len: int) -> LayerCache:
    """One layer's cache from what its attention computed in prefill (``got``: its input ``x``, the KV before
    RoPE ``kv``, and the entries ``comp`` / ``index`` of the compressors that ran), read at each row's length."""
    kv_pre = got["kv"]
    B, S, D = kv_pre.shape
    dev, W = kv_pre.device, attn.window
    cos, sin = rope_cos_sin(attn.inv_freq.to(dev), torch.arange(S, device=dev))
    kv = (apply_rope if attn.ops is None else attn.ops.apply_rope)(kv_pre, cos, sin)   # the forward's window rows
    # ring row s holds the last position p < length with p % W == s (p < 0: empty, masked when read)
    s = torch.arange(W)
    p = (lengths[:, None] - 1) - ((lengths[:, None] - 1 - s[None, :]) % W)
    window = torch.gather(kv, 1, p.clamp(0, S - 1).to(dev)[..., None].expand(-1, -1, D))
    window = torch.where((p >= 0).to(dev)[..., None], window, torch.zeros_like(window))
    comp = index = None
    if attn.ratio:
        comp = _tail_state(attn.compressor, got["x"], lengths, max_len // attn.ratio, got.get("comp"))
        window, comp = torch.cat((window, comp.entries), dim=1), replace(comp, entries=None)   # one buffer
        if attn.ratio == 4:
            index = _tail_state(attn.indexer.compressor, got["x"], lengths, max_len // 4, got.get("index"))
    return LayerCache(window.contiguous(), comp, index)


@contextlib.contextmanager
def _capture(model, lengths: torch.Tensor, max_len: int):
    """Forward hooks that build each trunk layer's cache when its attention has run, from the attention's
    input, the KV before RoPE and the entries of each compressor (absent when a compressor did not run:
    fewer tokens than its ratio); only the caches outlive the layer."""
    caches: List[Optional[LayerCache]] = [None] * len(model.layers)
    got = {}
    handles = []

    def keep(key):
        return lambda mod, args, out: got.__setitem__(key, out)

    def build(i):
        def hook(mod, args, out):
            caches[i] = _layer_cache(mod, {**got, "x": args[0]}, lengths, max_len)
            got.clear()
        return hook

    for i, layer in enumerate(model.layers):
        attn = layer.attn
        handles.append(attn.kv_norm.register_forward_hook(keep("kv")))
        if attn.ratio:
            handles.append(attn.compressor.register_forward_hook(keep("comp")))
            if attn.ratio == 4:
                handles.append(attn.indexer.compressor.register_forward_hook(keep("index")))
        handles.append(attn.register_forward_hook(build(i)))
    try:
        yield caches
    finally:
        for h in handles:
            h.remove()


def _final_logits(model, x: torch.Tensor) -> torch.Tensor:
    """Trunk streams ``[B, L, n, d]`` -> fp32 logits ``[B, L, V]``: ``DeepseekV4Model.forward``'s head, with
    the head GEMM the training implementations run (:func:`.layers.linear_fp32`, as miles' and megatron's
    output layers): for a bf16 model one bf16 GEMM with an fp32 result on a GPU instead of an fp32 copy of
    the ``[V, d]`` head weight and an fp32 GEMM every step (the same products, exact in fp32, summed in
    another order); the very same computation in fp32, fp64 and on the CPU."""
    return linear_fp32(model.collapse(x), model.head.weight)


def prefill(model, prompts: Sequence[Sequence[int]], *, max_len: int, device=None):
    """Run the prompts (lists of token ids, any lengths >= 1) as one right-padded batch.

    Returns ``(cache, logits)``: the :class:`DecodeCache` of the ``len(prompts)`` rows, with room for
    ``max_len`` positions per row, and the fp32 logits ``[B, V]`` at each prompt's last token."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    if not len(prompts) or int(lengths.min()) < 1:
        raise ValueError("prefill needs at least one prompt, each of at least one token")
    S = int(lengths.max())
    if max_len < S:
        raise ValueError(f"max_len {max_len} is shorter than the longest prompt ({S} tokens)")
    device = device if device is not None else model.embed.weight.device
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    ids = ids.to(device)
    with _capture(model, lengths, max_len) as layers:
        streams = model.hidden_streams(ids)
    last = (lengths - 1).to(device)
    logits = _final_logits(model, streams[torch.arange(len(prompts), device=device), last].unsqueeze(1))[:, 0]
    return DecodeCache(layers, lengths.clone(), max_len), logits


# -------------------------------------------------------------- decode step
def pool_slots(a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """A compressor's entry from one block's slots ``a, z [B, slots, c]``: per channel, the softmax of the gate
    scores ``z`` over the slots weighting ``a`` (``Compressor.forward``'s pooling), -> ``[B, c]``.

    Why the slots go last: torch's softmax over a middle dim runs its spatial kernel, which took 101 us for a
    decode step's three calls at one sequence and 114 us at 64 on an H200 (eager profile,
    ``bench/results/rollout-h200-flash-shaped-triton-eager-inner-scan.json``), for a few hundred KB; over the
    last dim it is the per-row kernel. The same sums as over dim 1, in the order of a row reduction."""
    return (torch.softmax(z.transpose(1, 2), dim=-1) * a.transpose(1, 2)).sum(dim=-1)


def _compress_step(comp: Compressor, x: torch.Tensor, cc: CompressorCache, pos: torch.Tensor,
                   inv_freq: torch.Tensor, memo: Optional[dict] = None, into: Optional[tuple] = None) -> None:
    """Add one token per row (``x [B, 1, d]`` at positions ``pos``, CPU) to the compressor state and pool
    the entry of every block it completes (in place), into ``(buffer, first row)`` (default ``(cc.entries, 0)``;
    the attention's compressor: the layer's buffer after its ring). ``memo``: unused (nothing to share)."""
    buf, first = (cc.entries, 0) if into is None else into
    B = x.shape[0]
    m, c = comp.ratio, comp.head_dim
    ct = cc.a.dtype
    dev = x.device
    rows = torch.arange(B, device=dev)
    slot = (pos % m).to(dev)
    cc.a[rows, slot] = linear_fp32(x[:, 0], comp.wkv.weight).to(ct)
    cc.z[rows, slot] = linear_fp32(x[:, 0], comp.wgate.weight).to(ct) + comp.ape.to(ct)[slot]
    done = torch.nonzero((pos + 1) % m == 0).flatten()          # host positions: no device sync
    if not len(done):
        return
    e = done.to(dev)
    a, z = cc.a[e], cc.z[e]
    if comp.overlap:   # entry i pools block i-1's first-half channels and block i's second half (2m slots)
        a = torch.cat((cc.prev_a[e], a[..., c:]), dim=1)
        z = torch.cat((cc.prev_z[e], z[..., c:]), dim=1)
    pooled = pool_slots(a, z)
    pooled = comp.norm(pooled.to(buf.dtype))
    block = pos[done] // m
    cos, sin = rope_cos_sin(inv_freq.to(dev), (block * m).to(dev)[:, None], compute_dtype(x))
    pooled = (apply_rope if comp.ops is None else comp.ops.apply_rope)(pooled[:, None], cos, sin)[:, 0]
    if comp.rotate:
        pooled = (hadamard_transform if comp.ops is None else comp.ops.hadamard_transform)(pooled)
    buf[e, first + block.to(dev)] = pooled
    if comp.overlap:
        cc.prev_a[e] = cc.a[e, :, :c]
        cc.prev_z[e] = cc.z[e, :, :c]


def _index_step(indexer, x: torch.Tensor, cq: torch.Tensor, cc: CompressorCache, pos: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, memo: Optional[dict] = None, window: int = 0) -> torch.Tensor:
    """The Lightning Indexer's top-k picks ``[B, k]`` (entry ids, -1 = none) for one query per row: over the
    entries each row's position has completed, the forward's rule (:func:`~.topk.decode_topk`; in an eager static
    step the table's one-launch ``decode_topk`` where it has one, :func:`eager_op`). With ``window`` (the cache
    holds entries): the attention's rows ``[B, window + k]``, the ring's written rows then the picks past it."""
    B = x.shape[0]
    N = cc.entries.shape[1]
    if N == 0:
        return torch.empty(B, 0, dtype=torch.long, device=x.device)
    ops = indexer.ops
    ct, it = compute_dtype(x), indexer_input_dtype(ops, x.dtype)
    q = projected(memo, indexer.wq_b.weight, lambda: indexer.wq_b(cq))     # with the query's (query_projections)
    q = q.view(B, 1, indexer.n_heads, indexer.head_dim)
    fused = eager_op(ops, memo, "index_query")           # the rotation, the transform and the casts at once
    if fused is not None:
        q = fused(q, cos, sin, it)
    else:
        q = (apply_rope if ops is None else ops.apply_rope)(q, cos, sin)
        q = (hadamard_transform if ops is None else ops.hadamard_transform)(q.to(ct)).to(it)
    w = projected(memo, indexer.weights_proj.weight, lambda: indexer.weights_proj(x)).to(ct) \
        * (indexer.head_dim * indexer.n_heads) ** -0.5
    scores = (indexer_scores if ops is None else ops.indexer_scores)(q, cc.entries.to(it), w)[:, 0]  # [B, N]
    # the forward's rule (stable_topk): the same picks on a row of any length
    return (eager_op(ops, memo, "decode_topk") or decode_topk)(scores, pos.to(x.device), indexer.ratio,
                                                               indexer.topk, window)


# one device tensor per set of RoPE frequencies and device (device_inv_freq): constants, shared by every layer
_DEVICE_FREQS: Dict[Tuple[tuple, str], torch.Tensor] = {}


def device_inv_freq(attn, dev: torch.device) -> torch.Tensor:
    """``attn.inv_freq`` (a CPU float64 attribute) on ``dev``, copied once per device and kept on the module:
    a CUDA-graph capture cannot record a copy from host memory. Layers with equal frequencies get the same tensor,
    so a step's memo names a set of frequencies by it (:func:`step_once`: layers alike rotate by the same angles)."""
    got = getattr(attn, "_inv_freq_on", None)
    if got is None or got.device != dev:
        key = (tuple(attn.inv_freq.tolist()), str(dev))
        got = _DEVICE_FREQS.get(key)
        if got is None:
            got = _DEVICE_FREQS[key] = attn.inv_freq.to(dev)
        attn._inv_freq_on = got
    return got


# angle tables (angle_table): {(id of the device frequencies, stride, capacity, dtype): (those frequencies, table)}
_ANGLE_TABLES: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


def angle_table(inv_freq: torch.Tensor, stride: int, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[2, max_len // stride + 1, r/2]``: the cos (``[0]``) and sin (``[1]``) of :func:`~.rope.rope_cos_sin` at
    the positions ``stride * i`` up to ``max_len`` (slots of that capacity: every position, or with ``stride m``
    every block's first, a position of ``max_len`` included, which an inactive slot may hold), in ``dtype``, on
    ``inv_freq``'s device (a :func:`device_inv_freq` tensor), made once and kept. Why: a decode step's angles from
    its positions were six small kernels per set of frequencies (a cast, a product, cos, sin, two casts), every
    layer's attention and every compressor ratio; a
    row of this table is one gather (:func:`table_angles`) with the same values, bit for bit (the same
    elementwise kernels made it). Made by the static step's host-side checks, before a CUDA graph records
    the step (``kernels.reference.slots.static_step_checks``). The key holds the frequencies themselves, so
    their ``id`` stays theirs."""
    key = (id(inv_freq), int(stride), int(max_len), dtype)
    got = _ANGLE_TABLES.get(key)
    if got is None:
        positions = torch.arange(max_len // stride + 1, device=inv_freq.device) * stride
        got = _ANGLE_TABLES[key] = (inv_freq, torch.stack(rope_cos_sin(inv_freq, positions, dtype)))
    return got[1]


def table_angles(table: torch.Tensor, index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [B, 1, r/2]`` of :func:`angle_table` ``table``'s rows ``index [B]`` (one gather)."""
    rows = table.index_select(1, index)
    return rows[0][:, None], rows[1][:, None]


def eager_op(ops, memo: Optional[dict], name: str):
    """The op table ``ops``' extra op ``name`` in an eager static step (its ``memo`` holds the slots' capacity),
    else None: traced, the torch code is what Inductor fuses, and the dynamic step has no such ops. The engine's
    decode table holds such an op only where it takes the engine's inputs (``rollout.engine_ops.decode_choices``)."""
    if (memo is None or "max_len" not in memo or ops is None or name not in ops.names()
            or torch.compiler.is_compiling()):
        return None
    return getattr(ops, name)


def layer_projections(attn, x: torch.Tensor, memo: Optional[dict]) -> None:
    """In an eager static step whose table has ``linear_group`` (:func:`eager_op`), every projection of the
    attention's input ``x [B, 1, d]`` by a weight in ``x``'s dtype at once: ``wq_a``, ``wkv``, each compressor's
    ``wkv`` and ``wgate`` (fp32 results) and the indexer's ``weights_proj``, one launch where they were up to seven
    GEMMs (and their split-K reductions). ``memo["projected"]`` then holds ``{id(weight): output}`` for this
    layer's readers (:func:`projected`); otherwise it holds nothing and each GEMM runs where it is used."""
    if memo is not None:
        memo.pop("projected", None)                   # the previous layer's
    lin = [(attn.wq_a.weight, False), (attn.wkv.weight, False)]
    if attn.ratio:
        comps = (attn.compressor,) + ((attn.indexer.compressor,) if attn.ratio == 4 else ())
        for comp in comps:
            lin += [(comp.wkv.weight, True), (comp.wgate.weight, True)]
        if attn.ratio == 4:
            lin.append((attn.indexer.weights_proj.weight, False))
    _project_group(attn.ops, x, memo, lin)


def query_projections(attn, cq: torch.Tensor, memo: Optional[dict]) -> None:
    """Likewise (:func:`layer_projections`) the projections of the query's low rank ``cq [B, 1, q_lora]``: the
    query's ``wq_b`` and a CSA layer's indexer ``wq_b``, one launch where they were a GEMM each. Why: at one token
    ``linear_group`` read them at 31.1 us a CSA layer where cuBLAS's two GEMMs took 33.9 (H100, L2-cold,
    ``bench/results/kernels-decode-sweep-h100-projections.json``)."""
    lin = [(attn.wq_b.weight, False)] + ([(attn.indexer.wq_b.weight, False)] if attn.ratio == 4 else [])
    _project_group(attn.ops, cq, memo, lin)


def _project_group(ops, x: torch.Tensor, memo: Optional[dict], lin: list) -> None:
    """``linear_group`` of ``x`` by the weights of ``lin`` ``[(weight, fp32 result)]`` held in ``x``'s dtype (a weight
    held in another dtype: its own GEMM where it is used), into ``memo["projected"]``; nothing outside an eager
    static step whose table has the op."""
    fused = eager_op(ops, memo, "linear_group")
    lin = [(w, f) for w, f in lin if w.dtype == x.dtype]
    if fused is None or not lin:
        return
    outs = fused(x, [w for w, _ in lin], [f for _, f in lin])
    memo.setdefault("projected", {}).update({id(w): y for (w, _), y in zip(lin, outs)})


def eager_linear(ops, memo: Optional[dict], x: torch.Tensor, weight: torch.Tensor, fp32: bool, make):
    """``x @ weight^T`` (fp32 with ``fp32``) through the table's ``linear_group`` in an eager static step
    (:func:`eager_op`; ``weight`` in ``x``'s dtype), else ``make()`` (the GEMM itself). Why: at one token the
    kernel read the attention's ``wo_b`` at 26.4 us against cuBLAS's 27.9 (a split-K GEMM and its reduction) and
    the output head at 345.2 against 377.7 (H100, L2-cold,
    ``bench/results/kernels-decode-sweep-h100-projections.json``);
    above its token limit it runs that GEMM."""
    fused = eager_op(ops, memo, "linear_group")
    if fused is None or weight.dtype != x.dtype:
        return make()
    return fused(x, [weight], [fp32])[0]


def projected(memo: Optional[dict], weight: torch.Tensor, make) -> torch.Tensor:
    """This layer's projection by ``weight`` from :func:`layer_projections`, else ``make()`` (the GEMM itself)."""
    got = None if memo is None else memo.get("projected", {}).get(id(weight))
    return make() if got is None else got


def step_once(memo: Optional[dict], key, make):
    """``make()``; with a step's ``memo`` (a dict), made by the first layer that asks for ``key`` and reused by the
    step's other layers. Why: every layer of a decode step writes the same ring slots, masks the same window,
    and rotates by the same angles (per set of frequencies), and eagerly each of these is a few small kernels per
    layer (a step of the eager Flash-shaped engine was about a thousand kernels, most of its time at one
    sequence). A compiled layer gets None and computes them inside its graph, where Inductor fuses them."""
    if memo is None:
        return make()
    got = memo.get(key)
    if got is None:
        got = memo[key] = make()
    return got


def _attend(attn, x: torch.Tensor, lc: LayerCache, pos: torch.Tensor, compress=None,
            picks: Optional[list] = None, memo: Optional[dict] = None, project=None) -> torch.Tensor:
    """``Attention.forward`` for one new token per row: ``x [B, 1, d]`` (attn_norm-ed) -> ``[B, 1, d]``.

    ``pos``: the rows' positions, on the host (this module's steps) or on the device (``slots``'s static
    step); ``compress(comp, x, cache, pos, inv_freq)`` adds the token to a compressor (default
    :func:`_compress_step`, which needs host positions). ``picks``: a list the indexer's top-k ``[B, k]`` of a
    CSA layer is appended to (indexer replay's recording). ``memo``: the step's values shared by its layers
    (:func:`step_once`; the static step's eager layers, whose memo also holds the slots' capacity ``"max_len"``:
    their angles are rows of :func:`angle_table`), passed on to ``compress``. ``project(u, weight)``: the output
    projection ``wo_b`` of the grouped output ``u [B, 1, G R]`` in :func:`eager_linear`'s place, its result returned
    as it is (``kernels.reference.slots.decode_layer``'s, with the site's mHC post: ``linear_post``)."""
    compress = compress or _compress_step
    B = x.shape[0]
    H, D, W = attn.n_heads, attn.head_dim, attn.window
    dev = x.device
    pos_d = pos.to(dev)
    inv_freq = device_inv_freq(attn, dev)
    ct = compute_dtype(x)

    def angles():    # [B, 1, r/2], in the compute dtype the rotations cast them to (the same values): cast once
        if memo is not None and "max_len" in memo:      # the static step's eager layers: a row of a table
            return table_angles(angle_table(inv_freq, 1, memo["max_len"], ct), pos_d)
        return rope_cos_sin(inv_freq, pos_d[:, None], ct)

    # the memo names the frequencies by their shared device tensor (device_inv_freq; never read when compiled)
    cos, sin = angles() if memo is None else step_once(memo, ("rope", id(inv_freq), ct), angles)

    ops = attn.ops
    rope = apply_rope if ops is None else ops.apply_rope
    layer_projections(attn, x, memo)
    wkv = projected(memo, attn.wkv.weight, lambda: attn.wkv(x))
    cq = attn.q_norm(projected(memo, attn.wq_a.weight, lambda: attn.wq_a(x)))
    query_projections(attn, cq, memo)
    qb = projected(memo, attn.wq_b.weight, lambda: attn.wq_b(cq))
    rows_op = eager_op(ops, memo, "attention_rows")      # a window or HCA layer's rows in one launch
    idx = step_once(memo, ("window", W), lambda: _window(W, pos_d) if rows_op is None else rows_op(pos_d, W))
    fused = eager_op(ops, memo, "norm_rope")      # the norms, rotations and the ring's write, one launch each
    if fused is not None:
        q = fused(qb.view(B, 1, H, D), None, attn.eps, cos, sin)
        fused(wkv, attn.kv_norm.weight, attn.kv_norm.eps, cos, sin, lc.window, pos_d, W)
    else:
        q = (rms_normalize if ops is None else ops.rms_normalize)(qb.view(B, 1, H, D), attn.eps,
                                                                 x.dtype)
        q = rope(q, cos, sin)
        rows, ring = step_once(memo, ("ring", W), lambda: (torch.arange(B, device=dev), pos_d % W))
        lc.window[rows, ring] = rope(attn.kv_norm(wkv), cos, sin)[:, 0]
    if attn.ratio:
        # the compressed entries follow the ring in the layer's buffer (module docstring)
        compress(attn.compressor, x, lc.compressor, pos, inv_freq, memo, (lc.window, W))
        if attn.ratio == 4:
            compress(attn.indexer.compressor, x, lc.indexer, pos, inv_freq, memo)
            if picks is None and lc.indexer.entries.shape[1]:      # the ring's rows and the picks past it at once
                idx = _index_step(attn.indexer, x, cq, lc.indexer, pos, cos, sin, memo, W)
            else:
                cidx = _index_step(attn.indexer, x, cq, lc.indexer, pos, cos, sin, memo)
                if picks is not None:
                    picks.append(cidx)
                idx = torch.cat((idx, torch.where(cidx >= 0, cidx + W, cidx)), dim=-1)
        else:    # every completed entry: the same rows for every layer of this ratio and capacity (step_once)
            N = lc.window.shape[1] - W
            idx = step_once(memo, ("entries", attn.ratio, lc.window.shape[1], W),
                            lambda: rows_op(pos_d, W, attn.ratio, N) if rows_op is not None
                            else _all_entries(idx, pos_d, attn.ratio, N, W))

    unrotated = eager_op(ops, memo, "attention_inverse_rope")    # the attention and its output's rotation back
    if unrotated is not None:
        o = unrotated(q, lc.window, idx[:, None], attn.attn_sink, attn.scale, cos, sin)
    else:
        attend = sparse_attention_with_sink if ops is None else ops.sparse_attention_with_sink
        o = rope(attend(q, lc.window, idx[:, None], attn.attn_sink, attn.scale), cos, sin, inverse=True)
    G, R = attn.o_groups, attn.o_lora_rank
    o = o.reshape(B, 1, G, H * D // G)
    wo_a = attn.wo_a.weight.to(o.dtype).view(G, R, H * D // G)
    # eagerly the grouped low-rank projection: the table's one-launch grouped_projection in an eager static step,
    # else one batched GEMM writing token-major rows (the trainer's, miles'), where the einsum's result is a
    # group-major copy away from them (a launch a layer); traced (its bmm's out= is not), the einsum, which
    # Inductor lays out itself
    if torch.compiler.is_compiling():
        u = torch.einsum("bsgd,grd->bsgr", o, wo_a)
    else:
        u = (eager_op(ops, memo, "grouped_projection") or grouped_projection)(o, wo_a)
    if project is not None:
        return project(u.flatten(2), attn.wo_b.weight)
    return eager_linear(ops, memo, u.flatten(2), attn.wo_b.weight, False, lambda: attn.wo_b(u.flatten(2)))


def _all_entries(idx: torch.Tensor, pos: torch.Tensor, ratio: int, N: int, W: int) -> torch.Tensor:
    """The window's rows ``idx [B, W]`` followed by every entry of the ``N`` after the ring that each row's
    position has completed (``j < (pos + 1) // ratio``; ``-1`` for the rest): an HCA layer's attention rows."""
    j = torch.arange(N, device=pos.device)[None, :]
    return torch.cat((idx, torch.where(j < ((pos + 1) // ratio)[:, None], j + W, -1)), dim=-1)


def decode_step(model, cache: DecodeCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row (``tokens [B]`` long, at the positions ``cache.pos``) and return the fp32
    logits ``[B, V]`` of the next token. Updates ``cache`` in place (``pos`` advances by one)."""
    if tokens.dim() != 1 or tokens.shape[0] != cache.batch:
        raise ValueError(f"decode_step: want {cache.batch} tokens (one per row), got shape {tuple(tokens.shape)}")
    if int(cache.pos.max()) >= cache.max_len:
        raise ValueError(f"decode_step: a row is full (max_len {cache.max_len})")
    ids = tokens.to(model.embed.weight.device)[:, None]                         # [B, 1]
    x = model.embed(ids).unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    for layer, lc in zip(model.layers, cache.layers):                           # Block.forward, one token
        u, post, comb = layer._hc("attn", x)
        x = layer.hc_post(_attend(layer.attn, layer.attn_norm(u), lc, cache.pos), x, post, comb)
        u, post, comb = layer._hc("ffn", x)
        x = layer.hc_post(layer.ffn(layer.ffn_norm(u), ids), x, post, comb)
    cache.pos += 1
    return _final_logits(model, x)[:, 0]
