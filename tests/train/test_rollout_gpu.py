"""The reference rollout engine on a GPU (skipped without CUDA; tagged ``gpu`` in Bazel).

    python -m pytest -q tests/train/test_rollout_gpu.py

* fp32 on CUDA (TF32 off, as the nvidia target sets it): the KV-cached engine draws the uncached engine's
  samples (tokens, finish reasons, routed experts equal; log-probabilities within 1e-5), and the CPU
  engine's tokens (the sampling streams are CPU generators, so a sample does not depend on the device);
* fp32 on CUDA, long sequences (tie-free 32-head indexer, as in tests/reference/test_decode.py): cached
  logits equal the full forward's at every decoded position (max relative error 1e-5);
* bf16 on CUDA (the run's default dtype there): the sampled tokens' log-probabilities agree with the fp32
  full forward (mean |diff| <= 2e-2, max <= 0.3 nats: bf16 activations, a near-tie routing flip);
* CUDA graphs (the default on CUDA) against the eager static step: fp32 tokens, finish reasons and routed
  experts equal, log-probabilities within 1e-5; bf16: every sample's log-probabilities agree within 5e-2 nats
  up to its first differing token (graph buckets are powers of two, eager ones every size, so GEMM shapes and
  their bf16 rounding differ), and at least half the samples are identical;
* continuous batching on the GPU (3 slots for 9 samples, early stops, graphs on) draws the all-at-once
  samples;
* ``compile=True`` (the decode step as Inductor code inside the CUDA graphs, by region; two slots, so two
  buckets, each region compiled for one slot and for more): teacher-forced on the compiled engine's own samples, the compiled step's log-probabilities of
  the fed tokens follow the eager step's without graphs (bf16: mean |diff| <= 1e-2, max <= 0.3 nats; the
  summation order differs, so the sampled tokens may too; on the CPU the same comparison measured 7.3e-4
  mean, and a wrong cache moves them by about 0.25 nats on average), and they are the log-probabilities the
  engine drew with. With ``--kernel-backend triton`` the backend's kernels (custom ops) trace into the
  compiled, graphed step, each region one graph (``fullgraph``) and the samples follow the reference-op engine's;
* the assembly of ``--hardware nvidia`` builds the engine on the current CUDA device, and a two-step GRPO
  run (miles, bf16) rolls out on it;
* ``indexer_replay=true`` on ``--hardware nvidia`` (miles and megatron packed; the reference ops and triton):
  the trainer replays the picks the engine recorded on the GPU, every step reports ``indexer_replay_match``
  (the fraction of replayed rows its own indexer picked alike: bf16 engine and trainer, so near 1, not 1)
  and a finite train/rollout log-prob difference within the bf16 bound;
* ``--kernel-backend triton|tilelang``: the engine computes with that table (prefill as given, the decode
  step's per-op choice recorded with its refusals), with and without CUDA graphs, and follows the
  reference-op engine.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.config import preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = preset("tiny")
PROMPTS = [[0, 5, 6, 7, 8], [0, 9, 10], [0, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(scope="module")
def train_model():
    from train.model import build_train_model

    return build_train_model(CFG, seed=0)


def _engine(model, device, dtype=torch.float32, kv_cache=True, **kw):
    from rollout.reference_engine import ReferenceEngine
    from rollout.weight_sync import sync_weights

    e = ReferenceEngine(CFG, dtype=dtype, device=device, kv_cache=kv_cache, **kw)
    assert sync_weights(model, e, version=1, engine_dtype=dtype).ok
    return e


def _params(**kw):
    from rollout.reference_engine import SamplingParams

    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 12, "stop_token_ids": tuple(range(2, 1024, 5)),
                             **kw})


def test_cached_engine_on_cuda_draws_the_uncached_and_cpu_engines_samples(train_model):
    params = _params(top_p=0.9, top_k=40)
    got = _engine(train_model, "cuda").generate(PROMPTS, params, n=3, seed=7)
    for other, atol in ((_engine(train_model, "cuda", kv_cache=False), 1e-5), (_engine(train_model, "cpu"), 1e-4)):
        want = other.generate(PROMPTS, params, n=3, seed=7)
        for ga, gb in zip(got, want):
            for a, b in zip(ga, gb):
                assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
                assert torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=atol)
                if other.device.type == "cuda":
                    assert torch.equal(a.routed_experts, b.routed_experts)


def _pairs(a, b):
    return [(x, y) for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True)]


def test_cuda_graph_decode_equals_eager_decode_fp32(train_model):
    params = _params(top_p=0.9)
    graphs = _engine(train_model, "cuda")
    assert graphs.cuda_graphs
    got = graphs.generate(PROMPTS, params, n=4, seed=3)
    assert graphs._decoder._graphs                     # the step was replayed from graphs
    want = _engine(train_model, "cuda", cuda_graphs=False).generate(PROMPTS, params, n=4, seed=3)
    for a, b in _pairs(got, want):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_cuda_graph_decode_follows_eager_decode_bf16(train_model):
    params = _params(max_new_tokens=16, stop_token_ids=())
    got = _engine(train_model, "cuda", dtype=torch.bfloat16).generate(PROMPTS, params, n=4, seed=0)
    want = _engine(train_model, "cuda", dtype=torch.bfloat16, cuda_graphs=False).generate(PROMPTS, params, n=4,
                                                                                          seed=0)
    same, worst = 0, 0.0
    for a, b in _pairs(got, want):
        k = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y),
                 len(a.response_ids))
        same += k == len(a.response_ids)
        k = min(k + 1, len(a.response_ids))           # the first differing draw still saw the same prefix
        worst = max(worst, float((a.logprobs[:k] - b.logprobs[:k]).abs().max()))
    print(f"bf16 graphs vs eager: {same}/{len(_pairs(got, want))} samples identical, max |dlogp| {worst:.2e}")
    assert worst <= 5e-2 and same * 2 >= len(_pairs(got, want))


def test_generate_timing_on_cuda_is_the_device_time_of_each_phase(train_model):
    """``generate_timing`` with CUDA graphs: CUDA events at each change of phase (the loop runs ahead of the GPU,
    so a host clock would time launches): the first call sets the slots up (graph capture), a second of the same
    size does not; every sample in the slots at once, one decode step a token, and the cache bytes they read; the
    phases fit in the call."""
    import time

    params = _params(max_new_tokens=12, stop_token_ids=())
    e = _engine(train_model, "cuda", dtype=torch.bfloat16)
    e.generate(PROMPTS, params, n=4, seed=0)
    assert e.generate_timing()["setup_s"] > 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e.generate(PROMPTS, params, n=4, seed=1)
    wall = time.perf_counter() - t0
    got = e.generate_timing()
    assert "setup_s" not in got or got["setup_s"] < 1e-3      # the slots fit: no capture
    assert got["decode_steps"] == 11 and got["decode_rows"] == 4 * len(PROMPTS) * 11
    from kernels.reference.decode import kv_read_bytes          # the bf16 cache's bytes, 2 a value

    assert got["decode_kv_bytes"] == 4 * sum(kv_read_bytes(e.config, len(p) + i, 2) for p in PROMPTS
                                             for i in range(1, 12))
    assert 0 < got["prefill_s"] and 0 < got["decode_s"] and got["prefill_s"] + got["decode_s"] <= wall


def test_continuous_batching_on_cuda(train_model):
    params = _params(top_k=40)
    few = _engine(train_model, "cuda", max_slots=3)
    got = few.generate(PROMPTS, params, n=3, seed=9)
    assert few._decoder.slots == 3 and few.cuda_graphs
    want = _engine(train_model, "cuda").generate(PROMPTS, params, n=3, seed=9)
    for a, b in _pairs(got, want):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(a.routed_experts, b.routed_experts)
    assert len({len(s.response_ids) for g in got for s in g}) > 1


def _teacher_forced_logprobs(engine, dec, samples):
    """The log-probabilities ``[steps, rows]`` that ``dec`` (a SlotDecoder on ``engine.model``) gives each sample's
    response tokens, fed one by one after a prefill of its prompt (all samples at once, one per slot)."""
    from kernels.reference.decode import prefill

    rows = len(samples)
    dev = engine.device
    active = torch.ones(rows, dtype=torch.bool, device=dev)
    with torch.no_grad():
        with engine._computing("prefill"):
            cache, _ = prefill(engine.model, [s.prompt_ids for s in samples], max_len=dec.max_len)
        dec.cache.load(range(rows), cache, range(rows))
        out = []
        with engine._computing("decode"):
            for t in range(len(samples[0].response_ids) - 1):
                fed = torch.tensor([s.response_ids[t] for s in samples], device=dev)
                nxt = torch.tensor([s.response_ids[t + 1] for s in samples], device=dev)
                logits, _ = dec.step(rows, fed, active)
                out.append(torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None])[:, 0].cpu())
    return torch.stack(out)


def test_compiled_graph_decode_follows_the_eager_step_bf16(train_model):
    from kernels.reference.decode import prefill
    from rollout.slot_decoder import SlotDecoder

    e = _engine(train_model, "cuda", dtype=torch.bfloat16, compile=True, max_slots=2)
    assert e.cuda_graphs and e.compile == "inductor"
    params = _params(max_new_tokens=16, stop_token_ids=())
    got = [s for g in e.generate(PROMPTS[:2], params, n=1, seed=0) for s in g]
    dec = e._decoder
    assert dec.compile == "inductor" and sorted(dec._graphs) == [1, 2]
    with torch.no_grad(), e._computing("decode"):
        template, _ = prefill(e.model, [[0]], max_len=dec.max_len)
    eager = SlotDecoder(e.model, template, 2, cuda_graphs=False)
    lp_compiled = _teacher_forced_logprobs(e, dec, got)
    lp_eager = _teacher_forced_logprobs(e, eager, got)
    d = (lp_compiled - lp_eager).abs()
    print(f"bf16 compiled+graphs vs eager step, teacher-forced: mean |dlogp| {float(d.mean()):.2e}, "
          f"max {float(d.max()):.2e}")
    assert float(d.mean()) <= 1e-2 and float(d.max()) <= 0.3
    # the compiled engine's own draws are those log-probabilities (the first token comes from prefill)
    drawn = torch.stack([s.logprobs[1:] for s in got], dim=1)
    assert torch.allclose(drawn, lp_compiled, rtol=0, atol=1e-5)


def test_the_compiled_step_traces_the_triton_backends_kernels(train_model):
    """``--kernel-backend triton`` with ``compile=True`` and CUDA graphs (one slot: one bucket to compile): the
    backend's decode kernels are custom ops (``kernels.gpu_ops``), so each region of the step compiles as one
    graph (``fullgraph``: a graph break would raise) and its kernels are recorded into the CUDA graph; the samples
    follow the reference-op engine's (as in test_the_engine_runs_the_runs_gpu_kernels)."""
    pytest.importorskip("triton")
    from core.assembly import assemble
    from core.run_config import Choices, normalize
    from engine.compile import kernel_op_names
    from launchers.builtin_plugins import make_host
    from rollout.engine_ops import EAGER_EXTRAS, INDUCTOR_FUSES
    from rollout.reference_engine import ReferenceEngine, SamplingParams
    from rollout.weight_sync import sync_weights

    run = normalize(Choices(impl="miles", hardware="nvidia", kernel_backend="triton", rollout_engine="reference",
                            model=CFG), make_host(third_party=False), model_name="tiny")
    e = assemble(run).rollout_engine(CFG, dtype=torch.bfloat16, compile=True, max_slots=1)
    print("decode ops:", e.decode_ops, "refusals:", e.decode_refusals)
    assert e.cuda_graphs and e.compile == "inductor"
    if not any(who == "triton" for who in e.decode_ops.values()):
        pytest.skip(f"the triton backend serves no op of the tiny model's decode step: {e.decode_refusals}")
    assert not set(kernel_op_names(e.decode_table)) & set(e.decode_ops) and e._fullgraph
    # the compiled step leaves the norms, RoPE and the experts' activation to Inductor (rollout.engine_ops)
    assert {e.decode_ops[op] for op in INDUCTOR_FUSES if op in e.decode_ops} == {"none"}, e.decode_ops
    assert "expert_order" not in e.decode_ops          # traced, the counting's torch code: Inductor fuses it
    assert not set(EAGER_EXTRAS) & set(e.decode_ops)   # likewise the compressors', norms' and rotations' torch code
    ref = ReferenceEngine(CFG, dtype=torch.bfloat16, device=e.device, max_slots=1)
    for eng in (e, ref):
        assert sync_weights(train_model, eng, version=1, engine_dtype=torch.bfloat16).ok
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=())
    got = e.generate(PROMPTS[:2], params, n=1, seed=3)
    assert sorted(e._decoder._graphs) == [1]
    want = ref.generate(PROMPTS[:2], params, n=1, seed=3)
    for a, b in _pairs(got, want):
        same = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y), None)
        upto = len(a.response_ids) if same is None else same + 1
        assert (a.logprobs[:upto] - b.logprobs[:upto]).abs().max() <= 5e-2


def test_cached_logits_equal_the_full_forward_on_cuda():
    from kernels.reference.decode import decode_step, prefill
    from kernels.reference.model import DeepseekV4Model, init_weights

    m = DeepseekV4Model(CFG.replace(index_n_heads=32)).eval()
    init_weights(m, 0, std=0.05)
    m.cuda()
    g = torch.Generator().manual_seed(5)
    lengths, steps = (3, 120, 131, 62), 14
    seqs = [torch.randint(2, 1024, (L + steps,), generator=g).cuda() for L in lengths]
    with torch.no_grad():
        cache, logits = prefill(m, [s[:L].tolist() for s, L in zip(seqs, lengths)], max_len=max(lengths) + steps)
        out = [logits]
        for t in range(steps - 1):
            out.append(decode_step(m, cache, torch.stack([s[L + t] for s, L in zip(seqs, lengths)])))
        for b, (s, L) in enumerate(zip(seqs, lengths)):
            full = m(s[None, : L + steps - 1])[0]
            for t in range(steps):
                want = full[L - 1 + t]
                assert float((out[t][b] - want).abs().max() / want.abs().max()) <= 1e-5, (L, t)


def test_bf16_engine_on_cuda_agrees_with_the_fp32_forward(train_model):
    e = _engine(train_model, "cuda", dtype=torch.bfloat16)
    assert e.model.embed.weight.dtype == torch.bfloat16 and e.model.embed.weight.is_cuda
    ref = _engine(train_model, "cpu")
    diffs = []
    for s in (x for g in e.generate(PROMPTS, _params(max_new_tokens=16, stop_token_ids=()), n=4, seed=0) for x in g):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = ref.model(ids)[0, len(s.prompt_ids) - 1: -1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        diffs.append((s.logprobs - want).abs())
    d = torch.cat(diffs)
    print(f"bf16 cuda engine vs fp32 forward: mean |dlogp| {float(d.mean()):.2e}, max {float(d.max()):.2e}")
    assert float(d.mean()) <= 2e-2 and float(d.max()) <= 0.3


def _nvidia_run(rollout="reference", impl="miles", kernel_backend="none"):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, hardware="nvidia", kernel_backend=kernel_backend, rollout_engine=rollout,
                             model=CFG),
                     make_host(third_party=False), model_name="tiny")


def test_the_nvidia_runs_engine_is_on_its_gpu_in_bf16():
    from core.assembly import assemble

    run = _nvidia_run()
    e = assemble(run).rollout_engine(CFG, dtype=run.torch_dtype)
    assert e.device == torch.device("cuda", torch.cuda.current_device())
    assert run.torch_dtype == torch.bfloat16 and e.model.head.weight.dtype == torch.bfloat16


def test_grpo_rolls_out_on_the_gpu(tmp_path):
    from core.assembly import assemble
    from reporting.metrics import read_metrics
    from orchestration import run_training

    run = _nvidia_run()
    assemble(run).setup_process()
    run_training(run, CFG, mode="grpo", steps=2, run_dir=tmp_path / "run", max_new_tokens=6, prompts_per_step=2,
                 group_size=4, top_k=50, progress=False, export_at_end=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["weight_check_ok"] is True and math.isfinite(r["train_rollout_logprob_abs_diff"])
        assert r["train_rollout_logprob_abs_diff"] < 5e-2       # bf16 engine vs bf16 trainer


@pytest.mark.parametrize("backend", ["none", "triton"])
@pytest.mark.parametrize("impl,packed", [("miles", None), ("megatron", 256)], ids=["miles", "megatron-packed"])
def test_grpo_replays_the_engines_indexer_picks_on_the_gpu(tmp_path, impl, packed, backend):
    from core.assembly import assemble
    from orchestration import run_training
    from reporting.metrics import read_metrics

    if backend != "none":
        pytest.importorskip(backend)
    run = _nvidia_run(impl=impl, kernel_backend=backend)
    assemble(run).setup_process()
    run_training(run, CFG, mode="grpo", steps=2, run_dir=tmp_path / "run", max_new_tokens=6, prompts_per_step=2,
                 group_size=4, progress=False, export_at_end=False, indexer_replay=True,
                 max_tokens_per_rank=packed)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.5 <= r["indexer_replay_match"] <= 1.0, r
        assert math.isfinite(r["train_rollout_logprob_abs_diff"]) and r["train_rollout_logprob_abs_diff"] < 5e-2


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_engine_runs_the_runs_gpu_kernels(train_model, backend, graphs):
    """``--kernel-backend triton|tilelang`` on ``--hardware nvidia`` (bf16): the assembly hands the engine the
    backend's table; every op the engine calls is served by the backend in prefill (where the backend names
    the reference op, ``none``), the decode step's choice is recorded (``decode_ops``, the decode-only expert
    GEMM kernel included; each ``none`` there that the table did not name itself comes with its refusal), the
    kernels that ran are exactly the recorded ones, the counts name the backend, and the samples follow
    the reference-op engine (bf16 log-probabilities within 5e-2 nats up to each sample's first differing
    token)."""
    pytest.importorskip(backend)
    from core.assembly import assemble
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from core.run_config import Choices, normalize
    from kernels.reference.slots import COMBINE_POST, PAIR_KERNELS, SWIGLU_SCATTER
    from launchers.builtin_plugins import make_host
    from rollout.engine_ops import EAGER_EXTRAS
    from rollout.reference_engine import ReferenceEngine, SamplingParams
    from rollout.weight_sync import sync_weights

    run = normalize(Choices(impl="miles", hardware="nvidia", kernel_backend=backend, rollout_engine="reference",
                            model=CFG), make_host(third_party=False), model_name="tiny")
    parts = assemble(run)
    e = parts.rollout_engine(CFG, dtype=torch.bfloat16, cuda_graphs=graphs)
    assert e.ops.backend == backend
    assert e.prefill_ops == {op: parts.ops.provider[op] for op in e.prefill_ops}
    for op, who in e.decode_ops.items():
        assert who == parts.ops.provider[op] or op in e.decode_refusals, (op, who)
    print("decode ops:", e.decode_ops, "refusals:", e.decode_refusals)
    if backend == "triton":     # the eager step's norms, RoPE and (grouped MoE, bf16 on this GPU) the activation
        assert {e.decode_ops[op] for op in ("rms_norm", "rms_normalize", "apply_rope", "weighted_swiglu")} == {
            "triton"}, e.decode_ops
        # the sampler's kernel (top-p 1 here), and in a decode step the draw with its records
        assert e.sample_ops == {"draw_tokens": "triton", "draw_record": "triton"}
    ref = ReferenceEngine(CFG, dtype=torch.bfloat16, device=e.device, cuda_graphs=graphs)
    for eng in (e, ref):
        assert sync_weights(train_model, eng, version=1, engine_dtype=torch.bfloat16).ok
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=())
    reset_kernels_ran()
    got = e.generate(PROMPTS, params, n=2, seed=3)
    ran = kernels_ran()
    print("kernels ran:", ran)
    assert any(k.startswith(f"{backend}.") for k in ran), ran
    assert {k.split(".", 1)[1] for k in ran} == set(e.prefill_ops) | set(e.decode_ops) | set(e.sample_ops), ran
    if all(op in parts.ops.names() for op in PAIR_KERNELS):    # the eager MoE's GEMMs through the expert order
        # the second with the activation in its operand load, where the table has that op
        # and the pairs' sum inside the MoE's mHC post, where the table has that op
        second = SWIGLU_SCATTER if SWIGLU_SCATTER in parts.ops.names() else "experts_scatter_mm"
        summed = COMBINE_POST if COMBINE_POST in parts.ops.names() else "moe_combine"
        pair_ops = [{"experts_scatter_mm": second, "moe_combine": summed}.get(op, op) for op in PAIR_KERNELS]
        assert all(e.decode_ops[op] == backend and ran[f"{backend}.{op}"] > 0 for op in pair_ops), ran
    elif "experts_grouped_mm" in parts.ops.names():        # the decode MoE's GEMMs: a decode-only kernel
        assert e.decode_ops["experts_grouped_mm"] == backend and ran[f"{backend}.experts_grouped_mm"] > 0
    if "expert_order" in parts.ops.names():                # the eager MoE's pairs in expert order, one launch
        assert e.decode_ops["expert_order"] == backend and ran[f"{backend}.expert_order"] > 0
    for op in EAGER_EXTRAS:         # the eager step's compressors after their GEMMs; its norms and rotations
        if op in parts.ops.names():
            assert e.decode_ops[op] == backend and ran[f"{backend}.{op}"] > 0, (op, e.decode_refusals)
    want = ref.generate(PROMPTS, params, n=2, seed=3)
    for ga, gb in zip(got, want):
        for a, b in zip(ga, gb):
            same = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y), None)
            upto = len(a.response_ids) if same is None else same + 1
            assert (a.logprobs[:upto] - b.logprobs[:upto]).abs().max() <= 5e-2


def test_weights_drawn_on_the_gpu_are_seeded_by_name():
    """``init_weights(..., draw_on_device=True)`` (bench.rollout's init on a GPU): the same seed gives the same
    values, another seed other ones, and the draws have the stated std (norm weights stay 1)."""
    from kernels.reference.model import DeepseekV4Model, init_weights

    def drawn(seed):
        m = DeepseekV4Model(CFG, device="cuda")
        init_weights(m, seed, draw_on_device=True)
        return m.state_dict()

    a, b, c = drawn(0), drawn(0), drawn(1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    name = next(n for n in a if n.endswith("wq_a.weight"))
    assert not torch.equal(a[name], c[name])
    assert abs(a[name].float().std().item() - 0.02) < 2e-3
    assert all(torch.all(t == 1) for n, t in a.items() if n.endswith("norm.weight"))


@pytest.mark.parametrize("compile", [None, "inductor"], ids=["graphs", "compiled-graphs"])
def test_cuda_graph_decode_records_the_indexer_picks(compile):
    """Indexer replay's recording on the GPU: the picks the decode step returns from its CUDA graphs (compiled or
    not) equal the eager step's and the full forward's at every position (fp32; 32 indexer heads: no exact score
    ties; sequences past 32 tokens: the indexer truncates)."""
    from rollout.replay import IndexerPicksRecorder
    from train.model import build_train_model

    cfg = CFG.replace(index_n_heads=32)
    model = build_train_model(cfg, seed=0)
    prompts = [list(range(2, 40)), [0, 9, 10]]
    params = _params(max_new_tokens=20, stop_token_ids=())

    def engine(**kw):
        from rollout.reference_engine import ReferenceEngine
        from rollout.weight_sync import sync_weights

        e = ReferenceEngine(cfg, device="cuda", record_indexer=True, **kw)
        assert sync_weights(model, e, version=1).ok
        return e

    graphs = engine(compile=compile)
    got = graphs.generate(prompts, params, n=3, seed=1)
    assert graphs._decoder._graphs
    want = engine(cuda_graphs=False).generate(prompts, params, n=3, seed=1)
    for a, b in _pairs(got, want):
        assert a.response_ids == b.response_ids and torch.equal(a.indexer_picks, b.indexer_picks)
        seq = a.prompt_ids + a.response_ids
        rec = IndexerPicksRecorder(graphs.model, cfg)
        with rec.context(), torch.no_grad():
            graphs.model(torch.tensor([seq], device="cuda"))
        assert torch.equal(a.indexer_picks, rec.as_tensor(1, len(seq))[0, :-1])
    assert (got[0][0].indexer_picks >= 0).sum(-1).max() == cfg.index_topk


def test_decode_steps_do_not_wait_for_the_gpu(train_model):
    """Between decode steps the engine's host never waits for the GPU's queue: with stop tokens (samples leave
    at different steps, so the live set and its index tensors change) a call of 12 new tokens makes as many
    ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` calls as one of 2 (the prefill's, the first draws', the
    results' copies). The stop flags are read one step late with an event, and the slots' index tensors go
    through pinned memory (``kernels.reference.decode.to_device``); before, each step copied its flags to the
    host and each change of the live set its indices from pageable memory, waiting for every queued kernel."""
    import dataclasses

    from torch.profiler import ProfilerActivity, profile

    e = _engine(train_model, "cuda", dtype=torch.bfloat16)
    params = _params(max_new_tokens=12)

    def waits(new_tokens):
        e.generate(PROMPTS, dataclasses.replace(params, max_new_tokens=new_tokens), n=3, seed=0)    # warm
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            got = e.generate(PROMPTS, dataclasses.replace(params, max_new_tokens=new_tokens), n=3, seed=0)
            torch.cuda.synchronize()
        n = sum(ev.count for ev in prof.key_averages()
                if ev.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
        return n, got

    few, _ = waits(2)
    many, got = waits(12)
    assert len({len(s.response_ids) for g in got for s in g}) > 1          # samples left at different steps
    assert many == few, (few, many)
