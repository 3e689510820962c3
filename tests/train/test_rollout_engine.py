"""The reference rollout engine: KV-cached batched generation against the former uncached engine.

Both engines hold the same weights (synced from one training model through the real weight-sync path) and
sample from the same per-sample streams, so they must draw the same tokens, with the same log-probabilities
(to fp32 rounding), finish reasons and routed experts. The prompts are short enough (<= 32 tokens with the
response) that the tiny indexer's top-k keeps every visible entry: exact score ties at the top-k boundary
(common with its 4 indexer heads) would be broken differently by rows of different lengths
(tests/reference/test_decode.py covers long sequences with a tie-free indexer).
"""

from __future__ import annotations

import pytest
import torch

from core.config import preset

CFG = preset("tiny")
PROMPTS = [[0, 5, 6, 7, 8], [0, 9, 10], [0, 11, 12, 13, 14, 15, 16, 17, 18, 19], [0, 9, 10]]
N = 3


@pytest.fixture(scope="module")
def engines():
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    model = build_train_model(CFG, seed=0)
    out = {}
    for kv in (True, False):
        e = ReferenceEngine(CFG, kv_cache=kv)
        assert sync_weights(model, e, version=1).ok
        out[kv] = e
    return out


def _params(**kw):
    from rollout.reference_engine import SamplingParams

    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 12, **kw})


def _same(a, b):
    for ga, gb in zip(a, b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert x.prompt_ids == y.prompt_ids
            assert x.response_ids == y.response_ids
            assert x.finish_reason == y.finish_reason
            assert torch.allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5), (x.logprobs - y.logprobs).abs().max()
            assert torch.equal(x.routed_experts, y.routed_experts)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(top_p=0.9, top_k=40, temperature=0.8),
    # about one token in five stops: samples finish at different steps and leave the cached batch
    dict(stop_token_ids=tuple(range(2, 1024, 5))),
])
def test_cached_engine_draws_the_uncached_engines_samples(engines, kw):
    params = _params(**kw)
    cached = engines[True].generate(PROMPTS, params, n=N, seed=7)
    uncached = engines[False].generate(PROMPTS, params, n=N, seed=7)
    _same(cached, uncached)
    samples = [s for g in cached for s in g]
    assert len(cached) == len(PROMPTS) and all(len(g) == N for g in cached)
    for s in samples:
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, CFG.n_layers,
                                          CFG.n_activated_experts)
        assert (s.routed_experts[:, : CFG.n_hash_layers] == -1).all()      # hash layers: never replayed
        assert (s.routed_experts[:, CFG.n_hash_layers:] >= 0).all()        # every fed token recorded
    if "stop_token_ids" in kw:
        lengths = {len(s.response_ids) for s in samples}
        assert len(lengths) > 2 and any(s.finish_reason == "stop" for s in samples)
        assert all(s.response_ids[-1] in params.stop_token_ids for s in samples if s.finish_reason == "stop")
    # the repeated prompt (indices 1 and 3) gets its own samples: the streams are per prompt index
    assert [s.response_ids for s in cached[1]] != [s.response_ids for s in cached[3]]


def test_logprobs_are_the_trainers_recomputation(engines):
    """A sample's log-probabilities are log softmax(logits / T) of the full forward at its positions."""
    e = engines[True]
    params = _params(temperature=0.7, top_p=0.8)
    for s in (x for g in e.generate(PROMPTS[:3], params, n=2, seed=1) for x in g):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = e.model(ids)[0, len(s.prompt_ids) - 1: -1]
        want = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.allclose(s.logprobs, want, rtol=0, atol=1e-5)


def test_a_samples_tokens_do_not_depend_on_the_rest_of_the_batch():
    """Per-sample streams and per-row caches: prompt 0's samples are the same alone and next to a longer
    prompt (which pads the prefill) and with more samples per prompt. In fp64: another batch shape changes
    fp32 rounding by about 1e-7, and the tiny model's nearly flat distribution (top-p 0.95 keeps about 930 of
    1024 tokens) puts some uniform draws that close to a token boundary (seed 3 does in fp32); what this test
    checks is the sampling streams and the per-row cache, not fp32 rounding."""
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    e = ReferenceEngine(CFG, dtype=torch.float64)
    sync_weights(build_train_model(CFG, seed=0), e, version=1, engine_dtype=torch.float64)
    params = _params(top_p=0.95)
    alone = e.generate(PROMPTS[:1], params, n=2, seed=3)[0]
    batched = e.generate([PROMPTS[0], PROMPTS[2]], params, n=3, seed=3)[0]
    for a, b in zip(alone, batched):
        assert a.response_ids == b.response_ids
        assert torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    again = e.generate(PROMPTS[:1], params, n=2, seed=3)[0]
    assert [s.response_ids for s in again] == [s.response_ids for s in alone]
    other = e.generate(PROMPTS[:1], params, n=2, seed=4)[0]
    assert [s.response_ids for s in other] != [s.response_ids for s in alone]


def test_top_k_one_decodes_greedily(engines):
    e = engines[True]
    s = e.generate(PROMPTS[:1], _params(top_k=1, max_new_tokens=6), n=2, seed=0)[0]
    assert s[0].response_ids == s[1].response_ids
    ids = list(PROMPTS[0])
    with torch.no_grad():
        for tok in s[0].response_ids:
            assert tok == int(e.model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(tok)


def test_the_cached_engine_does_not_recompute_prefixes(engines):
    """Work counted by the engines: the cached one feeds each distinct prompt once (padded to the longest)
    and one token per unfinished sample per step; the uncached one re-feeds every prefix."""
    params = _params(max_new_tokens=10, stop_token_ids=())
    cached, uncached = engines[True], engines[False]
    cached.positions_fed = uncached.positions_fed = 0
    cached.generate(PROMPTS, params, n=N, seed=0)
    uncached.generate(PROMPTS, params, n=N, seed=0)
    distinct = 3                                     # PROMPTS[1] == PROMPTS[3]
    longest = max(len(p) for p in PROMPTS)
    assert cached.positions_fed == distinct * longest + len(PROMPTS) * N * (params.max_new_tokens - 1)
    assert uncached.positions_fed == sum(N * (len(p) + t) for p in PROMPTS for t in range(params.max_new_tokens))
    assert cached.positions_fed * 4 < uncached.positions_fed


def test_generate_timing_splits_the_call_by_phase(engines):
    """``generate_timing``: the last cached call's decode steps and the rows they fed (each sample its
    ``max_new_tokens - 1`` tokens after the first draw, in one wave or in several when the slots are fewer than the
    samples), the cache bytes they read (a sample of a ``P``-token prompt feeds tokens that attend ``P + 1`` to
    ``P + max_new_tokens - 1`` positions), the phases' seconds within the call's wall time; none for the uncached
    engine."""
    import time

    from kernels.reference.decode import kv_read_bytes
    from rollout.reference_engine import ReferenceEngine
    from rollout.weight_sync import sync_weights
    from train.model import build_train_model

    params = _params(max_new_tokens=10, stop_token_ids=())
    samples = len(PROMPTS) * N
    assert engines[False].generate_timing() is None
    few = ReferenceEngine(CFG, max_slots=5)
    assert sync_weights(build_train_model(CFG, seed=0), few, version=1).ok
    for e, steps in ((engines[True], params.max_new_tokens - 1), (few, None)):
        t0 = time.perf_counter()
        e.generate(PROMPTS, params, n=N, seed=0)
        wall = time.perf_counter() - t0
        got = e.generate_timing()
        assert got["decode_rows"] == samples * (params.max_new_tokens - 1)
        assert got["decode_kv_bytes"] == N * sum(kv_read_bytes(CFG, len(p) + i, 4) for p in PROMPTS    # fp32 cache
                                                 for i in range(1, params.max_new_tokens))
        if steps is not None:                   # every sample in the slots at once: one step a token
            assert got["decode_steps"] == steps
        else:                                   # 12 samples through 5 slots: at least three waves of steps
            assert got["decode_steps"] >= 3 * (params.max_new_tokens - 1)
        assert got["prefill_s"] > 0 and got["decode_s"] > 0
        assert sum(v for k, v in got.items() if k.endswith("_s")) <= wall
    # samples that stop leave the steps: the rows fed are the positions fed less the prompts' (3 distinct, 10 long)
    e = engines[True]
    e.positions_fed = 0
    e.generate(PROMPTS, _params(max_new_tokens=10, stop_token_ids=tuple(range(2, 1024, 5))), n=N, seed=0)
    got = e.generate_timing()
    assert got["decode_rows"] == e.positions_fed - 3 * 10 < samples * 9
    assert 0 < got["decode_kv_bytes"] < N * sum(kv_read_bytes(CFG, len(p) + i, 4) for p in PROMPTS for i in range(1, 10))


def test_the_phase_clock_sums_each_phase_over_its_spans(monkeypatch):
    """On the CPU the clock reads ``time.perf_counter`` at each change of phase; here a clock the test moves (a
    wall clock and sleeps failed once in CI: a 50 ms sleep overshot by 23 ms on the busy two-core machine)."""
    import types

    from rollout import phase_clock

    now = [100.0]
    monkeypatch.setattr(phase_clock, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = phase_clock.PhaseClock(torch.device("cpu"))
    clock.enter("a")
    now[0] += 0.05
    clock.enter("b")
    now[0] += 0.01
    clock.enter("b")                            # no new mark: b's span runs on
    now[0] += 0.01
    clock.enter("a")
    now[0] += 0.03
    got = clock.seconds()
    assert set(got) == {"a", "b"}
    assert got["a"] == pytest.approx(0.08, abs=1e-9) and got["b"] == pytest.approx(0.02, abs=1e-9)


def _fresh_engine():
    """A cached engine of its own (its work count starts at 0; the fixture's is shared)."""
    from rollout.reference_engine import ReferenceEngine
    from rollout.weight_sync import sync_weights
    from train.model import build_train_model

    e = ReferenceEngine(CFG)
    assert sync_weights(build_train_model(CFG, seed=0), e, version=1).ok
    return e


def test_a_stopped_sample_leaves_the_batch_one_step_later():
    """The engine reads a step's stop flags after launching the next step (no wait for the GPU between steps),
    so a sample that draws a stop token at index ``d`` is fed that token once more and then leaves: it is fed
    ``d + 1`` tokens in decode steps (none when its first draw, at admission, stops it; ``T - 1`` when it runs to
    ``max_new_tokens`` ``T``). Its response still ends at the stop (``_same`` checks the samples elsewhere)."""
    e = _fresh_engine()
    params = _params(max_new_tokens=10, stop_token_ids=tuple(range(2, 1024, 5)))
    e.positions_fed = 0
    got = [s for g in e.generate(PROMPTS, params, n=N, seed=11) for s in g]
    T = params.max_new_tokens
    stopped = [s for s in got if s.finish_reason == "stop"]
    assert stopped and any(len(s.response_ids) < T for s in stopped)
    fed = sum(0 if len(s.response_ids) == 1 and s.finish_reason == "stop" else min(len(s.response_ids), T - 1)
              for s in got)
    assert e.positions_fed == 3 * max(len(p) for p in PROMPTS) + fed     # 3 distinct prompts, prefilled once


def test_the_stop_test_is_torch_isin(monkeypatch):
    """``stop_hits`` (the engine's stop test, which does not wait for the GPU as ``torch.isin`` did on CUDA) flags
    what ``torch.isin`` flags: hits, misses, one stop id, many, none drawn; and a generate call with stop tokens
    never calls ``torch.isin``, its samples ending where the test says."""
    from kernels.reference.sampling import stop_hits

    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 50, (37,), generator=g)
    for stops in (torch.tensor([3]), torch.arange(2, 50, 5), torch.tensor([60, 61]), tok[:4]):
        assert torch.equal(stop_hits(tok, stops), torch.isin(tok, stops)), stops
    e = _fresh_engine()
    params = _params(max_new_tokens=10, stop_token_ids=tuple(range(2, 1024, 5)))
    want = e.generate(PROMPTS, params, n=N, seed=11)
    monkeypatch.setattr(torch, "isin", lambda *a, **k: pytest.fail("the engine called torch.isin"))
    got = e.generate(PROMPTS, params, n=N, seed=11)
    for ga, gb in zip(got, want, strict=True):
        assert [s.response_ids for s in ga] == [s.response_ids for s in gb]
        assert [s.finish_reason for s in ga] == [s.finish_reason for s in gb]


def _one_running_sum_draw(probs, u):
    """The draw :func:`kernels.reference.sampling.draw_index` stands for: one float64 running sum of the row,
    the first index whose sum exceeds ``u x`` the row's mass, never past the last index with mass."""
    cdf = probs.double().cumsum(-1)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    last = torch.where(probs > 0, torch.arange(probs.shape[-1]), 0).amax(-1, keepdim=True)
    return torch.minimum(choice, last).squeeze(-1)


def test_the_two_level_draw_is_the_draw_of_one_running_sum():
    """draw_index finds the block by the blocks' float64 masses and the index by the running sum inside it: the
    same draws as one float64 running sum of the row, at vocabularies under, at and past a block, with a last
    partial block, trailing tokens without mass and whole blocks without mass; and through sample_tokens over
    the Flash vocabulary."""
    from rollout import reference_engine as R

    g = torch.Generator().manual_seed(0)
    for v in (7, 1024, 3000, 129280):
        probs = torch.softmax(torch.randn(64, v, generator=g) * 3.0, dim=-1)
        probs[0, v // 2:] = 0.0                               # trailing tokens without mass
        probs[1, : v // 2] = 0.0                              # leading ones (whole blocks at the larger v)
        probs[2, 1000:2100] = 0.0                             # a gap across a block boundary
        u = torch.rand(64, generator=g, dtype=torch.float64)
        got = R.draw_index(probs, u)
        assert got.dtype == torch.long and got.shape == (64,)
        assert torch.equal(got, _one_running_sum_draw(probs, u)), v
    params = R.SamplingParams(max_new_tokens=1)
    logits = torch.randn(64, 129280, generator=g) * 2.0
    u = torch.rand(64, generator=g, dtype=torch.float64)
    tok, lp = R.sample_tokens(logits, u, params)
    assert torch.equal(tok, _one_running_sum_draw(torch.softmax(logits.float(), dim=-1), u))
    assert torch.equal(lp, torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1))


def test_a_draw_never_lands_past_the_last_token_with_mass():
    """At the top of the unit interval (u one float64 step under 1) the target sits within rounding of the row's
    mass, where the blocks' sums and the running sum inside a block round differently: every draw still takes
    a token with mass, at or after where one running sum reaches all but 1e-9 of the mass, with the mass
    ending inside a block, at a block's end and in the last partial block."""
    from rollout import reference_engine as R

    g = torch.Generator().manual_seed(1)
    top = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    for v, end in ((5000, 2500), (5000, 2048), (5000, 5000), (129280, 129280)):
        probs = torch.softmax(torch.randn(256, v, generator=g) * 4.0, dim=-1)
        probs[:, end:] = 0.0
        tok = R.draw_index(probs, top.expand(256))
        assert bool((probs.gather(-1, tok[:, None]) > 0).all()), v
        cdf = probs.double().cumsum(-1)
        first = torch.searchsorted(cdf, (cdf[:, -1] * (1 - 1e-9))[:, None]).squeeze(-1)
        assert bool((tok >= first).all()), v


def test_a_scan_a_rounding_step_high_in_a_zero_tail_moves_no_draw_there(monkeypatch):
    """A GPU's parallel scan may leave a running sum's zero-mass tail a rounding step above the last entry with
    mass (here bumped by hand, at both levels): a draw near the top of the interval still takes the last token
    with mass, not one from the tail or past the row."""
    import kernels.reference.sampling as S
    from rollout import reference_engine as R

    real = S.running_sum
    monkeypatch.setattr(S, "running_sum", lambda x: torch.where(x > 0, real(x), real(x) + 1e-9))
    probs = torch.zeros(2, 3000)
    probs[0, :3] = torch.tensor([0.2, 0.5, 0.3])                            # all in the first block
    probs[1, 2040:2043] = torch.tensor([0.3, 0.5, 0.2])                     # in the second of three
    top = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    assert R.draw_index(probs, top.expand(2)).tolist() == [2, 2042]


def test_sample_tokens_inverse_cdf_with_top_p_and_top_k():
    from rollout.reference_engine import SamplingParams, sample_tokens

    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15]]))
    p = lambda **kw: SamplingParams(max_new_tokens=1, **kw)          # noqa: E731
    pick = lambda u, **kw: int(sample_tokens(logits, torch.tensor([u]), p(**kw))[0])  # noqa: E731
    # no truncation: intervals in id order [0, .1) [.1, .6) [.6, .85) [.85, 1)
    assert [pick(u) for u in (0.05, 0.15, 0.65, 0.95)] == [0, 1, 2, 3]
    # top-p 0.6 keeps ids 1 and 2 (mass 0.75), laid out by probability: [0, 2/3) -> 1, then 2
    assert [pick(u, top_p=0.6) for u in (0.0, 0.6, 0.7, 0.99)] == [1, 1, 2, 2]
    assert {pick(u / 10, top_k=1) for u in range(10)} == {1}
    tok, lp = sample_tokens(logits, torch.tensor([0.99]), p(top_k=2, temperature=2.0))
    assert int(tok) == 2
    assert torch.allclose(lp, torch.log_softmax(logits / 2.0, -1)[0, tok])    # the full tempered distribution
    with pytest.raises(ValueError, match="top_k"):
        p(top_k=-1)


def test_a_bf16_engine_passes_the_weight_check_and_follows_the_fp32_forward(engines):
    """bf16 (a GPU run's default): the engine holds each tensor in the dtype it is published in (its RMSNorm
    weights too, which the reference model would keep in fp32), so the checker passes; its samples' log-probs
    stay close to the fp32 forward's."""
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    e = ReferenceEngine(CFG, dtype=torch.bfloat16)
    rep = sync_weights(build_train_model(CFG, seed=0), e, version=1, engine_dtype=torch.bfloat16)
    assert rep.ok, rep.check.summary()
    assert e.model.layers[0].attn_norm.weight.dtype == torch.bfloat16
    assert e.model.layers[0].hc_attn_fn.dtype == torch.float32
    ref = engines[True].model
    diffs = []
    for s in (x for g in e.generate(PROMPTS[:2], _params(max_new_tokens=8, stop_token_ids=()), n=2, seed=0) for x in g):
        with torch.no_grad():
            logits = ref(torch.tensor([s.prompt_ids + s.response_ids]))[0, len(s.prompt_ids) - 1: -1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        diffs.append((s.logprobs - want).abs())
    d = torch.cat(diffs)
    assert float(d.mean()) <= 2e-2 and float(d.max()) <= 0.3


def test_the_assembly_gives_the_engine_the_runs_device_and_dtype():
    from core.assembly import assemble
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    run = normalize(Choices(rollout_engine="reference", hardware="cpu", model=CFG), make_host(third_party=False))
    e = assemble(run).rollout_engine(CFG, dtype=torch.bfloat16)
    assert e.device == assemble(run).device() == torch.device("cpu") and e.kv_cache
    assert e.model.embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_continuous_batching_draws_the_all_at_once_samples(engines, slots):
    """More samples than slots: a waiting sample is prefilled into the slot of the next one to finish (prompts
    of 3 to 10 tokens, about one token in five a stop). Every sample equals its all-at-once draw, and the
    uncached engine's (5 slots: at most two prompts per prefill forward)."""
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    e = ReferenceEngine(CFG, max_slots=slots, prefill_batch=2 if slots == 5 else None)   # 5: two per prefill
    assert sync_weights(build_train_model(CFG, seed=0), e, version=1).ok
    params = _params(stop_token_ids=tuple(range(2, 1024, 5)), top_p=0.95)
    got = e.generate(PROMPTS, params, n=N, seed=11)
    assert e._decoder.slots == slots
    _same(got, engines[True].generate(PROMPTS, params, n=N, seed=11))
    _same(got, engines[False].generate(PROMPTS, params, n=N, seed=11))
    assert len({len(s.response_ids) for g in got for s in g}) > 2       # samples finish at different steps


def test_bad_engine_options_are_refused():
    from rollout.reference_engine import ReferenceEngine

    with pytest.raises(ValueError, match="max_slots"):
        ReferenceEngine(CFG, max_slots=0)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        ReferenceEngine(CFG, cuda_graphs=True)


def test_a_model_whose_layers_are_all_hash_routed_generates_with_both_engines():
    """No learned-routing layer (every trunk layer hash-routed): nothing to record per token, and both engines
    still draw the same samples (the cached one used to fail building an empty index of layers)."""
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    cfg = CFG.replace(n_layers=2, compress_ratios=(0, 0, 0), n_hash_layers=2)
    model = build_train_model(cfg, seed=0)
    got = {}
    for kv in (True, False):
        e = ReferenceEngine(cfg, kv_cache=kv)
        assert sync_weights(model, e, version=1).ok
        got[kv] = e.generate(PROMPTS[:2], _params(max_new_tokens=4), n=2, seed=1)
    _same(got[True], got[False])
    assert all(len(x.response_ids) == 4 for grp in got[True] for x in grp)
