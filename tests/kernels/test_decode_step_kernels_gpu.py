"""The rollout engine's eager decode step with every kernel of the triton backend's decode table at once: the
compressors' ``compressor_step``, the attention's ``norm_rope``, the indexer's ``index_query`` and
``decode_topk``, a layer's projections of its attention input (``linear_group``), each site's mHC pre with its
sublayer's norm (``hc_pre_norm``), the head's collapse with the final norm (``hc_head_norm``), the window and HCA
layers' attention rows (``attention_rows``), every layer's attention with its output's inverse rotation
(``attention_inverse_rope``), its grouped ``wo_a`` (``grouped_projection``) and its ``wo_b`` with the site's mHC
post (``linear_post``), and on the grouped MoE path the router, the expert order, the pair
GEMMs with the shared expert (the second with the activation in its operand load) and their sum inside the MoE's mHC
post (``moe_combine_post``). The tiny
model's samples follow the reference-op engine's (fp16: the same tokens,
log-probabilities within 5e-3 nats; bf16: within 5e-2 before the first differing token; both before the first
position where the two engines' routers picked other experts, and at least ``COMPARED_SHARE`` of the positions
compared), every op of the record ran and nothing else. On a GPU in bf16
(the grouped path is a Hopper's); with no GPU, ``TRITON_INTERPRET=1`` runs the same kernels on the CPU in fp16 (the
interpreter multiplies bf16 tiles wrongly) with the grouped path forced, four to eight minutes a case on two cores
(numpy < 2.3: numpy 2.4 refuses the interpreter's scalar conversions); otherwise it skips."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu

# The least share of the positions compared (before each sample's first differing token or routing flip), so that
# the log-probabilities' bound is not met on a handful: a wrong kernel flips routes at once. bf16's rounding alone
# flips many: on one H200 (2026-12-07, grouped-20) 131 of 200 positions were compared at 0.009 nats, and the triton
# attention kernel alone, every other op the reference's, gave 129 (``python -m bench.logprob_kernels``,
# bench/results/logprob-kernels-h200-triton-tiny.json); on the CPU the reference-op engine in bf16 against itself in
# fp32 kept 95 of 200 (docs/rollout.md).
COMPARED_SHARE = {torch.float16: 0.75, torch.bfloat16: 0.4}


@pytest.mark.parametrize("grouped,n", [(True, 2), (False, 2), (True, 10)], ids=["grouped", "dense", "grouped-20"])
def test_the_step_with_every_decode_kernel_draws_the_reference_engines_samples(monkeypatch, grouped, n):
    """``n`` samples of two prompts: 4 sequences, and 20, above ``LINEAR_GROUP_CONFIG``'s 16 tokens, where the
    projections take the many-token settings (``kernels.triton.linear_group.token_settings``)."""
    from core.config import preset
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from kernels.triton import linear_group as LG
    from kernels.triton.backend import ops
    from rollout.engine_ops import EAGER_EXTRAS
    from rollout.reference_engine import ReferenceEngine, SamplingParams
    from rollout.sample_compare import first_differing_token, logprob_gap, same_routing_upto
    from rollout.weight_sync import sync_weights
    from train.model import build_train_model

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    if dev == "cpu" or not grouped:                        # the grouped path where the GPU would not take it
        import kernels.reference.slots as slots
        import rollout.engine_ops as engine_ops

        for mod in (slots, engine_ops):
            monkeypatch.setattr(mod, "grouped_decode_ok", lambda *a: grouped)
    cfg = preset("tiny")
    e = ReferenceEngine(cfg, ops=ops(), dtype=dt, device=dev, cuda_graphs=False)
    # every eager extra of the table
    extras = [op for op in EAGER_EXTRAS if op in ops().names()]
    assert set(extras) == {"compressor_step", "norm_rope", "decode_topk", "index_query", "linear_group",
                           "hc_pre_norm", "hc_head_norm", "attention_rows", "attention_inverse_rope",
                           "grouped_projection", "linear_post"}, extras
    assert e.decode_refusals == {} and all(e.decode_ops[op] == "triton" for op in extras), e.decode_ops
    pairs = ("route_experts", "expert_order", "experts_gather_mm", "experts_swiglu_scatter_mm", "moe_combine_post")
    assert all((op in e.decode_ops) is grouped for op in pairs), e.decode_ops
    assert "experts_scatter_mm" not in e.decode_ops       # the activation is the second GEMM's operand load
    assert "moe_combine" not in e.decode_ops              # the pairs' sum is the MoE's mHC post's
    ref = ReferenceEngine(cfg, dtype=dt, device=dev, cuda_graphs=False)
    model = build_train_model(cfg, seed=0)
    for eng in (e, ref):
        assert sync_weights(model, eng, version=1, engine_dtype=dt).ok
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=())
    prompts = [[0, 5, 6, 7, 8], [0, 9, 10]]
    rows = len(prompts) * n
    many = LG.token_settings(rows)
    above = rows > LG.LINEAR_GROUP_CONFIG["max_tokens"]
    assert many is not None and many["warps"] == (LG.MANY_TOKENS_CONFIG if above else LG.LINEAR_GROUP_CONFIG)["warps"]
    reset_kernels_ran()
    got = e.generate(prompts, params, n=n, seed=3)
    ran = kernels_ran()
    assert {k.split(".", 1)[1] for k in ran} == set(e.prefill_ops) | set(e.decode_ops) | set(e.sample_ops), ran
    want = ref.generate(prompts, params, n=n, seed=3)
    tol = 5e-3 if dt == torch.float16 else 5e-2            # bf16's rounding is 8x fp16's
    for ga, gb in zip(got, want, strict=True):             # fp16: the same tokens up to any routing flip
        for a, b in zip(ga, gb, strict=True):
            same = first_differing_token(a, b)
            assert dt == torch.bfloat16 or same is None or same >= same_routing_upto(a, b), (a.response_ids,
                                                                                          b.response_ids)
    gap = logprob_gap(got, want)                           # before each sample's first differing token or flip
    assert gap["max"] <= tol, gap
    assert gap["compared"] >= COMPARED_SHARE[dt] * gap["total"], gap
