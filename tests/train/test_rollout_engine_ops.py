"""The built-in rollout engine computes with the run's kernel backend, and its sizes come from the run's settings.

* the assembly hands the engine the run's op table: on the CPU (``--kernel-backend none``) a generate call runs
  ``none.<op>`` for every op the engine calls (``core.kernel_ops.kernels_ran``), and nothing else;
* a fake table (the reference functions under another backend name) is what the engine calls, in prefill, in
  the decode step and in the uncached engine, and it draws the reference engine's samples exactly;
* a table whose op refuses a one-token decode step's inputs serves prefill, and the decode step runs the
  reference op for that op, recorded in ``decode_ops`` / ``decode_refusals`` (not silently);
* the decode-only expert kernels (``experts_grouped_mm``, ``expert_order``, ``route_experts``) are on the record
  exactly where the step calls them;
* a table's ``compressor_step`` runs every compressor of the decode step, and its ``norm_rope`` every query's and
  key's norm and rotation, on the record, with the samples of the torch code; one that refuses the step's inputs
  is on the record and never called;
* a table's sampler kernel (``draw_tokens``) draws at top-p 1 the torch sampler's tokens, on the record
  (``sample_ops``), and one that refuses the probe leaves the torch sampler, logged;
* ``compile``: the decode step traced by ``torch.compile`` (``aot_eager``: dynamo and AOTAutograd's
  functionalisation without code generation, which Inductor would add) draws the eager step's samples
  bit for bit; the table's own kernel (an op defined outside ``kernels.reference`` and not marked traceable,
  like a third-party backend's launcher) runs eagerly inside the compiled step on every call, while the
  reference ops are traced (not called);
* ``rollout_max_slots`` / ``rollout_cuda_graphs`` / ``rollout_compile`` (TrainConfig) reach the engine; a GRPO
  run through the CLI with 2 slots takes exactly the steps of the default run (samples do not depend on the
  slots: losses, gradient norms, rewards and response lengths are equal; the engine's log-probabilities only
  to fp32 rounding), and its ``rollout_compile=true`` reaches the engine's decode slots.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from core.config import preset

CFG = preset("tiny")
PROMPTS = [[0, 5, 6, 7, 8], [0, 9, 10]]
# what only the KV-cached decode step calls (rollout.engine_ops): the shared expert's activation, on every MoE path
CACHED_DECODE_ONLY = ("weighted_swiglu",)


def _synced(engine):
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    assert sync_weights(build_train_model(CFG, seed=0), engine, version=1).ok
    return engine


def _params(**kw):
    from rollout.reference_engine import SamplingParams

    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 6, "stop_token_ids": (), **kw})


def _generate(engine, params=None):
    from core.kernel_ops import kernels_ran, reset_kernels_ran

    reset_kernels_ran()
    got = engine.generate(PROMPTS, params or _params(), n=2, seed=5)
    return got, kernels_ran()


def _fake(refuse_decode=(), own=(), extra=None):
    """The reference functions as backend ``fake``; the ops in ``refuse_decode`` refuse one-token inputs; the
    ops in ``own`` are wrapped here, outside ``kernels.reference``, like a backend's own kernel; ``extra``: more
    ops (``{name: fn}``) beyond the reference set."""
    from core.kernel_ops import OpTable
    from kernels.reference.backend import reference_functions

    fns = reference_functions()
    for name in own:
        def kernel(*args, _fn=fns[name], **kw):
            return _fn(*args, **kw)
        fns[name] = kernel
    for name in refuse_decode:
        def picky(*args, _fn=fns[name], _name=name, **kw):
            if args[0].dim() >= 3 and args[0].shape[1] == 1:
                raise ValueError(f"the fake {_name} kernel takes no single-token steps")
            return _fn(*args, **kw)
        fns[name] = picky
    return OpTable("fake", {**fns, **(extra or {})})


def _same(a, b):
    for ga, gb in zip(a, b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert x.response_ids == y.response_ids
            assert torch.equal(x.logprobs, y.logprobs) and torch.equal(x.routed_experts, y.routed_experts)


def test_the_assembly_gives_the_engine_the_runs_ops_and_generate_runs_them():
    from core.assembly import assemble
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from rollout.engine_ops import ENGINE_OPS, engine_ops

    run = normalize(Choices(rollout_engine="reference", hardware="cpu", kernel_backend="none", model=CFG),
                    make_host(third_party=False))
    e = _synced(assemble(run).rollout_engine(CFG))
    assert e.ops.backend == "none"
    assert engine_ops(CFG) == ENGINE_OPS                        # tiny has CSA layers: the indexer's ops run too
    assert e.prefill_ops == {op: "none" for op in ENGINE_OPS} and e.decode_refusals == {}
    assert e.decode_ops == {op: "none" for op in ENGINE_OPS + CACHED_DECODE_ONLY}
    _, ran = _generate(e)
    assert set(ran) == {f"none.{op}" for op in ENGINE_OPS + CACHED_DECODE_ONLY}, ran
    assert all(ran[f"none.{op}"] > 0 for op in ENGINE_OPS + CACHED_DECODE_ONLY)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_the_engine_calls_the_op_table_it_is_given(kv_cache):
    from rollout.engine_ops import ENGINE_OPS
    from rollout.reference_engine import ReferenceEngine

    fake = _synced(ReferenceEngine(CFG, ops=_fake(), kv_cache=kv_cache))
    decoded = ENGINE_OPS + (CACHED_DECODE_ONLY if kv_cache else ())
    assert fake.prefill_ops == {op: "fake" for op in ENGINE_OPS} and fake.decode_ops == {op: "fake" for op in decoded}
    got, ran = _generate(fake)
    assert set(ran) == {f"fake.{op}" for op in decoded}, ran         # no reference op ran behind its back
    want, ref_ran = _generate(_synced(ReferenceEngine(CFG, kv_cache=kv_cache)))
    assert {k.replace("none.", "fake.") for k in ref_ran} == set(ran)
    _same(got, want)


def test_an_op_that_refuses_decode_inputs_runs_the_reference_op_in_decode_explicitly(caplog):
    from rollout.reference_engine import ReferenceEngine

    with caplog.at_level("WARNING", logger="dsv4"):
        e = _synced(ReferenceEngine(CFG, ops=_fake(refuse_decode=("hc_pre",))))
    assert e.prefill_ops["hc_pre"] == "fake" and e.decode_ops["hc_pre"] == "none"
    assert e.decode_refusals == {"hc_pre": "the fake hc_pre kernel takes no single-token steps"}
    assert {op: who for op, who in e.decode_ops.items() if op != "hc_pre"} == {
        op: "fake" for op in e.decode_ops if op != "hc_pre"}
    assert "decode step runs the reference hc_pre" in caplog.text and "no single-token steps" in caplog.text
    got, ran = _generate(e)
    assert ran["fake.hc_pre"] > 0 and ran["none.hc_pre"] > 0           # prefill: the table; decode: the reference
    assert not [k for k in ran if k.startswith("none.") and k != "none.hc_pre"], ran
    _same(got, _generate(_synced(ReferenceEngine(CFG)))[0])


def _experts_grouped_mm(x, w, offs):
    """A loop of plain matmuls with ``experts_grouped_mm``'s contract (rows sorted by expert, ``offs`` end rows)."""
    out, start = x.new_zeros(x.shape[0], w.shape[1]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e].t()
        start = end
    return out


@pytest.mark.parametrize("grouped,pairs", [(True, True), (True, False), (False, True)])
def test_the_record_names_the_decode_only_expert_kernel_where_the_step_calls_it(monkeypatch, grouped, pairs):
    """A table with ``experts_grouped_mm``, ``expert_order``, ``route_experts`` and the pair kernels
    (``experts_gather_mm``, ``experts_scatter_mm``, ``moe_combine``: the triton backend's decode kernels for the
    routed experts' GEMMs, the order of their rows, the router, the GEMMs through that order and the pairs' sum;
    prefill never calls them):
    where the decode MoE takes the grouped path (``grouped_decode_ok``, bf16 on a
    Hopper GPU, made true here on the CPU), ``decode_ops`` names it and a generate call runs it; where it does
    not, neither. The pair kernels take the plain GEMM's place where the table has them (``pairs``). Either way
    the kernels that ran are exactly the recorded ones, and the samples are the reference engine's (the grouped
    and the dense expert sums agree to fp32 rounding)."""
    import kernels.reference.slots as slots
    import rollout.engine_ops as engine_ops
    from kernels.reference.moe import route_experts
    from rollout.reference_engine import ReferenceEngine

    for mod in (slots, engine_ops):
        monkeypatch.setattr(mod, "grouped_decode_ok", lambda *a: grouped)

    def gather(x, w, offs, order, topk, shared=None):
        y = _experts_grouped_mm(x.index_select(0, order // topk), w, offs)
        return y if shared is None else torch.cat((y, x @ shared.t()))

    def scatter(x, w, offs, order, shared=None):
        R = order.shape[0]
        y = _experts_grouped_mm(x[:R], w, offs)
        y = torch.empty_like(y).index_copy_(0, order, y)
        return y if shared is None else torch.cat((y, x[R:] @ shared.t()))

    extra = {"experts_grouped_mm": _experts_grouped_mm, "expert_order": slots.expert_order,
             "route_experts": route_experts}
    if pairs:
        extra.update(experts_gather_mm=gather, experts_scatter_mm=scatter, moe_combine=slots.combine_pairs)
    e = _synced(ReferenceEngine(CFG, ops=_fake(extra=extra)))
    for op in extra:                            # the GEMMs and the eager step's order of their rows
        called = grouped and not (pairs and op == "experts_grouped_mm")   # the pair GEMMs take the plain one's place
        assert (op in e.decode_ops) is called and op not in e.prefill_ops
    got, ran = _generate(e)
    assert set(ran) == {f"fake.{op}" for op in {**e.prefill_ops, **e.decode_ops}}, ran
    want, _ = _generate(_synced(ReferenceEngine(CFG)))
    for ga, gb in zip(got, want, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert a.response_ids == b.response_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)


# the pair path's fused ops: (the op, the name of its torch contract in kernels.reference.slots, the op it replaces,
# the op a launch fewer besides: the activation before the second expert GEMM, the MoE's mHC post after the sum)
PAIR_FUSIONS = {"experts_swiglu_scatter_mm": ("swiglu_scatter_grouped_mm", "experts_scatter_mm", "weighted_swiglu"),
                "moe_combine_post": ("combine_post", "moe_combine", "hc_post")}


@pytest.mark.parametrize("variant", ["contract", "altered", "refuses"])
@pytest.mark.parametrize("op", sorted(PAIR_FUSIONS))
def test_the_pair_path_runs_the_tables_fused_pair_ops(monkeypatch, op, variant):
    """A table with the pair kernels and ``experts_swiglu_scatter_mm`` (the triton backend's activation in the second
    expert GEMM's operand load) or ``moe_combine_post`` (its sum of a token's pairs and shared expert inside the
    MoE's mHC post), all their torch contracts (``kernels.reference.slots``), on the grouped path (made true here on
    the CPU): the engine records the op in the place of the one it replaces (``experts_scatter_mm``,
    ``moe_combine``; prefill never calls it), the decode step calls it once a layer where it ran that op and the one
    beside it (the activation; the MoE's ``hc_post``: the attention's remain), and draws the samples of the same
    table without it bit for bit (``contract``); a table whose op doubles its output draws other
    log-probabilities (``altered``: the step computes with what it returns); one that refuses the probe's inputs is
    on the record (``decode_refusals``) and never called: the step runs the two ops (``refuses``)."""
    import kernels.reference.slots as slots
    import rollout.engine_ops as engine_ops
    from kernels.reference.moe import route_experts
    from rollout.reference_engine import ReferenceEngine

    for mod in (slots, engine_ops):
        monkeypatch.setattr(mod, "grouped_decode_ok", lambda *a: True)
    pairs = {"experts_grouped_mm": slots._grouped_mm, "expert_order": slots.expert_order,
             "route_experts": route_experts, "experts_gather_mm": slots.gather_grouped_mm,
             "experts_scatter_mm": slots.scatter_grouped_mm, "moe_combine": slots.combine_pairs}
    contract_name, replaced, beside = PAIR_FUSIONS[op]
    contract = getattr(slots, contract_name)

    def refusing(*args):
        raise ValueError(f"the fake {op} takes no decode step")

    fused = {"contract": contract, "refuses": refusing, "altered": lambda *args: 2 * contract(*args)}[variant]
    e = _synced(ReferenceEngine(CFG, ops=_fake(extra={**pairs, op: fused})))
    served = variant != "refuses"
    assert (op in e.decode_ops) is served and (replaced in e.decode_ops) is not served
    assert e.decode_refusals == ({} if served else {op: f"the fake {op} takes no decode step"})
    got, ran = _generate(e)
    assert set(ran) == {f"fake.{name}" for name in {**e.prefill_ops, **e.decode_ops}}, ran
    called = op if served else replaced                                      # once a layer a step
    assert ran[f"fake.{called}"] == ran["fake.experts_gather_mm"] and ran[f"fake.{called}"] % CFG.n_layers == 0
    want, want_ran = _generate(_synced(ReferenceEngine(CFG, ops=_fake(extra=pairs))))
    assert ran.get(f"fake.{beside}", 0) == want_ran[f"fake.{beside}"] - (ran[f"fake.{called}"] if served else 0)
    if variant == "altered":
        assert any(not torch.equal(x.logprobs, y.logprobs) for ga, gb in zip(got, want) for x, y in zip(ga, gb))
    else:
        _same(got, want)


@pytest.mark.parametrize("refuse", [False, True])
@pytest.mark.parametrize("op", ["compressor_step", "norm_rope", "decode_topk", "index_query", "linear_group",
                                "hc_pre_norm", "hc_head_norm", "attention_rows", "grouped_projection",
                                "linear_post"])
def test_the_decode_step_runs_the_tables_eager_extras(op, refuse):
    """A table with ``compressor_step`` (the triton backend's compressors after their GEMMs in one launch),
    ``norm_rope`` (the attention's query and key norms and rotations, the key's write into its ring, one launch
    each), ``decode_topk`` (a CSA layer's indexer picks), ``index_query`` (its indexer query's rotation and
    transform), ``linear_group`` (a layer's projections of its attention input), ``hc_pre_norm`` (a site's mHC pre
    and its sublayer's norm), ``hc_head_norm`` (the head's collapse and the final norm), ``attention_rows`` (a
    window or HCA layer's attention rows), ``grouped_projection`` (the attention's grouped ``wo_a``) or
    ``linear_post`` (its ``wo_b`` with the site's mHC post), here their torch contracts
    (``kernels.reference.compressor_step``, ``kernels.reference.norm_rope``, ``kernels.reference.topk``,
    ``kernels.reference.index_query``, ``kernels.reference.linear_group``, ``kernels.reference.mhc``,
    ``kernels.reference.layers``, ``kernels.reference.slots``):
    the engine records the op (``decode_ops``; prefill never calls it), the decode step calls it every time it
    would run that torch code, and the samples are the reference engine's, bit for bit (the same torch ops on the
    same angles). One that refuses the step's inputs is on the record (``decode_refusals``) and never called: the
    step runs its torch code."""
    from kernels.reference.compressor_step import compressor_step
    from kernels.reference.index_query import index_query
    from kernels.reference.layers import grouped_projection
    from kernels.reference.linear_group import linear_group
    from kernels.reference.mhc import hc_head_norm, hc_pre_norm
    from kernels.reference.norm_rope import norm_rope
    from kernels.reference.slots import linear_post
    from kernels.reference.topk import attention_rows, decode_topk
    from rollout.reference_engine import ReferenceEngine

    def picky(*args):
        raise ValueError(f"the fake {op} takes CUDA tensors only")

    contracts = {"compressor_step": compressor_step, "norm_rope": norm_rope, "decode_topk": decode_topk,
                 "index_query": index_query, "linear_group": linear_group, "hc_pre_norm": hc_pre_norm,
                 "hc_head_norm": hc_head_norm, "attention_rows": attention_rows,
                 "grouped_projection": grouped_projection, "linear_post": linear_post}
    fn = picky if refuse else contracts[op]
    e = _synced(ReferenceEngine(CFG, ops=_fake(extra={op: fn})))
    assert (op in e.decode_ops) is not refuse and op not in e.prefill_ops
    assert (op in e.decode_refusals) is refuse
    got, ran = _generate(e, _params(max_new_tokens=12))          # past a block of 4: entries pooled and used
    assert (f"fake.{op}" in ran) is not refuse, ran
    # per decode step (11 a sample, one slot each): every compressor, or the query and the key of every layer
    per_step = {"compressor_step": sum(1 + (r == 4) for r in CFG.compress_ratios[:CFG.n_layers] if r),
                "norm_rope": 2 * CFG.n_layers, "decode_topk": CFG.compress_ratios[:CFG.n_layers].count(4),
                "index_query": CFG.compress_ratios[:CFG.n_layers].count(4),
                "linear_group": 3 * CFG.n_layers + 1,      # the attention's input, its query, wo_b; the head
                "hc_pre_norm": 2 * CFG.n_layers, "hc_head_norm": 1,
                # once a step for the window's rows, once for the HCA layers' (the step's memo shares them)
                "attention_rows": 1 + any(r not in (0, 4) for r in CFG.compress_ratios[:CFG.n_layers]),
                "grouped_projection": CFG.n_layers, "linear_post": CFG.n_layers}[op]
    if not refuse:
        assert ran[f"fake.{op}"] % per_step == 0 and ran[f"fake.{op}"] >= 11 * per_step
    want, _ = _generate(_synced(ReferenceEngine(CFG)), _params(max_new_tokens=12))
    _same(got, want)
    if op == "decode_topk" and not refuse:      # recording the picks (indexer replay) takes the op's plain form
        e = _synced(ReferenceEngine(CFG, ops=_fake(extra={op: fn}), record_indexer=True))
        ref = _synced(ReferenceEngine(CFG, record_indexer=True))
        got, ran = _generate(e, _params(max_new_tokens=12))
        want, _ = _generate(ref, _params(max_new_tokens=12))
        assert ran[f"fake.{op}"] > 0
        _same(got, want)
        for ga, gb in zip(got, want, strict=True):
            for a, b in zip(ga, gb, strict=True):
                assert a.indexer_picks is not None and torch.equal(a.indexer_picks, b.indexer_picks)


def test_the_step_computes_with_what_linear_post_returns():
    """``linear_post``'s result is the layer's streams after the attention: a table whose op doubles it draws other
    log-probabilities than the same table with the op's torch contract (``kernels.reference.slots.linear_post``),
    which draws the reference engine's."""
    from kernels.reference.slots import linear_post
    from rollout.reference_engine import ReferenceEngine

    got = {}
    for name, fn in (("contract", linear_post), ("altered", lambda *args: 2 * linear_post(*args))):
        e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"linear_post": fn})))
        got[name], ran = _generate(e)
        assert ran["fake.linear_post"] > 0 and "linear_post" in e.decode_ops
    want, _ = _generate(_synced(ReferenceEngine(CFG)))
    _same(got["contract"], want)
    assert any(not torch.equal(x.logprobs, y.logprobs) for ga, gb in zip(got["altered"], want) for x, y in zip(ga, gb))


def test_every_projection_of_the_group_is_the_one_the_step_uses():
    """``linear_group``'s outputs are what the decode step computes with, each of them: a table whose op reverses
    the channels of its ``j``-th output draws other log-probabilities than the reference engine (``wq_a``,
    ``wkv``, the attention compressor's ``wkv`` and ``wgate``), or hands the indexer other inputs (its
    compressor's ``wkv`` and ``wgate``: its entries; ``weights_proj``: its head weights; at this length the
    indexer keeps every entry, so the samples cannot tell)."""
    from kernels.reference.indexer import indexer_scores
    from kernels.reference.linear_group import linear_group
    from rollout.reference_engine import ReferenceEngine

    params = _params(max_new_tokens=12)                           # past a block of 4: entries pooled and used
    assert 4 in CFG.compress_ratios[:CFG.n_layers]

    def run(j):
        seen = []

        def spy(q, k, w):                                         # the decode step's indexer inputs
            if q.shape[1] == 1:
                seen.append((k.clone(), w.clone()))
            return indexer_scores(q, k, w)

        def flipped(x, weights, fp32):
            return [y.flip(-1) if i == j else y for i, y in enumerate(linear_group(x, weights, fp32))]

        e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"linear_group": flipped, "indexer_scores": spy})))
        got, ran = _generate(e, params)
        assert ran["fake.linear_group"] > 0 and seen
        return got, seen

    want, plain = run(None)
    _same(want, _generate(_synced(ReferenceEngine(CFG)), params)[0])
    for j in range(7):
        got, seen = run(j)
        if j < 4:
            assert any(not torch.equal(x.logprobs, y.logprobs) for ga, gb in zip(got, want) for x, y in zip(ga, gb)), j
        else:
            part = 1 if j == 6 else 0                             # the head weights, else the entries
            assert any(not torch.equal(a[part], b[part]) for a, b in zip(seen, plain)), j


def test_the_step_computes_with_the_grouped_projection():
    """The attention's grouped ``wo_a`` is the table's ``grouped_projection`` in the eager step and the step computes
    with what it returns: a table whose op negates its output draws other log-probabilities than the reference
    engine (the same op unchanged draws the same, bit for bit)."""
    from kernels.reference.layers import grouped_projection
    from rollout.reference_engine import ReferenceEngine

    params = _params(max_new_tokens=6)

    def run(sign):
        e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"grouped_projection": lambda o, w: sign * grouped_projection(
            o, w)})))
        got, ran = _generate(e, params)
        assert ran["fake.grouped_projection"] >= 5 * CFG.n_layers
        return got

    want = _generate(_synced(ReferenceEngine(CFG)), params)[0]
    _same(run(1), want)
    assert any(not torch.equal(x.logprobs, y.logprobs) for ga, gb in zip(run(-1), want) for x, y in zip(ga, gb))


@pytest.mark.parametrize("name", ["wq_b", "indexer.wq_b", "wo_b", "head"])
def test_the_query_output_and_head_projections_are_the_groups(name):
    """``linear_group`` also projects the query's low rank (``wq_b``, with a CSA layer's indexer ``wq_b`` in the same
    launch), the attention's grouped output (``wo_b``) and the final norm's output (the head, fp32 logits), and the
    step computes with what it returns: a table whose op negates the output of that one weight draws other
    log-probabilities than the reference engine (the indexer's: hands its scores another query; at this length
    the indexer keeps every entry, so the samples cannot tell)."""
    from kernels.reference.indexer import indexer_scores
    from kernels.reference.linear_group import linear_group
    from rollout.reference_engine import ReferenceEngine

    params = _params(max_new_tokens=12)
    csa = CFG.compress_ratios[:CFG.n_layers].index(4)

    def run(target_of):
        seen, built = [], []                                      # the engine, once built (the probe calls first)

        def spy(q, k, w):
            if q.shape[1] == 1:
                seen.append(q.clone())
            return indexer_scores(q, k, w)

        def negated(x, weights, fp32):
            target = target_of(built[0].model) if built else torch.empty(0)
            return [-y if w.data_ptr() == target.data_ptr() and w.shape == target.shape else y
                    for w, y in zip(weights, linear_group(x, weights, fp32))]

        built.append(_synced(ReferenceEngine(CFG, ops=_fake(extra={"linear_group": negated, "indexer_scores": spy}))))
        got, ran = _generate(built[0], params)
        assert ran["fake.linear_group"] > 0 and seen
        return got, seen

    weight = {"wq_b": lambda m: m.layers[csa].attn.wq_b.weight,
              "indexer.wq_b": lambda m: m.layers[csa].attn.indexer.wq_b.weight,
              "wo_b": lambda m: m.layers[csa].attn.wo_b.weight, "head": lambda m: m.head.weight}[name]
    want, plain = run(lambda m: torch.empty(0))
    _same(want, _generate(_synced(ReferenceEngine(CFG)), params)[0])
    got, seen = run(weight)
    if name == "indexer.wq_b":
        assert any(not torch.equal(a, b) for a, b in zip(seen, plain))
    else:
        assert any(not torch.equal(x.logprobs, y.logprobs) for ga, gb in zip(got, want) for x, y in zip(ga, gb))


@pytest.mark.parametrize("refuse", [False, True])
def test_the_step_attends_and_rotates_back_with_the_tables_one_op(refuse):
    """``attention_inverse_rope`` (the triton backend's attention with the inverse rotation in its epilogue), here its
    torch contract (``kernels.reference.attention``): on the record (``decode_ops``; prefill never calls it), every
    layer's attention of every decode step, where ``sparse_attention_with_sink`` and ``apply_rope`` ran (each is
    called that many times fewer), with the reference engine's samples bit for bit; with its output negated the
    samples' log-probabilities differ (the step computes with what it returns). One that refuses the step's inputs
    is on the record (``decode_refusals``) and never called: the step runs the two ops."""
    from kernels.reference.attention import attention_inverse_rope
    from rollout.reference_engine import ReferenceEngine

    op = "attention_inverse_rope"

    def picky(*args):
        raise ValueError(f"the fake {op} takes CUDA tensors only")

    params = _params(max_new_tokens=12)

    def run(fn):
        e = _synced(ReferenceEngine(CFG, ops=_fake(extra={op: fn})))
        assert (op in e.decode_ops) is not refuse and op not in e.prefill_ops and (op in e.decode_refusals) is refuse
        return _generate(e, params)

    got, ran = run(picky if refuse else attention_inverse_rope)
    want, plain = _generate(_synced(ReferenceEngine(CFG, ops=_fake())), params)
    _same(got, want)
    calls = ran.get(f"fake.{op}", 0)
    assert (calls == 0) is refuse and calls % CFG.n_layers == 0 and (refuse or calls >= 11 * CFG.n_layers)
    for replaced in ("sparse_attention_with_sink", "apply_rope"):
        assert plain[f"fake.{replaced}"] - ran[f"fake.{replaced}"] == calls, replaced
    if not refuse:
        negated, _ = run(lambda *args: -attention_inverse_rope(*args))
        assert any(not torch.equal(x.logprobs, y.logprobs) for ga, gb in zip(negated, want) for x, y in zip(ga, gb))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_sampler_takes_the_tables_draw_kernel_at_top_p_1(top_p):
    """A table with ``draw_tokens`` (the triton backend's sampler; here its rule in torch under the name ``fake``):
    the engine records it (``sample_ops``) and samples through it at top-p 1, the same tokens as its torch sampler;
    at top-p below 1 the torch sampler (the kernel has no truncation)."""
    from kernels.reference.sampling import draw_tokens
    from rollout.reference_engine import ReferenceEngine

    e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"draw_tokens": draw_tokens})))
    assert e.sample_ops == {"draw_tokens": "fake"} and "draw_tokens" not in e.decode_ops
    got, ran = _generate(e, _params(top_p=top_p))
    assert (ran.get("fake.draw_tokens", 0) > 0) is (top_p == 1.0), ran
    want, _ = _generate(_synced(ReferenceEngine(CFG)), _params(top_p=top_p))
    for ga, gb in zip(got, want, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert a.response_ids == b.response_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_a_draw_kernel_that_refuses_leaves_the_torch_sampler_on_the_record(caplog):
    from rollout.reference_engine import ReferenceEngine

    def picky(logits, u, temperature, block):
        raise ValueError("the fake draw_tokens kernel takes CUDA tensors only")

    with caplog.at_level("WARNING", logger="dsv4"):
        e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"draw_tokens": picky})))
    assert e.sample_ops == {} and "sampler runs torch's ops" in caplog.text and "CUDA tensors only" in caplog.text
    _, ran = _generate(e)
    assert "fake.draw_tokens" not in ran


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_decode_steps_record_their_draws_through_the_tables_draw_record(top_p):
    """A table with ``draw_tokens`` and ``draw_record`` (the triton backend's; here their rules in torch under the
    name ``fake``): the engine records both, and at top-p 1 each decode step draws and writes its records (the
    sample's token and log-probability, the slot's next input) through ``draw_record``, the samples of the table
    without it; at top-p below 1 neither runs. A ``draw_record`` that refuses the probe is logged and left out."""
    from kernels.reference.sampling import draw_record, draw_tokens
    from rollout.reference_engine import ReferenceEngine

    e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"draw_tokens": draw_tokens, "draw_record": draw_record})))
    assert e.sample_ops == {"draw_tokens": "fake", "draw_record": "fake"}
    plain = _synced(ReferenceEngine(CFG, ops=_fake(extra={"draw_tokens": draw_tokens})))
    stopping = _params(top_p=top_p, max_new_tokens=12, stop_token_ids=tuple(range(0, CFG.vocab_size, 7)))
    for params in (_params(top_p=top_p), stopping):
        got, ran = _generate(e, params)
        assert (ran.get("fake.draw_record", 0) > 0) is (top_p == 1.0), ran
        want, _ = _generate(plain, params)
        for ga, gb in zip(got, want, strict=True):
            for a, b in zip(ga, gb, strict=True):
                assert a.response_ids == b.response_ids and torch.equal(a.logprobs, b.logprobs)
                assert a.finish_reason == b.finish_reason
    # the second call's stop flags came from the record: some samples stopped early on them
    assert any(x.finish_reason == "stop" and len(x.response_ids) < 12 for g in got for x in g)
    if top_p == 1.0:
        wrong = _synced(ReferenceEngine(CFG, ops=_fake(extra={       # records the token one step late: caught
            "draw_tokens": draw_tokens, "draw_record": lambda lg, u, ids, t, *rest: draw_record(lg, u, ids, t - 1,
                                                                                                *rest)})))
        bad, _ = _generate(wrong)
        assert any(a.response_ids != b.response_ids for ga, gb in zip(bad, want) for a, b in zip(ga, gb))

    def picky(*args):
        raise ValueError("the fake draw_record kernel takes CUDA tensors only")

    e = _synced(ReferenceEngine(CFG, ops=_fake(extra={"draw_tokens": draw_tokens, "draw_record": picky})))
    assert e.sample_ops == {"draw_tokens": "fake"}
    assert "fake.draw_record" not in _generate(e)[1]


def test_the_compiled_decode_step_draws_the_eager_steps_samples():
    """One slot: one bucket, so one compile (a few seconds); about one token in five stops, so the slot
    takes sample after sample."""
    import torch._dynamo.utils

    from rollout.reference_engine import ReferenceEngine

    op = "sparse_attention_with_sink"
    params = _params(stop_token_ids=tuple(range(2, 1024, 5)))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _synced(ReferenceEngine(CFG, ops=_fake(own=(op,)), max_slots=1, compile="aot_eager"))
    assert compiled.compile == "aot_eager" and not compiled._fullgraph     # the kernel is a graph break
    got, ran = _generate(compiled, params)
    assert compiled._decoder.buckets == [1] and compiled._decoder.compile == "aot_eager"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # dynamo compiled the step
    want, eager_ran = _generate(_synced(ReferenceEngine(CFG, ops=_fake(own=(op,)), max_slots=1)), params)
    _same(got, want)
    assert len({len(s.response_ids) for g in got for s in g}) > 1
    # the kernel ran eagerly in every compiled step (and in the compile's own call on the empty slot, one
    # per layer), the traced reference ops only in prefill
    assert ran[f"fake.{op}"] == eager_ran[f"fake.{op}"] + CFG.n_layers
    assert 0 < ran["fake.hc_pre"] < eager_ran["fake.hc_pre"]


def test_a_compiled_step_keeps_the_reference_norms_and_rope_for_inductor_to_fuse():
    """The eager step calls the table's norms, RoPE, Hadamard rotation and experts' activation (one kernel each on
    a GPU), the compiled step the reference code (which Inductor fuses with its neighbours), prefill the table's
    either way; the record says so."""
    from rollout.engine_ops import INDUCTOR_FUSES
    from rollout.reference_engine import ReferenceEngine

    fused = ("rms_norm", "rms_normalize", "apply_rope", "hadamard_transform", "weighted_swiglu")
    prefilled = fused[:4]                                                 # prefill's MoE is the module's
    assert set(fused) == set(INDUCTOR_FUSES)
    eager = _synced(ReferenceEngine(CFG, ops=_fake(), max_slots=1))
    compiled = _synced(ReferenceEngine(CFG, ops=_fake(), max_slots=1, compile="aot_eager"))
    assert {eager.decode_ops[o] for o in fused} == {"fake"} and eager.decode_refusals == {}
    assert {compiled.decode_ops[o] for o in fused} == {"none"} and compiled.decode_refusals == {}
    assert {compiled.prefill_ops[o] for o in prefilled} == {"fake"}
    assert {o: w for o, w in compiled.decode_ops.items() if o not in fused} == {
        o: "fake" for o in compiled.decode_ops if o not in fused}
    _, ran = _generate(compiled)
    assert all(ran[f"none.{o}"] > 0 for o in fused) and all(ran[f"fake.{o}"] > 0 for o in prefilled), ran
    _, ran = _generate(eager)
    assert not [k for k in ran if k.startswith("none.")], ran


def test_the_compiled_step_compiles_each_layer_kind_once_for_every_slot_count():
    """Regional compile: six layers of four kinds (window, CSA and HCA attention; hash and learned routing)
    give four layer graphs, plus the embedding's and the head's, and the slot count is symbolic from the
    first compile (four slots, then two, compile nothing new). Every step equals the eager one bit for bit
    (``aot_eager``)."""
    import torch._dynamo
    import torch._dynamo.utils

    from kernels.reference.decode import prefill
    from kernels.reference.model import DeepseekV4Model, init_weights
    from kernels.reference.slots import SlotCache, stack_expert_weights, static_decode_step
    from rollout.slot_decoder import compiled_decode_step

    cfg = CFG.replace(n_layers=6, compress_ratios=(0, 4, 128, 4, 4, 128, 0))      # two hash layers (tiny's)
    kinds = {(r, cfg.is_hash_layer(i)) for i, r in enumerate(cfg.compress_ratios[:cfg.n_layers])}
    assert len(kinds) == 4
    m = DeepseekV4Model(cfg).eval()
    init_weights(m, 0, std=0.05)
    m.requires_grad_(False)
    stack_expert_weights(m)
    with torch.no_grad():
        dyn, _ = prefill(m, [[5, 6, 7], list(range(2, 40)), list(range(3, 20))], max_len=48)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    start = graphs["unique_graphs"]
    step = compiled_decode_step("aot_eager")
    g = torch.Generator().manual_seed(3)
    for b, want_graphs in ((4, len(kinds) + 2), (2, len(kinds) + 2)):
        eager, compiled = SlotCache.like(dyn, b), SlotCache.like(dyn, b)
        for c in (eager, compiled):
            c.load(range(min(3, b)), dyn, range(min(3, b)))
        for _ in range(2):
            tokens = torch.randint(2, 1000, (b,), generator=g)
            active = torch.ones(b, dtype=torch.bool)
            with torch.no_grad():
                want = static_decode_step(m, eager, tokens, active, indexer_picks=True)
                got = step(m, compiled, tokens, active, indexer_picks=True)
            assert all(torch.equal(x, y) for x, y in zip(got, want))
        assert graphs["unique_graphs"] - start == want_graphs, (b, graphs["unique_graphs"] - start)


def test_the_rollout_settings_reach_the_engine():
    from rollout.reference_engine import ReferenceEngine, make_reference_engine
    from train.trainer import TrainConfig

    e = make_reference_engine(CFG, settings=TrainConfig(rollout_max_slots=2, rollout_cuda_graphs=False,
                                                        rollout_compile=True))
    assert e.max_slots == 2 and e.cuda_graphs is False and e.compile == "inductor"
    e = make_reference_engine(CFG, settings=TrainConfig())
    assert e.max_slots is None and e.cuda_graphs is False                # None: on for a CUDA device only
    assert e.compile is None                                             # off unless asked for
    with pytest.raises(ValueError, match="kv_cache=False"):
        ReferenceEngine(CFG, kv_cache=False, compile=True)
    e = make_reference_engine(CFG, settings=TrainConfig(rollout_max_slots=2), max_slots=3)
    assert e.max_slots == 3                                              # an option given to the factory wins


def dsv4(*args):
    from launchers.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# what a step trains on: the samples' tokens, rewards, and the trainer's own log-probabilities
STEP_KEYS = ("loss", "pg_loss", "grad_norm", "reward_mean", "response_tokens")


def test_a_grpo_run_with_two_rollout_slots_takes_the_steps_of_the_default_run(tmp_path, monkeypatch):
    from kernels.reference.slots import static_decode_step
    from rollout import reference_engine as engines, slot_decoder

    made, real, compiles = [], engines.make_reference_engine, []

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    def not_compiled(backend, fullgraph):         # rollout_compile's path, without paying for Inductor
        compiles.append((backend, fullgraph))
        return static_decode_step

    monkeypatch.setattr(engines, "make_reference_engine", recording)
    monkeypatch.setattr(slot_decoder, "compiled_decode_step", not_compiled)
    common = ("train", "--hardware", "cpu", "--steps", 2, "prompts_per_step=2", "group_size=3", "max_new_tokens=6")
    res = dsv4(*common, "--run-dir", tmp_path / "default")
    assert res.exit_code == 0, res.output
    res = dsv4(*common, "--run-dir", tmp_path / "slots", "rollout_max_slots=2", "rollout_cuda_graphs=false",
               "rollout_compile=true")
    assert res.exit_code == 0, res.output
    assert [(e.max_slots, e.cuda_graphs, e.compile) for e in made] == [(None, False, None), (2, False, "inductor")]
    assert made[1]._decoder.slots == 2                                  # 6 samples a step went through 2 slots
    assert made[1]._decoder.compile == "inductor" and compiles == [("inductor", True)]
    default, slots = _rows(tmp_path / "default"), _rows(tmp_path / "slots")
    assert len(default) == len(slots) == 2
    for a, b in zip(default, slots):
        assert {k: a[k] for k in STEP_KEYS} == {k: b[k] for k in STEP_KEYS}
        # the engine's own log-probabilities come from decode steps over 2 rows instead of 6: the same tokens,
        # rounded differently (CPU GEMMs of another shape), so their distance to the trainer's moves at 1e-7
        assert abs(a["train_rollout_logprob_abs_diff"] - b["train_rollout_logprob_abs_diff"]) < 1e-6
    saved = json.loads((tmp_path / "slots" / "train_config.json").read_text())["train"]
    assert saved["rollout_max_slots"] == 2 and saved["rollout_cuda_graphs"] is False
    assert saved["rollout_compile"] is True


def test_bad_rollout_settings_are_refused(tmp_path):
    from core.config import ConfigError
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="rollout_max_slots"):
        TrainConfig(rollout_max_slots=0)
    with pytest.raises(ConfigError, match="rollout_compile"):
        TrainConfig(rollout_compile="yes")
    res = dsv4("train", "--hardware", "cpu", "--steps", 1, "--run-dir", tmp_path / "r", "rollout_cuda_graphs=true")
    assert res.exit_code != 0 and "rollout_cuda_graphs" in res.output and "no CUDA device" in res.output, res.output


def test_a_grouped_prefill_is_the_reference_loops(monkeypatch):
    """Where the decode MoE takes the grouped path (``grouped_decode_ok``, made true here on the CPU) the engine's
    prefill runs its routed experts as torch's grouped GEMM without host syncs
    (``kernels.reference.slots.prefill_experts``): the same last logits and caches as the reference's loop over
    the experts (fp32 rounding), the same experts recorded for routing replay; under a replaying hook it keeps
    the loop (the seam sees the grouped path's picks only after its experts ran)."""
    import kernels.reference.slots as slots
    from kernels.reference.decode import prefill
    from kernels.reference.moe import inference_experts
    from rollout.reference_engine import ReferenceEngine
    from rollout.replay import RoutingRecorder, RoutingReplayer, routing_context

    e = _synced(ReferenceEngine(CFG))
    prompts = [[0, 5, 6, 7, 8, 9], [0, 11, 12]]

    def run(grouped, hook=None):
        monkeypatch.setattr(slots, "grouped_decode_ok", lambda *a: grouped)
        calls = []
        monkeypatch.setattr(slots, "_moe_decode", lambda *a, _f=slots._moe_decode: calls.append(1) or _f(*a))
        with torch.no_grad(), routing_context(hook), inference_experts(slots.prefill_experts):
            cache, logits = prefill(e.model, prompts, max_len=10)   # as the engine's _prefill runs it
        return cache, logits, len(calls)

    rec_loop, rec_grouped = RoutingRecorder(2, 6), RoutingRecorder(2, 6)
    cache0, want, n0 = run(False, rec_loop)
    cache1, got, n1 = run(True, rec_grouped)
    assert n0 == 0 and n1 == CFG.n_layers                           # every trunk MoE took the grouped path
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(cache1.layers, cache0.layers):
        torch.testing.assert_close(a.window, b.window, rtol=1e-5, atol=1e-5)
    assert rec_grouped.layers.keys() == rec_loop.layers.keys() and rec_loop.layers
    for layer, idx in rec_loop.layers.items():
        assert torch.equal(rec_grouped.layers[layer], idx), layer
    replay = RoutingReplayer(rec_loop.as_tensor(CFG))
    _, again, n2 = run(True, replay)
    assert n2 == 0                                                  # a replay keeps the loop
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_a_step_that_fails_with_dependent_launches_names_the_switch(monkeypatch):
    """A decode step that asked for programmatic dependent launches (``kernels/triton/pdl.py``) and then failed
    raises an error naming ``DSV4_PDL=0``, the cause chained; a failure of a step that asked for none is raised as
    it is."""
    from kernels import gpu_common
    from kernels.reference.decode import prefill
    from kernels.reference.model import DeepseekV4Model, init_weights
    from kernels.reference.slots import stack_expert_weights
    from rollout.slot_decoder import SlotDecoder

    m = DeepseekV4Model(CFG).eval()
    init_weights(m, 0, std=0.05)
    m.requires_grad_(False)
    stack_expert_weights(m)
    with torch.no_grad():
        template, _ = prefill(m, [[5, 6, 7]], max_len=16)
    dec = SlotDecoder(m, template, 2, cuda_graphs=False)

    def failing(ask):
        def step(*args, **kwargs):
            assert gpu_common.dependent_launches_on()          # the step runs inside dependent_launches
            if ask:
                gpu_common.count_dependent_launch()            # what pdl.launch notes on a Hopper GPU
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return step

    monkeypatch.setattr(dec, "_step_fn", failing(True))
    with pytest.raises(RuntimeError, match=r"dependent launch.*not permitted.*DSV4_PDL=0") as got:
        dec.step(1, torch.tensor([3]), torch.tensor([True]))
    assert "not permitted" in str(got.value.__cause__)
    monkeypatch.setattr(dec, "_step_fn", failing(False))
    with pytest.raises(RuntimeError, match="not permitted") as got:
        dec.step(1, torch.tensor([3]), torch.tensor([True]))
    assert "DSV4_PDL" not in str(got.value)


def test_the_engine_feeds_the_decode_step_in_place(monkeypatch):
    """The cached engine writes each slot's next token and the live mask where the decode step reads them (the
    decoder's own buffers), so a step copies neither (two launches outside its CUDA graph); a caller that passes
    other tensors gets them copied in."""
    from kernels.reference.model import init_weights
    from rollout import slot_decoder
    from rollout.reference_engine import ReferenceEngine, SamplingParams

    e = ReferenceEngine(CFG, dtype=torch.bfloat16, device="cpu", kv_cache=True, cuda_graphs=False, max_slots=2)
    init_weights(e.model, 0)
    e.begin_update(1)
    e.load_bucket([(n, t.clone()) for n, t in e.model.state_dict().items()])
    e.finish_update()
    seen, real = [], slot_decoder._is_prefix
    monkeypatch.setattr(slot_decoder, "_is_prefix", lambda t, buf, b: seen.append(real(t, buf, b)) or seen[-1])
    want = e.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, stop_token_ids=()), n=2, seed=0)
    assert len(seen) >= 10 and all(seen)                  # tokens and mask, every step, in place
    dec = e._decoder
    dec.step(1, torch.tensor([4]), torch.tensor([False]))      # other tensors: copied in
    assert int(dec.tokens[0]) == 4 and not bool(dec.active[0]) and seen[-2:] == [False, False]
    monkeypatch.setattr(slot_decoder, "_is_prefix", real)
    again = e.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, stop_token_ids=()), n=2, seed=0)
    for g_again, g_want in zip(again, want):            # a stale buffer (the step above) changes no sample
        for a, w in zip(g_again, g_want):
            assert a.response_ids == w.response_ids and torch.equal(a.logprobs, w.logprobs)
