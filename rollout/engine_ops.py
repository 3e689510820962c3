"""Which kernel backend serves each op of the built-in rollout engine, in prefill and in the decode step.

Why: the engine (:class:`rollout.reference_engine.ReferenceEngine`) runs the reference model's math with the run's kernel
backend (``--kernel-backend``; the assembly hands it the run's op table). Its **prefill** calls that table the
way the training forward does, so an input a kernel does not take is refused there, with the fix, exactly as
in training. The **decode step** feeds one token per slot, at other shapes (``S = 1``, the whole cache as
keys), and is recorded into CUDA graphs on a GPU. A GPU kernel that cannot serve that input refuses it (the
backends' contract: a ``ValueError`` that gives the reason). Failing every rollout for it would be wrong, and
handing the input to the reference op behind the caller's back would be a silent fallback. So the engine
decides once, when it is built: :func:`decode_choices` gives each op the engine calls the inputs of a one-token
decode step (the engine's dtypes and device, the model's head sizes) and keeps the run's kernel where it takes
them, and the reference op (backend ``none``) where it refuses. The choice and the refusal are recorded on
the engine (``engine.decode_ops`` ``{op: backend}``, ``engine.decode_refusals`` ``{op: reason}``) and logged
once. Only ``ValueError`` counts as a refusal; any other error is a bug and propagates.

The probes call each op's own function (not the counting wrapper of ``core.kernel_ops``), so
:func:`core.kernel_ops.kernels_ran` counts only the engine's real work.

The KV-cached decode step calls ops that prefill does not: ``weighted_swiglu`` (the shared expert's activation
at weight 1, and on the grouped path the routed experts' between their two grouped GEMMs) and, where the decode
MoE takes the grouped path (bf16 on a Hopper or newer GPU: :func:`kernels.reference.slots.grouped_decode_ok`), a
backend's ``experts_grouped_mm`` (the triton backend's decode kernel for those GEMMs) and, in an eager step, its
``route_experts`` and ``expert_order`` (the router, and the pairs in expert order, one launch each) and, where it has
all three, ``experts_gather_mm``, ``experts_scatter_mm`` and ``moe_combine`` (the expert GEMMs reading the tokens and
writing the pairs through that order, and the pairs' sum with the shared expert, one launch), and with them
``experts_swiglu_scatter_mm`` where it takes the step's inputs (:func:`swiglu_scatter_inputs`; the activation in the
second GEMM's operand load, where ``weighted_swiglu`` and ``experts_scatter_mm`` were two launches; refused, the step
runs those two and the refusal is recorded) and ``moe_combine_post`` likewise (:func:`combine_post_inputs`; the
pairs' sum inside the MoE's mHC post, where ``moe_combine`` and ``hc_post`` were two launches);
``decode_ops`` names them there, so the record lists
every kernel a generate call runs. Likewise a backend's ``compressor_step`` (a compressor's step after its GEMMs in
one launch, ``kernels/triton/compress.py``), in an eager step of a model with compressed layers, and its
``norm_rope`` (the attention's query norm and rotation, and its key's norm, rotation and write into the ring, one
launch each, ``kernels/triton/norm_rope.py``), ``decode_topk`` (a CSA layer's indexer picks in one launch,
``kernels/triton/topk.py``), ``index_query`` (the indexer's query rotation, transform and casts in one,
``kernels/triton/index_query.py``), ``linear_group`` (the projections of
a layer's attention input, ``wq_a``, ``wkv``, the compressors' and the indexer's weights, in one launch at a few
tokens, and likewise the query's ``wq_b`` with the indexer's and the output head,
``kernels/triton/linear_group.py``), ``grouped_projection`` (the attention's grouped ``wo_a`` with that kernel's
row blocks), ``linear_post`` (its ``wo_b`` with the site's mHC post in that kernel's epilogue; refused, ``wo_b``
goes through ``linear_group``), ``hc_pre_norm`` (a site's mHC pre and its sublayer's norm in one
launch at a few tokens) and ``hc_head_norm`` (the head's collapse and the final norm, likewise;
``kernels/triton/mhc_decode.py``), ``attention_rows`` (a window or HCA layer's attention rows, the ring rows
written and the entries completed, in one launch, ``kernels/triton/topk.py``), ``attention_inverse_rope`` (a layer's
sparse attention with its output's inverse rotation in one launch, ``kernels/triton/attention.py``), where they take
the step's inputs
(:data:`EAGER_EXTRAS`); where one refuses them the step runs the torch code and the refusal is recorded like an op's.

A **compiled** decode step (the engine's ``compile``) keeps the reference op for :data:`INDUCTOR_FUSES`: the
norms, RoPE, the Hadamard rotation and the experts' activation are a few element-wise passes that Inductor fuses
with the code around them, while a kernel backend's op is an opaque node of the compiled graph (a launch of its
own that nothing fuses into). Eagerly each of them is one kernel in place of the reference's five to two dozen
(casts, a square, a mean, an rsqrt, products, stacks and a concatenation; the rotation's butterfly stages), so
the eager step takes the backend's. ``decode_ops`` says which ran (``none`` for those in a compiled step).

The **sampler** (``rollout.reference_engine.sample_tokens``) takes a table's extra op ``draw_tokens`` (the triton
backend's: ``kernels/triton/sampling.py``) for calls at top-p 1 without top-k, where it takes the probe's inputs
(:func:`sampler_choice`); it is recorded apart (``engine.sample_ops``): it runs after the decode step, never
inside its graph. Calls with top-p below 1 or a top-k sort the distribution with torch (the kernel has no
truncation). Where the table also has ``draw_record`` and it takes a probe's inputs (:func:`record_choice`), a
decode step's draw of such a call writes the engine's records of it in the same launch (the sample's next
uniform, its token and log-probability, the slot's next input, the stop flags: seven launches of torch otherwise);
recorded in ``engine.sample_ops`` too.

``sinkhorn`` is not called on its own: the reference model's ``hc_pre`` (and a backend's fused one) runs the
Sinkhorn iterations inside, so it is served by whichever backend serves ``hc_pre``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from core.kernel_ops import OpTable
from kernels.reference.slots import COMBINE_POST, PAIR_KERNELS, SWIGLU_SCATTER, grouped_decode_ok

__all__ = ["ENGINE_OPS", "INDUCTOR_FUSES", "EAGER_EXTRAS", "engine_ops", "decode_choices", "decode_inputs",
           "compressor_inputs", "norm_rope_inputs", "decode_topk_inputs", "index_query_inputs",
           "linear_group_inputs", "hc_pre_norm_inputs", "hc_head_norm_inputs", "attention_rows_inputs",
           "attention_inverse_rope_inputs",
           "grouped_projection_inputs", "linear_post_inputs", "swiglu_scatter_inputs", "combine_post_inputs",
           "sampler_choice", "record_choice"]

# the ops the reference model calls through its modules' op tables (kernels.reference.model.ops_in_use), in
# prefill and in the decode step
ENGINE_OPS = ("sparse_attention_with_sink", "indexer_scores", "hadamard_transform", "hc_pre", "hc_post", "hc_head",
              "rms_norm", "rms_normalize", "apply_rope")

# the ops a compiled decode step keeps as reference code, for Inductor to fuse (module docstring)
INDUCTOR_FUSES = ("rms_norm", "rms_normalize", "apply_rope", "hadamard_transform", "weighted_swiglu")


def _has_csa(config) -> bool:
    """Whether ``config``'s trunk has CSA (ratio 4) layers, the only ones with an indexer."""
    return 4 in tuple(config.compress_ratios[: config.n_layers])


def engine_ops(config) -> Tuple[str, ...]:
    """The ops a generate call of ``config``'s model calls: the indexer's only with CSA (ratio 4) layers."""
    return tuple(n for n in ENGINE_OPS if _has_csa(config) or n not in ("indexer_scores", "hadamard_transform"))


def decode_inputs(config, dtype: torch.dtype, device, table: Optional[OpTable] = None) -> Dict[str, list]:
    """Per op, the argument tuples a one-token decode step passes it (one slot, a few keys), in the dtypes the
    engine uses there: the model's ``dtype`` for streams, queries and KV, fp32 for the mHC coefficients and
    the sink, the compute dtype (fp32; fp64 for an fp64 model) for the indexer's weights and the query's
    Hadamard rotation, and for the indexer's ``q`` and ``k`` the dtype the decode step casts them to for
    ``table`` (:func:`kernels.reference.indexer.indexer_input_dtype`: the model's dtype for a bf16/fp16
    kernel, else the compute dtype; None: the reference ops). The norms at every width the model normalises
    (the streams, the query's low rank, a head, the indexer's head; weights in fp32 or the model's dtype, as
    the engine may hold them), RoPE on every tensor the step rotates (float64 angles, one per row), the experts'
    activation on a few rows."""
    from kernels.reference.indexer import indexer_input_dtype

    c = config
    g = torch.Generator().manual_seed(0)
    ct = torch.promote_types(dtype, torch.float32)
    it = indexer_input_dtype(table, dtype)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dt)

    n, d, H, D, K = c.hc_mult, c.dim, c.n_heads, c.head_dim, 4
    mix = (2 + n) * n
    x = r(1, 1, n, d)
    idx = torch.tensor([[[0, 1, 2, -1]]], dtype=torch.long, device=device)
    out = {
        "sparse_attention_with_sink": [(r(1, 1, H, D), r(1, K, D), idx, r(H, dt=torch.float32), D ** -0.5)],
        "hc_pre": [(x, r(mix, n * d, dt=torch.float32), r(3, dt=torch.float32), r(mix, dt=torch.float32),
                    c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)],
        "hc_post": [(r(1, 1, d), x, r(1, 1, n, dt=torch.float32), r(1, 1, n, n, dt=torch.float32))],
        "hc_head": [(x, r(n, n * d, dt=torch.float32), r(1, dt=torch.float32), r(n, dt=torch.float32),
                     c.norm_eps, c.hc_eps)],
    }
    HI, cI = c.index_n_heads, c.index_head_dim
    out["indexer_scores"] = [(r(1, 1, HI, cI, dt=it), r(1, K, cI, dt=it), r(1, 1, HI, dt=ct))]
    # the indexer's query (compute dtype) and a pooled entry of the indexer's compressor (the model's dtype)
    out["hadamard_transform"] = [(r(1, 1, HI, cI, dt=ct),), (r(1, cI),)]
    # blocks' and the head's [b, 1, width] rows; a compressor's pooled entries [b, width]
    out["rms_norm"] = [(x, r(w, dt=wd), c.norm_eps) for w in sorted({d, c.q_lora_rank, D, cI})
                       for x in (r(1, 1, w), r(1, w)) for wd in (torch.float32, dtype)]
    out["rms_normalize"] = [(r(1, 1, H, D), c.norm_eps, dtype)]
    cs, sn = (r(1, 1, c.rope_head_dim // 2, dt=torch.float64) for _ in range(2))
    out["apply_rope"] = [(r(1, 1, H, D), cs, sn), (r(1, 1, H, D), cs, sn, True), (r(1, 1, D), cs, sn),
                         (r(1, 1, HI, cI), cs, sn), (r(1, 1, cI), cs, sn)]
    out["weighted_swiglu"] = [(r(2, 2 * c.moe_inter_dim), r(2, dt=torch.float32), c.swiglu_limit, dtype)]
    return out


def compressor_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``compressor_step`` (``kernels.reference.slots.
    _compress_masked``): one slot of each kind of compressor ``config`` has (CSA's attention compressor and its
    indexer's, with overlap; HCA's), the slots and GEMM outputs in the compute dtype, the entries in the model's
    ``dtype``, the blocks' angles in the compute dtype."""
    c = config
    ct = torch.promote_types(dtype, torch.float32)
    half = c.rope_head_dim // 2

    def zeros(*shape, dt=ct):
        return torch.zeros(*shape, dtype=dt, device=device)

    out = []                                   # no compressed layer: no call (the op is never run)
    for m in sorted(set(r for r in c.compress_ratios[: c.n_layers] if r)):
        kinds = [(c.head_dim, False)] + ([(c.index_head_dim, True)] if m == 4 else [])
        for width, rotate in kinds:
            kc = 2 * width if m == 4 else width
            prev = (zeros(1, m, width), zeros(1, m, width)) if m == 4 else (None, None)
            out.append((zeros(1, kc), zeros(1, kc), zeros(m, kc), zeros(1, m, kc), zeros(1, m, kc), *prev,
                        torch.zeros(1, dtype=torch.long, device=device), zeros(1, 2, width, dt=dtype), 0,
                        zeros(width, dt=torch.float32), c.norm_eps, zeros(2, 2, half), rotate))
    return out


def norm_rope_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``norm_rope`` (``kernels.reference.decode._attend``): the
    query's heads (weightless, returned) and the key (weighted, written into a ring slot), one slot, in the model's
    ``dtype`` with fp32 angles."""
    c = config
    r = c.rope_head_dim // 2

    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    angles = (zeros(1, 1, r, dt=torch.float32), zeros(1, 1, r, dt=torch.float32))
    return [(zeros(1, 1, c.n_heads, c.head_dim), None, c.norm_eps, *angles),
            (zeros(1, 1, c.head_dim), zeros(c.head_dim, dt=torch.float32), c.norm_eps, *angles,
             zeros(1, c.window_size + 1, c.head_dim), torch.zeros(1, dtype=torch.long, device=device), c.window_size)]


def decode_topk_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``decode_topk`` (``kernels.reference.decode._index_step``):
    one slot's fp32 scores over a few entries, its position, the CSA ratio and the indexer's top-k; none for a
    model without CSA layers (never called)."""
    if not _has_csa(config):
        return []
    return [(torch.zeros(1, 3, device=device), torch.zeros(1, dtype=torch.long, device=device), 4, config.index_topk)]


def attention_rows_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``attention_rows`` (``kernels.reference.decode._attend``): one
    slot's position and the ring's width (a window layer's rows), and with each HCA ratio a few entries after it."""
    pos, W = torch.zeros(1, dtype=torch.long, device=device), config.window_size
    hca = sorted({r for r in config.compress_ratios[:config.n_layers] if r not in (0, 4)})
    return [(pos, W)] + [(pos, W, r, 3) for r in hca]


def attention_inverse_rope_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuple the eager decode step passes ``attention_inverse_rope`` (``kernels.reference.decode.
    _attend``): one slot's query heads over a few rows of its cache (int64 ids, one empty) in the model's ``dtype``,
    the fp32 sink and the layer's scale, the angles in the compute dtype (``[1, 1, r/2]``)."""
    c = config
    ct = torch.promote_types(dtype, torch.float32)

    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    idx = torch.tensor([[[0, 1, 2, -1]]], dtype=torch.long, device=device)
    angle = zeros(1, 1, c.rope_head_dim // 2, dt=ct)
    return [(zeros(1, 1, c.n_heads, c.head_dim), zeros(1, 4, c.head_dim), idx, zeros(c.n_heads, dt=torch.float32),
             c.head_dim ** -0.5, angle, angle)]


def index_query_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``index_query`` (``kernels.reference.decode._index_step``):
    one slot's indexer query heads in the model's ``dtype``, fp32 angles, the activation dtype out (a GPU table's
    scores take it); none for a model without CSA layers (never called)."""
    if not _has_csa(config):
        return []
    r = config.rope_head_dim // 2
    angle = torch.zeros(1, 1, r, device=device)
    return [(torch.zeros(1, 1, config.index_n_heads, config.index_head_dim, dtype=dtype, device=device), angle, angle,
             dtype)]


def linear_group_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``linear_group`` (``kernels.reference.decode.
    layer_projections``, ``query_projections`` and ``eager_linear``): one slot's attention input in the model's
    ``dtype`` and each kind of layer's weights that read it in that dtype (``wq_a`` and ``wkv``; a compressed
    layer's compressors' ``wkv`` and ``wgate``, fp32 results; a CSA layer's indexer compressor and
    ``weights_proj``); the query's low rank with ``wq_b`` (and a CSA layer's indexer ``wq_b``); the attention's
    grouped output with ``wo_b``; the final norm's output with the head (fp32 logits). The weights are one row
    of zeros seen ``N`` times (the head's would be a GiB at Flash size)."""
    c = config
    d = c.dim

    def w(rows, width=d):
        return torch.zeros(1, width, dtype=dtype, device=device).expand(rows, width)

    def x(width=d):
        return torch.zeros(1, 1, width, dtype=dtype, device=device)

    out = []
    for m in sorted(set(c.compress_ratios[: c.n_layers])):
        ws, f32 = [w(c.q_lora_rank), w(c.head_dim)], [False, False]
        if m:
            widths = [c.head_dim] + ([c.index_head_dim] if m == 4 else [])
            for width in widths:
                ws += [w(2 * width if m == 4 else width)] * 2
                f32 += [True, True]
            if m == 4:
                ws.append(w(c.index_n_heads))
                f32.append(False)
        out.append((x(), ws, f32))
    for csa in sorted({m == 4 for m in c.compress_ratios[: c.n_layers]}):     # the query's, with the indexer's
        query = [w(c.n_heads * c.head_dim, c.q_lora_rank)]
        if csa:
            query.append(w(c.index_n_heads * c.index_head_dim, c.q_lora_rank))
        out.append((x(c.q_lora_rank), query, [False] * len(query)))
    out.append((x(c.o_groups * c.o_lora_rank), [w(d, c.o_groups * c.o_lora_rank)], [False]))
    out.append((x(), [w(c.vocab_size)], [True]))
    return out


def grouped_projection_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuple the eager decode step passes ``grouped_projection`` (``kernels.reference.decode._attend``):
    one slot's grouped attention output and ``wo_a`` as ``[G, R, H D / G]`` in the model's ``dtype`` (one row of
    zeros seen ``G R`` times)."""
    c = config
    d = c.n_heads * c.head_dim // c.o_groups
    w = torch.zeros(1, 1, d, dtype=dtype, device=device).expand(c.o_groups, c.o_lora_rank, d)
    return [(torch.zeros(1, 1, c.o_groups, d, dtype=dtype, device=device), w)]


def linear_post_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuple the eager decode step passes ``linear_post`` (``kernels.reference.slots.decode_layer``):
    one slot's grouped attention output ``[1, 1, G R]`` and ``wo_b`` ``[d, G R]`` in the model's ``dtype`` (zeros,
    one row broadcast: the kernel's checks do not depend on the values), its streams, the site's fp32 ``post`` and
    ``comb``."""
    c = config
    n, d, width = c.hc_mult, c.dim, c.o_groups * c.o_lora_rank

    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    return [(zeros(1, 1, width), zeros(1, width).expand(d, width), zeros(1, 1, n, d),
             zeros(1, 1, n, dt=torch.float32), zeros(1, 1, n, n, dt=torch.float32))]


def swiglu_scatter_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step's pair path passes ``experts_swiglu_scatter_mm``
    (``kernels.reference.slots._grouped``): one slot's top-k pairs on one expert, ``[gate | up]`` in the model's
    ``dtype`` with fp32 routing weights and the experts' clamp, ``w2`` of that expert; with the shared expert's
    ``w2`` and its row after the pairs', and without (a shared expert shaped or clamped otherwise runs apart).
    One expert of zeros: the kernel's checks do not depend on how many (V4-Flash's ``w2`` is 4 GiB)."""
    c = config
    k, inter = c.n_activated_experts, c.moe_inter_dim

    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    w2, offs = zeros(1, c.dim, inter), torch.full((1,), k, dtype=torch.int32, device=device)
    order = torch.arange(k, dtype=torch.long, device=device)
    return [(zeros(k + 1, 2 * inter), zeros(k + 1, dt=torch.float32), c.swiglu_limit, w2, offs, order,
             zeros(c.dim, inter)),
            (zeros(k, 2 * inter), zeros(k, dt=torch.float32), c.swiglu_limit, w2, offs, order)]


def combine_post_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuple the eager decode step's pair path passes ``moe_combine_post``
    (``kernels.reference.slots.decode_layer``): one slot's top-k pairs and shared expert output in the model's
    ``dtype``, its streams, and the site's fp32 ``post`` and ``comb``."""
    c = config
    k, n, d = c.n_activated_experts, c.hc_mult, c.dim

    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    return [(zeros(k, d), zeros(1, d), k, zeros(1, 1, n, d), zeros(1, 1, n, dt=torch.float32),
             zeros(1, 1, n, n, dt=torch.float32))]


def _mhc_norm_inputs(config, dtype: torch.dtype, device, head: bool) -> list:
    """One slot's streams in the model's ``dtype``, an fp32 mHC mapping (a block's, or with ``head`` the head's
    collapse), its mHC settings, and the norm's weight in fp32 or the model's dtype (as the engine may hold it)."""
    c = config
    n, d = c.hc_mult, c.dim
    rows, scales = (n, 1) if head else ((2 + n) * n, 3)

    def zeros(*shape, dt=torch.float32):
        return torch.zeros(*shape, dtype=dt, device=device)

    settings = (c.norm_eps, c.hc_eps) + (() if head else (c.hc_sinkhorn_iters,))
    return [(zeros(1, 1, n, d, dt=dtype), zeros(rows, n * d), zeros(scales), zeros(rows), *settings, zeros(d, dt=wd),
             c.norm_eps) for wd in dict.fromkeys((torch.float32, dtype))]


def hc_pre_norm_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step passes ``hc_pre_norm`` (``kernels.reference.slots.decode_layer``):
    a block site's (:func:`_mhc_norm_inputs`)."""
    return _mhc_norm_inputs(config, dtype, device, head=False)


def hc_head_norm_inputs(config, dtype: torch.dtype, device) -> list:
    """The argument tuples the eager decode step's head passes ``hc_head_norm`` (``kernels.reference.slots.
    decode_head``): the head's collapse and final norm (:func:`_mhc_norm_inputs`)."""
    return _mhc_norm_inputs(config, dtype, device, head=True)


# the pair path's fused ops (kernels.reference.slots): their probe's inputs and the pair kernel each replaces, the
# activation in the second expert GEMM (with weighted_swiglu), the pairs' sum in the MoE's mHC post (with its hc_post)
PAIR_FUSIONS = {SWIGLU_SCATTER: (swiglu_scatter_inputs, "experts_scatter_mm"),
                COMBINE_POST: (combine_post_inputs, "moe_combine")}

# the eager step's extra ops that take the place of torch code where the run's table has them and they take the
# step's inputs (decode_choices probes them with these builders; no calls: the model never runs the op): the
# compressors after their GEMMs, the attention's norms, rotations and ring write, the indexer's query and picks,
# a layer's projections of its attention input, a site's mHC pre with its sublayer's norm, the head's collapse with
# the final norm, a window or HCA layer's attention rows, the attention's grouped wo_a, a layer's attention with its
# output's inverse rotation, the attention's wo_b with its site's mHC post
EAGER_EXTRAS = {"compressor_step": compressor_inputs, "norm_rope": norm_rope_inputs, "decode_topk": decode_topk_inputs,
                "index_query": index_query_inputs, "linear_group": linear_group_inputs,
                "hc_pre_norm": hc_pre_norm_inputs, "hc_head_norm": hc_head_norm_inputs,
                "attention_rows": attention_rows_inputs, "grouped_projection": grouped_projection_inputs,
                "attention_inverse_rope": attention_inverse_rope_inputs, "linear_post": linear_post_inputs}


def _refusal(fn, calls) -> Optional[str]:
    raw = getattr(fn, "__wrapped__", fn)          # the op itself, not core.kernel_ops' counting wrapper
    for args in calls:
        try:
            with torch.no_grad():
                raw(*args)
        except ValueError as e:                   # a backend's refusal (its contract); anything else propagates
            return str(e)
    return None


def decode_choices(table: OpTable, reference: OpTable, config, dtype: torch.dtype, device, compiled: bool = False,
                   cached: bool = True) -> Tuple[OpTable, Dict[str, str], Dict[str, str]]:
    """``(decode_table, served, refusals)``: the op table of the decode step (``table``'s op where it takes a
    one-token decode step's inputs, ``reference``'s where it refuses them, and with ``compiled`` for
    :data:`INDUCTOR_FUSES`), ``{op: backend}`` for the ops the step calls, and ``{op: the refusal}`` for the
    ops handed to ``reference`` because they refused. ``cached``: the KV-cached step (its MoE's ops too), else
    the uncached engine's full forwards."""
    inputs = decode_inputs(config, dtype, device, table)
    chosen, served, refusals = {}, {}, {}
    grouped = cached and grouped_decode_ok(device, dtype, 2 * config.moe_inter_dim, config.dim)
    called = engine_ops(config) + (("weighted_swiglu",) if cached else ())
    for name in table.names():
        who, fn = table.provider[name], getattr(table, name)
        if name in called and who != reference.backend:
            keep_reference = compiled and name in INDUCTOR_FUSES
            reason = None if keep_reference else _refusal(fn, inputs[name])
            if reason is not None:
                refusals[name] = reason
            if keep_reference or reason is not None:
                who, fn = reference.backend, getattr(reference, name)
        chosen[name] = (who, fn)
        if name in called:
            served[name] = who
    pairs = all(name in table.names() for name in PAIR_KERNELS)     # used only as a set (slots._pair_kernels)
    if "experts_grouped_mm" in table.names() and grouped and (compiled or not pairs):
        served["experts_grouped_mm"] = table.provider["experts_grouped_mm"]   # the decode MoE's GEMMs
    for name in ("route_experts", "expert_order") + (PAIR_KERNELS if pairs else ()):
        if name in table.names() and grouped and not compiled:   # the eager decode MoE's one-launch kernels
            served[name] = table.provider[name]
    for name, (inputs_of, replaced) in PAIR_FUSIONS.items():   # the pair path's fused ops, where the step runs it
        if name not in table.names() or not (pairs and grouped and not compiled):
            continue
        reason = _refusal(getattr(table, name), inputs_of(config, dtype, device))
        if reason is None:                      # the step calls it in the replaced op's place (kernels.reference.slots)
            served[name] = table.provider[name]
            del served[replaced]
        else:                                   # the step runs the two ops it fuses
            refusals[name] = reason
            del chosen[name]
    for name, inputs_of in EAGER_EXTRAS.items():     # the eager step's one-launch ops, where they take its inputs
        calls = inputs_of(config, dtype, device) if name in table.names() and cached and not compiled else []
        reason = _refusal(getattr(table, name), calls) if calls else None
        if calls and reason is None:
            served[name] = table.provider[name]
        elif reason is not None:                # the step runs the torch code: the table must not offer the op
            refusals[name] = reason
            del chosen[name]
    if all(chosen.get(n, (None,))[0] == table.provider[n] for n in table.names()):
        return table, served, refusals
    # an indexer handed to the reference op takes that op's inputs (the decode step casts by the table's rule)
    indexer_inputs = (reference if "indexer_scores" in refusals else table).indexer_inputs
    return (OpTable(table.backend, {}, delegated=chosen, dtypes=table.dtypes, indexer_inputs=indexer_inputs),
            served, refusals)


def record_choice(table: OpTable, device, block: int,
                  vocab: int = 0) -> Tuple[Dict[str, str], Optional[Callable], Optional[str]]:
    """``(sample_ops, record, refusal)``: the table's ``draw_record`` (a decode step's draw with the engine's
    records of it, ``kernels.reference.sampling.draw_record``) where it has one and takes a probe's inputs (as
    :func:`sampler_choice`'s, with the records' int64 and fp32 tensors), recorded as ``{"draw_record": backend}``;
    else ``({}, None, the refusal or None)``: the engine draws and records with :func:`sampler_choice`'s draw and
    torch's indexed writes. The probe is a row of the model's ``vocab`` entries at temperature 1 and another:
    the calls the decode steps make, so that a backend compiling per shape (triton: the blocks' count) compiles
    them here, not in the middle of the first decode step (on a fresh H100 that call took 7.1 ms a step against
    1.52 after; ``bench/results/rollout-h100-flash-shaped-triton-b1-fresh-cache-probe-vocab.json``)."""
    if "draw_record" not in table.names():
        return {}, None, None
    fn = getattr(table, "draw_record")
    longs = dict(dtype=torch.long, device=device)
    probes = [(torch.zeros(1, vocab or 2 * block + 1, device=device),
               torch.full((2, 3), 0.5, dtype=torch.float64, device=device), torch.ones(1, **longs),
               torch.zeros(1, **longs), torch.zeros(2, 3, **longs), torch.zeros(2, 3, device=device),
               torch.zeros(2, **longs), torch.zeros(1, **longs), torch.ones(1, **longs), temperature, block)
              for temperature in (1.0, 0.5)]
    reason = _refusal(fn, probes)
    if reason is not None:
        return {}, None, reason
    return {"draw_record": table.provider["draw_record"]}, fn, None


def sampler_choice(table: OpTable, device, block: int,
                   vocab: int = 0) -> Tuple[Dict[str, str], Optional[Callable], Optional[str]]:
    """``(sample_ops, draw, refusal)``: the table's ``draw_tokens`` where it has one and takes a probe's inputs
    (fp32 logits of the model's ``vocab`` entries, else two blocks and one, float64 uniforms, on the engine's
    device), recorded as ``{"draw_tokens": backend}``; else ``({}, None, the refusal or None)``: the torch sampler."""
    if "draw_tokens" not in table.names():
        return {}, None, None
    fn = getattr(table, "draw_tokens")
    probe = (torch.zeros(1, vocab or 2 * block + 1, device=device),
             torch.full((1,), 0.5, dtype=torch.float64, device=device), 1.0, block)
    reason = _refusal(fn, [probe])
    if reason is not None:
        return {}, None, reason
    return {"draw_tokens": table.provider["draw_tokens"]}, fn, None
