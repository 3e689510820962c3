"""``bench.rollout`` on the CPU: a small run gives every row its numbers, and the table and the weight-byte
count follow their definitions (the H200 numbers are in docs/rollout.md); ``--compile on|off`` reaches the
engine and each cached row's note; ``--ablate`` times each extra op left out."""

from __future__ import annotations

import json

import pytest
import torch


def test_a_small_rollout_bench_runs_and_counts_what_it_says():
    from bench.rollout import format_table, kv_bytes_per_step, run_bench, weight_bytes_per_step, weight_bytes_per_token
    from core.config import preset
    from kernels.reference.model import DeepseekV4Model

    torch.set_num_threads(1)
    res = run_bench(model="tiny", batch=(1, 2), prompt_len=(12,), new_tokens=4, rows=("cached", "uncached"),
                    hbm=1e12)
    rows = {(r["engine"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {("cached", 1), ("cached", 2), ("uncached", 1), ("uncached", 2)}
    for (name, B), r in rows.items():
        assert r["tokens"] == B * 4 and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert "hbm_share" in r and r["weight_bytes_per_step"] > 0
    assert rows[("cached", 2)]["positions_fed"] == 2 * 12 + 2 * 3          # prompts once, then one token a step
    assert rows[("cached", 1)]["note"] == "cuda graphs off; compile off; kernels none"
    assert rows[("cached", 1)]["reserve_s"] >= 0 and "reserve_s" not in rows[("uncached", 1)]
    assert "decode tok/s" in format_table(res)
    for B in (1, 2):       # the cached engine's step by its own clock, within the timed call; the uncached by difference
        r = rows[("cached", B)]
        assert r["decode_clock"] == "engine" and r["decode_step_ms_difference"] > 0
        assert min(r["decode_step_ms_each"]) == pytest.approx(r["decode_step_ms"], abs=2e-3)
        assert 0 < r["decode_step_ms"] * 3 <= r["total_s"] * 1e3
        assert r["hbm_share"] == pytest.approx(r["weight_bytes_per_step"] / (r["decode_step_ms"] / 1e3) / 1e12,
                                               abs=1e-4)
        assert rows[("uncached", B)]["decode_clock"] == "difference"
        assert r["hbm_share_with_kv"] == pytest.approx((r["weight_bytes_per_step"] + r["kv_bytes_per_step"])
                                                       / (r["decode_step_ms"] / 1e3) / 1e12, abs=1e-4)
        assert r["kv_bytes_per_step"] == kv_bytes_per_step(preset("tiny"), B, 12, 4, 4)    # the fp32 cache

    c = preset("tiny")
    m = DeepseekV4Model(c, device="meta")
    per_expert = 3 * c.dim * c.moe_inter_dim * 4
    dense = sum(t.numel() * 4 for n, t in m.state_dict().items()
                if not n.startswith("mtp.") and ".experts." not in n and n != "embed.weight"
                and not n.endswith("tid2eid"))
    want = dense + c.n_layers * c.n_activated_experts * per_expert + c.dim * 4 + c.n_hash_layers * c.n_activated_experts * 8
    assert weight_bytes_per_token(m) == want
    # a batch touches each routed expert with probability 1 - (1 - k/E)^B, and reads an embedding row per token
    experts = c.n_layers * c.n_routed_experts * per_expert
    for B in (2, 64):
        touched = 1 - (1 - c.n_activated_experts / c.n_routed_experts) ** B
        rows_read = B * (c.dim * 4 + c.n_hash_layers * c.n_activated_experts * 8)
        assert weight_bytes_per_step(m, B) == pytest.approx(dense + touched * experts + rows_read, abs=1)
    assert rows[("cached", 2)]["weight_bytes_per_step"] == weight_bytes_per_step(m, 2)     # the fp32 engine's bytes


def test_the_kv_bytes_a_step_reads_are_counted_layer_by_layer():
    """Window rows up to the window, a CSA layer's indexer top-k of its entries and all its index keys, an HCA
    layer's entries, averaged over the call's decode steps; counted by hand for a window, a CSA (ratio 4) and an
    HCA (ratio 8) layer, window 4, index top-2, a 6-token prompt and 3 new tokens (steps at 7 and 8 positions)."""
    from bench.rollout import kv_bytes_per_step
    from core.config import preset
    from kernels.reference.decode import kv_read_bytes

    c = preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 8, 0), window_size=4, index_topk=2,
                               n_hash_layers=1)
    D, Di = c.head_dim, c.index_head_dim
    at7 = 4 * D + (4 * D + 1 * D + 1 * Di) + (4 * D + 0)
    at8 = 4 * D + (4 * D + 2 * D + 2 * Di) + (4 * D + 1 * D)
    assert kv_bytes_per_step(c, 3, 6, 3, 2) == 3 * 2 * (at7 + at8) // 2
    assert kv_bytes_per_step(c, 1, 6, 2, 2) == 2 * at7
    assert kv_read_bytes(c, 8, 4) == 4 * at8                 # a row's step, as the rollout engine counts it


def test_the_compile_flag_reaches_the_engine(monkeypatch):
    """``--compile on`` -> ``run_bench(compile=True)`` -> ``ReferenceEngine(compile=True)`` (stopped there: the
    Inductor compile is for the GPU run)."""
    from bench import rollout
    from rollout import reference_engine as engines

    seen = []

    class Stop(Exception):
        pass

    def engine(config, **kw):
        seen.append(kw.get("compile"))
        raise Stop

    monkeypatch.setattr(engines, "ReferenceEngine", engine)
    for flag, want in (("on", True), ("off", False)):
        with pytest.raises(Stop):
            rollout.main(["--device", "cpu", "--rows", "cached", "--compile", flag])
    assert seen == [True, False]


def test_layers_and_top_p_reach_the_engine(monkeypatch):
    """``--layers 8`` builds the preset eight trunk layers deep, its attention kinds repeated and its hash
    layers kept; ``--top-p`` (default 1.0, ``dsv4 train``'s) is the sampling the timed calls use."""
    from bench import rollout
    from rollout import reference_engine as engines

    tiny = rollout.model_config("tiny")
    deep = rollout.model_config("tiny", 8)
    assert deep.n_layers == 8 and deep.n_hash_layers == tiny.n_hash_layers
    assert deep.compress_ratios == tiny.compress_ratios[:4] * 2 + tiny.compress_ratios[4:]
    assert rollout.model_config("tiny", 4) == tiny
    seen = []

    class Stop(Exception):
        pass

    real = engines.ReferenceEngine

    def engine(config, **kw):
        e = real(config, **kw)

        def generate(prompts, params, **k):
            seen.append((config.n_layers, params.top_p))
            raise Stop
        e.generate = generate
        return e

    monkeypatch.setattr(engines, "ReferenceEngine", engine)
    for argv, want in (([], (4, 1.0)), (["--layers", "6", "--top-p", "0.9"], (6, 0.9))):
        with pytest.raises(Stop):
            rollout.main(["--device", "cpu", "--rows", "cached", "--batch", "1", *argv])
        assert seen[-1] == want


def test_the_transformers_row_loads_every_weight_without_a_random_init():
    """The transformers row builds its model under ``no_init_weights`` (the Flash-shaped preset's random init
    took minutes of one CPU core) and loads the engine's weights into every parameter: its greedy tokens are
    the engine's (top-k 1), which an unloaded parameter holding uninitialised memory would change."""
    import torch

    from bench import rollout
    from rollout.reference_engine import SamplingParams

    config = rollout.model_config("tiny")
    engine = rollout._engine(config, torch.device("cpu"), torch.float32, 0, kv_cache=True)
    weights = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
    model, note = rollout._transformers_model(config, weights, torch.device("cpu"), torch.float32)
    assert note.startswith("transformers ")
    prompt = list(range(5, 17))
    greedy = SamplingParams(top_k=1, max_new_tokens=4, stop_token_ids=())
    ours = engine.generate([prompt], greedy, n=1, seed=0)[0][0].response_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                min_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)[0, 12:]
    assert theirs.tolist() == list(ours)


def test_each_row_is_written_as_it_is_measured(tmp_path, monkeypatch):
    """A run stopped by a time limit keeps what it measured: the JSON holds every finished row (here the
    process is 'stopped' as the second row starts)."""
    import json

    from bench import rollout

    class Stop(Exception):
        pass

    real = rollout._engine
    calls = []

    def engine(*args, **kw):
        calls.append(kw.get("kv_cache"))
        if len(calls) == 2:
            raise Stop
        return real(*args, **kw)

    monkeypatch.setattr(rollout, "_engine", engine)
    out = tmp_path / "r.json"
    with pytest.raises(Stop):
        rollout.main(["--device", "cpu", "--model", "tiny", "--rows", "cached,uncached", "--batch", "1", "2",
                      "--prompt-len", "8", "--new-tokens", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [("cached", 1), ("cached", 2)]


def test_the_decode_profile_counts_one_step():
    """``--profile-steps``: the difference of two profiled calls (1 and 1 + N new tokens) over N is one decode
    step; on the CPU it counts operators. The tiny model's step runs a matmul per layer and more, never a
    fraction of the prefill's work, and one more step counts the same again."""
    from bench.rollout import format_table, run_bench

    torch.set_num_threads(1)
    res = run_bench(model="tiny", batch=(1,), prompt_len=(12,), new_tokens=3, rows=("cached",), profile_steps=2)
    prof = res["rows"][0]["profile"]
    assert prof["operators_per_step"] > 10 and prof["ms_per_step"] > 0
    names = {t["name"] for t in prof["top"]}
    assert names & {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}, names
    assert all(t["calls"] > 0 and t["us"] >= 0 for t in prof["top"])
    assert res["rows"][0]["decode_ops"]["rms_norm"] == "none" and res["rows"][0]["sample_ops"] == {}
    pre = prof["prefill"]                 # the call with one new token: the prefill's work, more than a step's
    assert pre["operators"] > prof["operators_per_step"] and pre["ms"] > 0 and pre["top"]
    again = run_bench(model="tiny", batch=(1,), prompt_len=(12,), new_tokens=3, rows=("cached",),
                      profile_steps=4)["rows"][0]["profile"]
    assert again["operators_per_step"] == pytest.approx(prof["operators_per_step"], rel=0.25)
    assert "decode step at batch 1" in format_table(res)


def test_the_profile_by_call_site_names_the_engines_functions():
    """``--profile-sources`` on the CPU: a tiny engine's decode steps by the function of the engine's code that
    ran each top-level operator. The mHC split, the attention and the compressor's pooling are among them, and
    the sites' operators per step are those of the by-name profile (the same operators, grouped another way; its
    count also holds the nested ones, so it is the larger)."""
    from bench.rollout import run_bench

    torch.set_num_threads(1)
    res = run_bench(model="tiny", batch=(2,), prompt_len=(8,), new_tokens=4, rows=("cached",), profile_steps=2,
                    profile_sources=True)
    prof = res["rows"][0]["profile"]
    sites = {r["site"].split(" ")[-1]: r for r in prof["sources"]}
    assert {"hc_split", "sparse_attention_with_sink", "pool_slots"} <= set(sites), sorted(sites)
    assert all(r["site"].split(":")[0].startswith(("kernels/", "rollout/", "engine/", "core/", "backends/"))
               for r in prof["sources"])
    assert 0 < sum(r["calls"] for r in prof["sources"]) <= prof["operators_per_step"]
    assert not any(t["name"].startswith("<built-in") or ".py(" in t["name"] for t in prof["top"])


def test_profile_sources_needs_eager_launches_on_cuda(capsys):
    """On CUDA a graph's replay launches its kernels without the code that recorded them: ``--profile-sources``
    without ``--cuda-graphs off`` is refused with the fix, as is one without ``--profile-steps``."""
    from bench.rollout import main

    for argv in (["--device", "cuda", "--profile-steps", "2", "--profile-sources"], ["--profile-sources"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--cuda-graphs off" in capsys.readouterr().err


def test_ablate_times_each_extra_op_left_out(tmp_path, monkeypatch, capsys):
    """``--ablate OP``: the cached rows with the full table, then again with ``OP`` left out
    (``OpTable.without``): that row's step no longer calls it (``decode_ops``), says so (``without``) and draws
    the same tokens (the op's torch contract is the code it replaces); last the full table again (``again``,
    ``(again)``: the run's drift). A required op cannot be left out; the flag needs the cached rows of a kernel
    backend."""
    from bench import rollout
    from core.kernel_ops import OpTable
    from kernels.reference.backend import reference_functions
    from kernels.reference.linear_group import linear_group

    torch.set_num_threads(1)
    table = OpTable("fake", {**reference_functions(), "linear_group": linear_group})
    with pytest.raises(ValueError, match="cannot leave out hc_pre"):
        table.without(["hc_pre"])
    monkeypatch.setattr(rollout, "_ops", lambda config, dev, backend, without=(): table.without(without))
    out = tmp_path / "ablate.json"
    assert rollout.main(["--device", "cpu", "--model", "tiny", "--batch", "2", "--prompt-len", "8",
                         "--new-tokens", "4", "--rows", "cached", "--kernel-backend", "triton",
                         "--ablate", "linear_group", "--out", str(out)]) == 0
    full, less, again = json.loads(out.read_text())["rows"]
    assert "without" not in full and full["decode_ops"]["linear_group"] == "fake" and "again" not in full
    assert less["without"] == ["linear_group"] and "linear_group" not in less["decode_ops"] and "again" not in less
    assert again["again"] is True and "without" not in again and again["decode_ops"] == full["decode_ops"]
    assert full["positions_fed"] == less["positions_fed"] == again["positions_fed"]
    printed = capsys.readouterr().out
    assert "cached -linear_group" in printed and "cached (again)" in printed
    with pytest.raises(SystemExit):
        rollout.main(["--device", "cpu", "--rows", "cached", "--ablate", "linear_group"])
    assert "--ablate times the cached rows of a kernel backend" in capsys.readouterr().err


def test_a_row_takes_the_engines_decode_clock_over_the_difference_of_two_calls():
    """``_row``: the decode step from the engine's clock (20 steps of 4 rows in 50 ms: 2.5 ms, 1,600 tokens/s) where
    the calls' difference says otherwise (a prefill call timed 30 ms slow); the difference kept beside it."""
    from bench.rollout import _row

    clocked = dict(prefill_s=0.05, decode_s=0.05, decode_steps=20, decode_rows=80)
    r = _row("cached", 4, 16, 21, t_pre=0.08, t_full=0.10, generated=84, extra={}, clocked=clocked)
    assert r["decode_clock"] == "engine" and r["decode_step_ms"] == 2.5 and r["decode_tokens_per_s"] == 1600.0
    assert r["decode_step_ms_difference"] == 1.0
    r = _row("cached", 4, 16, 21, t_pre=0.08, t_full=0.10, generated=84, extra={})
    assert r["decode_clock"] == "difference" and r["decode_step_ms"] == 1.0 and r["decode_tokens_per_s"] == 4000.0


def test_the_transformers_row_after_an_engine_row_is_timed_by_difference():
    """The engine's clock belongs to the engine's rows: a transformers row run after a cached one takes the
    difference of its own two calls, not the cached row's clock."""
    from bench.rollout import run_bench

    torch.set_num_threads(1)
    res = run_bench(model="tiny", batch=(1,), prompt_len=(8,), new_tokens=3, rows=("cached", "transformers"))
    rows = {r["engine"]: r for r in res["rows"]}
    assert rows["cached"]["decode_clock"] == "engine"
    if "skipped" not in rows["transformers"]:
        assert rows["transformers"]["decode_clock"] == "difference"
        assert "decode_step_ms_difference" not in rows["transformers"]
