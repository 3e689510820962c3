"""Benchmark: prefill and decode tokens/s of the reference engine, against transformers' ``generate``.

    python -m bench.rollout [--device cpu|cuda] [--dtype fp32|bf16] [--model tiny|flash-shaped|bench]
                            [--batch 1 4] [--prompt-len 32] [--new-tokens 16] [--rows cached,transformers]
                            [--cuda-graphs on|off] [--compile on|off] [--kernel-backend none|triton|tilelang|cuda]
                            [--prefill-tokens 16384] [--repeats 1] [--profile-steps 0] [--profile-sources]
                            [--top-p 1.0] [--ablate OP ...]
                            [--layers N] [--out FILE.json]

``--model bench`` is the training benchmark's small config (``bench.configs.bench_config``); the others are
``core.config`` presets; ``--layers N`` deepens (or shortens) one to ``N`` trunk layers, repeating its
pattern of attention kinds (what a compile costs against depth, without a full-size model). Random weights (``init_weights``, seeded; on a GPU drawn there, so their values
differ from a CPU run's) are loaded through the engine's weight-update calls; transformers' ``DeepseekV4ForCausalLM`` gets the same tensors through
``tests.reference.hf_mapping.official_to_hf``. For each batch size ``B`` (sequences decoded together): ``B``
random prompts of ``--prompt-len`` tokens (one sample each), temperature 1, top-p ``--top-p`` (default 1.0,
``dsv4 train``'s: a GRPO rollout samples the whole distribution; below 1 the sampler sorts the vocabulary
every step), no stop token, so every sequence generates ``--new-tokens`` tokens. Rows (``--rows``):

* ``cached``: ``ReferenceEngine`` (KV cache, static-slot decode step, CUDA graphs on CUDA unless
  ``--cuda-graphs off``; with ``--compile on`` the step is TorchInductor code, compiled per slot bucket by
  ``engine.reserve`` before the timed calls; at most ``--prefill-tokens`` prompt tokens per prefill forward);
* ``uncached``: ``kv_cache=False``, the whole prefix re-run for every token (slow: small sizes only);
* ``transformers``: ``model.generate(..., use_cache=True, do_sample=True)`` (eager attention, its
  DeepSeek-V4 cache); skipped, with the reason recorded, when transformers lacks the model or fails.

Timing (best of ``--repeats``, ``torch.cuda.synchronize()`` around each call, after a warm-up call; the
engine's slots and graphs are built by ``engine.reserve`` first, its compile time is the row's ``reserve_s``):
``t_prefill`` is a call with one new token
(prefill plus one draw), ``t_full`` one with ``--new-tokens``. prefill tokens/s = ``B x prompt-len /
t_prefill``; total tokens/s = ``B x new-tokens / t_full``. The decode step of the cached rows is the engine's
own clock of the ``t_full`` call (``generate_timing``: its decode steps alone, CUDA events on a GPU; the row's
``decode_clock: "engine"``, with ``decode_step_ms_difference`` beside it); of the other rows ``(t_full -
t_prefill) / (new-tokens - 1)`` (``"difference"``, which carries the prefill call's noise); decode tokens/s
follows. On a GPU, decode's share of HBM bandwidth = ``weight bytes read per decode step / decode step time /
HBM bytes/s`` (4.8e12 B/s, H200; ``--hbm``), with the weight bytes those a step of ``B`` rows needs: every trunk
tensor except the embedding (a row per token), the MTP block (not run) and the routed experts, of which ``k`` per
layer count for one row and the share ``1 - (1 - k/E)^B`` a batch touches in expectation (bench.grpo's bound).
``hbm_share_with_kv`` adds the KV-cache rows the step reads (:func:`kv_bytes_per_step`; issue #32's measure;
about 2% of the weights at 256 Flash-shaped sequences of 256 to 304 positions, under 0.5% at 64). A table is
printed and a JSON object (``date``, ``machine``, settings, rows) is written to ``--out`` (default
``bench/results/rollout-<cpu|gpu name>[-MODEL].json``).

``--profile-steps N`` (cached rows): after the timed calls, two more calls run under ``torch.profiler``, one
with a single new token (prefill and one draw) and one with ``1 + N``; their difference over ``N`` is one
decode step: the kernels a step launches (CUDA; operators on the CPU), its device time, and the kernels that
take most of it (the row's ``profile``). That is where a decode step's time goes when it is far from the
bandwidth its weights need. ``--profile-sources`` adds which lines of the engine's code launched them
(``profile["sources"]``, :mod:`bench.profile_sources`; on CUDA with ``--cuda-graphs off``).

``--ablate OP ...`` (``--rows cached`` with a kernel backend): the cached rows again, once per ``OP`` with that
extra op left out of the table (``core.kernel_ops.OpTable.without``: the step runs the torch code there; the
row's ``without``), so one run times each decode kernel against the code it replaces (the profile is taken
of the full table's first rows only). The full table runs again last (rows ``"again": true``, labelled
``(again)``): the drift between its two runs bounds what an ablated row's difference can say.

With ``DSV4_PDL=1`` in the environment, on a Hopper-class GPU, a kernel backend's decode step launches its triton
kernels dependent on the ones before (``kernels/triton/pdl.py``; opt-in), its projections asking L2 for their
first weight lines while they wait (``DSV4_PDL_PREFETCH=0``: without the prefetch); each cached row's ``note``
says which ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HBM_BYTES_PER_S = {"h200": 4.8e12, "h100": 3.35e12, "b200": 8.0e12}


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} cpu, {os.cpu_count()} cores, " \
           f"{torch.get_num_threads()} torch threads (torch {torch.__version__})"


def _short_machine(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100", "b200", "a100") if k in name), "gpu")


def model_config(name: str, layers=None):
    """The preset ``name`` (or the training benchmark's config), with ``layers`` trunk layers when given: its
    trunk's compress ratios repeated (or cut) to that depth, its MTP layers and hash-routed layers kept."""
    if name == "bench":
        from bench.configs import bench_config

        config = bench_config()
    else:
        from core.config import preset

        config = preset(name)
    if layers is None or layers == config.n_layers:
        return config
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    trunk, mtp = config.compress_ratios[:config.n_layers], config.compress_ratios[config.n_layers:]
    return config.replace(n_layers=layers, compress_ratios=tuple((trunk * layers)[:layers]) + tuple(mtp),
                          n_hash_layers=min(config.n_hash_layers, layers))


def weight_bytes_per_step(model, batch: int = 1) -> int:
    """Bytes of weights one decode step of ``batch`` rows reads at least (module docstring): the routed experts at
    the share a batch touches in expectation, ``1 - (1 - k/E)^batch`` (``k/E`` for one row), the embedding and
    hash tables one row per token (at most all of them)."""
    c = model.config
    touched = 1.0 - (1.0 - c.n_activated_experts / c.n_routed_experts) ** batch
    total = 0.0
    for name, t in model.state_dict().items():
        size = t.numel() * t.element_size()
        if name.startswith("mtp."):
            continue
        if name == "embed.weight" or name.endswith("tid2eid"):
            total += min(batch, t.shape[0]) * t.shape[1] * t.element_size()
        elif ".ffn.experts." in name:
            total += size * touched
        else:
            total += size
    return int(total)


def kv_bytes_per_step(config, batch: int, prompt_len: int, new_tokens: int, elem: int = 2) -> int:
    """KV-cache bytes one decode step of ``batch`` rows reads at least, averaged over the steps of a call that
    feeds ``new_tokens - 1`` tokens after a ``prompt_len`` prompt (step ``i`` attends to ``prompt_len + i + 1``
    positions; :func:`kernels.reference.decode.kv_read_bytes` a row and step, ``elem`` bytes a value). Why: issue
    #32's measure is the step against the weight and KV bytes it reads; at 256 Flash-shaped sequences of 256 to 304
    positions the KV rows are about 2% of the weights, at long contexts most of the bytes."""
    from kernels.reference.decode import kv_read_bytes

    steps = max(new_tokens - 1, 1)
    total = sum(kv_read_bytes(config, prompt_len + i + 1, elem) for i in range(steps))
    return int(batch * total / steps)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads for one token: :func:`weight_bytes_per_step` at batch 1."""
    return weight_bytes_per_step(model, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def profile_decode(generate, device: torch.device, steps: int, top: int = 40, sources: bool = False) -> dict:
    """One decode step's kernels (CUDA) or operators (CPU, self time): ``generate(new_tokens)`` runs under
    ``torch.profiler`` with 1 and with ``1 + steps`` new tokens, and the difference is divided by ``steps``
    (prefill and the first draw cancel). Returns counts per step, device (CPU) ms per step and the ``top``
    names by time; under ``prefill``, the same of the call with one new token (the prefill, its cache copies
    and the first draw: where a rollout's prefill time goes). ``sources``: also the step's kernels (CUDA) or
    operators (CPU) by the line of the engine's code that launched them (:mod:`bench.profile_sources`; the
    row's ``profile["sources"]``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_sources import by_call_site, is_python_frame, per_step

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sites = []                                  # with sources: each call's kernels by call site

    def totals(new_tokens: int) -> dict:
        with profile(activities=activities, with_stack=sources) as prof:
            generate(new_tokens)
            _sync(device)
        if sources:
            sites.append(by_call_site(prof.events(), cuda))
        got = {}
        for e in prof.key_averages():
            if cuda and e.device_type != DeviceType.CUDA:
                continue
            if sources and is_python_frame(e.key):
                continue                                  # the Python frames with_stack adds (CPU)
            got[e.key] = (e.count, e.self_device_time_total if cuda else e.self_cpu_time_total)
        return got

    base, full = totals(1), totals(1 + steps)
    per = {}
    for name, (count, us) in full.items():
        c0, t0 = base.get(name, (0, 0.0))
        if count > c0:
            per[name] = ((count - c0) / steps, max(us - t0, 0.0) / steps)
    what = "kernels" if cuda else "operators"

    def summary(by_name, suffix):
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
        return {f"{what}{suffix}": round(sum(c for c, _ in by_name.values()), 1),
                f"ms{suffix}": round(sum(t for _, t in by_name.values()) / 1e3, 4),
                "top": [dict(name=n[:120], calls=round(c, 2), us=round(t, 2)) for n, (c, t) in ranked[:top]]}

    out = {**summary(per, "_per_step"), "prefill": summary(base, "")}
    if sources:
        out["sources"] = per_step(sites[0], sites[1], steps)     # every site (a step's time there is noisy)
    return out


def _engine(config, device, dtype, seed, **kw):
    from kernels.reference.model import init_weights
    from rollout.reference_engine import ReferenceEngine

    engine = ReferenceEngine(config, dtype=dtype, device=device, **kw)
    init_weights(engine.model, seed, draw_on_device=True)   # on a GPU: drawn there (seconds, not minutes)
    engine.begin_update(1)              # the weight-update path, with the engine's own tensors
    engine.load_bucket([(n, t.clone()) for n, t in engine.model.state_dict().items()])
    engine.finish_update()
    return engine


def _dependent_launches_note(dev: torch.device, kernel_backend: str) -> str:
    """``"; dependent launches on (weights' prefetch on)"`` (or ``off``) / ``"; dependent launches off"`` where a GPU
    kernel backend's decode step could launch its triton kernels with PDL (``kernels/triton/pdl.py``: a Hopper-class
    GPU, ``DSV4_PDL=1``; the prefetch: ``DSV4_PDL_PREFETCH`` not 0), else nothing: a row's record says which it
    timed."""
    if dev.type != "cuda" or kernel_backend == "none":
        return ""
    from kernels.gpu_common import dependent_launches
    from kernels.triton import pdl

    with dependent_launches():
        if not pdl.enabled(dev):
            return "; dependent launches off"
        return f"; dependent launches on (weights' prefetch {'on' if pdl.prefetching(dev) else 'off'})"


def _ops(config, device, kernel_backend: str, without=()):
    """The kernel op table of a run with ``kernel_backend`` on this device (``core.assembly``), as ``dsv4
    train`` hands it to its engine, less the extra ops ``without`` (``--ablate``); the engine records which
    backend served each decode op."""
    from bench.configs import bench_run_config
    from core.assembly import assemble

    hardware = "nvidia" if device.type == "cuda" else "cpu"
    ops = assemble(bench_run_config("miles", config, hardware=hardware, kernels=kernel_backend)).ops
    return ops.without(without) if without else ops


def _transformers_model(config, weights, device, dtype):
    """``(DeepseekV4ForCausalLM holding `weights`, note)``, or raises with the reason it cannot run."""
    import transformers
    from transformers import DeepseekV4ForCausalLM
    from transformers.initialization import no_init_weights

    from tests.reference.hf_mapping import hf_config_from, official_to_hf

    with no_init_weights():     # every parameter is loaded below (checked): no random init to throw away
        m = DeepseekV4ForCausalLM._from_config(hf_config_from(config), attn_implementation="eager", dtype=dtype)
    missing, unexpected = m.load_state_dict(official_to_hf(weights), strict=False)
    params = {n for n, _ in m.named_parameters()}
    if unexpected or params & set(missing):
        raise RuntimeError(f"weights do not map onto transformers' model: missing {sorted(params & set(missing))[:4]}, "
                           f"unexpected {unexpected[:4]}")
    return m.to(device).eval(), f"transformers {transformers.__version__}, attn eager, cache on"


def _transformers_generate(config, weights, device, dtype, top_p: float = 1.0):
    """``(generate(ids, new_tokens) -> [B, new_tokens] ids, note)``, or raises with the reason it cannot run."""
    m, note = _transformers_model(config, weights, device, dtype)

    @torch.no_grad()
    def generate(ids, new_tokens):
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=top_p, top_k=0,
                         use_cache=True, pad_token_id=0)
        return out[:, ids.shape[1]:]

    return generate, note


def _row(name, B, P, T, t_pre, t_full, generated, extra, clocked=None):
    """A row's speeds. ``clocked``: the engine's own decode time of the timed call (``generate_timing``: its
    decode steps alone, device time on a GPU): the decode step and decode tokens/s come from it
    (``decode_clock: "engine"``); without it, from ``t_full - t_pre`` (``"difference"``), which carries both
    calls' noise, the prefill's most: one H100 run timed one sequence's step at 1.367 to 1.945 ms across tables
    whose prefill throughput varied from 4,662 to 7,668 tokens/s, the step shortest where the prefill call was
    slowest (bench/results/rollout-h100-flash-shaped-triton-ablate-linear-group.json)."""
    dec = max(t_full - t_pre, 1e-9)
    steps = max(T - 1, 1)
    row = dict(engine=name, batch=B, prompt_len=P, new_tokens=T, tokens=generated, prefill_s=round(t_pre, 4),
               total_s=round(t_full, 4), prefill_tokens_per_s=round(B * P / t_pre, 1),
               decode_tokens_per_s=round(B * (T - 1) / dec, 1) if T > 1 else None,
               tokens_per_s=round(generated / t_full, 1), decode_step_ms=round(dec / steps * 1e3, 3),
               decode_clock="difference")
    if clocked and clocked.get("decode_steps"):
        step_s = clocked["decode_s"] / clocked["decode_steps"]
        row.update(decode_step_ms_difference=row["decode_step_ms"], decode_step_ms=round(step_s * 1e3, 3),
                   decode_tokens_per_s=round(clocked["decode_rows"] / clocked["decode_s"], 1), decode_clock="engine")
    row.update(extra)
    return row


def run_bench(*, model: str = "tiny", device: str = "cpu", dtype: str = "fp32", batch=(1, 4), prompt_len=(32,),
              new_tokens: int = 16, repeats: int = 1, seed: int = 0, rows=("cached", "transformers"),
              cuda_graphs=None, prefill_tokens: int = 16384, hbm=None, kernel_backend: str = "none",
              compile=False, on_row=None, profile_steps: int = 0, top_p: float = 1.0, layers=None,
              profile_sources: bool = False, without=()) -> dict:
    """``kernel_backend``: the op table the engine computes with (the run's ``--kernel-backend``: ``none`` =
    the reference ops; ``triton`` / ``tilelang`` / ``cuda`` need a CUDA device and bf16), built by the assembly step.
    ``compile``: the cached engine's ``compile`` option (True: Inductor; a backend name). ``on_row``: called
    with the result so far after every row (``main`` writes it, so a run stopped by a time limit keeps the rows
    it measured). ``profile_steps``: > 0 profiles that many decode steps of each cached row
    (:func:`profile_decode`, the row's ``profile``). ``without``: extra ops left out of the table (the rows'
    ``without``; ``main``'s ``--ablate``)."""
    from rollout.reference_engine import SamplingParams

    config = model_config(model, layers)
    dev = torch.device(device)
    lo, hi = (prompt_len[0], prompt_len[-1])
    params = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=new_tokens, stop_token_ids=())
    one = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=1, stop_token_ids=())
    hbm = hbm or (HBM_BYTES_PER_S.get(_short_machine(dev)) if dev.type == "cuda" else None)
    out_rows, weights, wbytes = [], None, None

    def result() -> dict:
        base = {r["batch"]: r for r in out_rows if r["engine"] == "transformers" and "skipped" not in r}
        for r in out_rows:
            if r["engine"] == "cached" and r.get("batch") in base:
                r["speedup_vs_transformers"] = round(r["tokens_per_s"] / base[r["batch"]]["tokens_per_s"], 2)
        return dict(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=_machine(dev),
                    model=model, n_layers=config.n_layers, top_p=top_p, device=str(dev), dtype=dtype, batch=list(batch), prompt_len=list(prompt_len),
                    new_tokens=new_tokens, kernel_backend=kernel_backend, hbm_bytes_per_s=hbm,
                    weight_bytes_per_token=wbytes, rows=out_rows)

    def add(row: dict) -> None:
        out_rows.append(row)
        if on_row is not None:
            on_row(result())

    for name in rows:
        if name == "transformers":
            try:
                gen, note = _transformers_generate(config, weights or _engine(config, "cpu", DTYPES[dtype],
                                                                               seed).model.state_dict(),
                                                   dev, DTYPES[dtype], top_p)
            except Exception as e:          # recorded in the row: the table says why there is no number
                add(dict(engine=name, skipped=f"{type(e).__name__}: {e}"[:300]))
                continue
        else:
            kw = dict(kv_cache=name == "cached", ops=_ops(config, dev, kernel_backend, without))
            if name == "cached":
                kw.update(cuda_graphs=cuda_graphs, prefill_batch=max(1, prefill_tokens // hi), compile=compile)
            engine = _engine(config, dev, DTYPES[dtype], seed, **kw)
            weights = weights or {n: t.detach().cpu() for n, t in engine.model.state_dict().items()}
            wbytes = wbytes or weight_bytes_per_token(engine.model)
            note = (f"cuda graphs {'on' if engine.cuda_graphs else 'off'}; compile "
                    f"{engine.compile or 'off'}" if name == "cached" else "no cache")
            note += f"; kernels {kernel_backend}" + _dependent_launches_note(dev, kernel_backend)
        for B in batch:
            g = torch.Generator().manual_seed(seed + B)
            lengths = torch.randint(lo, hi + 1, (B,), generator=g).tolist()
            prompts = [torch.randint(2, config.vocab_size, (L,), generator=g).tolist() for L in lengths]
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            try:
                if name == "transformers":
                    if lo != hi:
                        raise ValueError("the transformers row takes one prompt length (its batch is not padded)")
                    ids = torch.tensor(prompts, device=dev)
                    gen(ids, 2)
                    t_pre, _ = _timed(lambda: gen(ids, 1), dev, repeats)
                    t_full, got = _timed(lambda: gen(ids, new_tokens), dev, repeats)
                    generated, extra, clocked = int(got.numel()), dict(note=note), None    # timed from outside
                else:
                    reserve_s = None
                    if name == "cached":
                        reserve_s, _ = _timed(lambda: engine.reserve(B, hi + new_tokens - 1), dev, 1)
                    engine.generate(prompts, one, n=1, seed=seed)
                    t_pre, _ = _timed(lambda: engine.generate(prompts, one, n=1, seed=seed), dev, repeats)
                    engine.positions_fed = 0
                    clocks = []

                    def full(prompts=prompts, clocks=clocks):
                        out = engine.generate(prompts, params, n=1, seed=seed)
                        clocks.append(engine.generate_timing())     # None for the uncached engine
                        return out

                    t_full, groups = _timed(full, dev, repeats)
                    clocked = [c for c in clocks if c and c.get("decode_steps")]
                    clocked = min(clocked, key=lambda c: c["decode_s"] / c["decode_steps"]) if clocked else None
                    generated = sum(len(s.response_ids) for grp in groups for s in grp)
                    extra = dict(note=note, positions_fed=engine.positions_fed // repeats,
                                 # which backend served each op of the step and the sampler (the record says
                                 # which kernels it timed)
                                 decode_ops=dict(engine.decode_ops), sample_ops=dict(engine.sample_ops))
                    if clocked:                           # each timed call's step (a slow first one shows here)
                        extra["decode_step_ms_each"] = [round(1e3 * c["decode_s"] / c["decode_steps"], 3)
                                                        for c in clocks if c and c.get("decode_steps")]
                    if reserve_s is not None:             # slots, graph captures and compiles of this batch
                        extra["reserve_s"] = round(reserve_s, 2)
                    if profile_steps > 0 and name == "cached":
                        def gen_n(k, prompts=prompts):
                            return engine.generate(prompts, dataclasses.replace(params, max_new_tokens=k), n=1,
                                                   seed=seed)
                        extra["profile"] = profile_decode(gen_n, dev, profile_steps, sources=profile_sources)
            except torch.cuda.OutOfMemoryError as e:
                add(dict(engine=name, batch=B, skipped=f"out of memory: {str(e)[:200]}"))
                torch.cuda.empty_cache()
                continue
            row = _row(name, B, hi, new_tokens, t_pre, t_full, generated, extra, clocked)
            if without:
                row["without"] = sorted(without)
            if hbm and new_tokens > 1 and name != "transformers":
                row["weight_bytes_per_step"] = step_bytes = weight_bytes_per_step(engine.model, B)
                # None when the decode time did not show above the timer's noise (a tiny model on a busy CPU)
                step_s = row["decode_step_ms"] / 1e3
                row["hbm_share"] = round(step_bytes / step_s / hbm, 4) if step_s > 0 else None
                # the cache holds the run's dtype (the model keeps some parameters, mHC's among them, in fp32)
                row["kv_bytes_per_step"] = kv = kv_bytes_per_step(config, B, hi, new_tokens, DTYPES[dtype].itemsize)
                row["hbm_share_with_kv"] = round((step_bytes + kv) / step_s / hbm, 4) if step_s > 0 else None
            if dev.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 2)
            add(row)
        engine = gen = None
    return result()


def format_table(result: dict) -> str:
    labels = [r["engine"] + "".join(f" -{op}" for op in r.get("without", ())) + (" (again)" if r.get("again") else "")
              for r in result["rows"]]
    w = max([13] + [len(x) + 2 for x in labels])
    head = (f"{'engine':<{w}}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'total tok/s':>13}"
            f"{'step ms':>10}{'HBM share':>11}{'with KV':>9}{'vs HF':>8}")
    lines = [f"{result['model']} on {result['machine']}, {result['dtype']}: prompt {result['prompt_len']} + "
             f"{result['new_tokens']} new tokens", head, "-" * len(head)]
    for r, label in zip(result["rows"], labels):
        if "skipped" in r:
            lines.append(f"{label:<{w}}{r.get('batch', ''):>6}  skipped: {r['skipped']}")
            continue
        share = f"{r['hbm_share']:.1%}" if r.get("hbm_share") is not None else "-"
        share_kv = f"{r['hbm_share_with_kv']:.1%}" if r.get("hbm_share_with_kv") is not None else "-"
        vs = f"{r['speedup_vs_transformers']:.1f}x" if "speedup_vs_transformers" in r else "-"
        dec = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] is not None else "-"
        lines.append(f"{label:<{w}}{r['batch']:>6}{r['prefill_tokens_per_s']:>15.1f}{dec:>14}"
                     f"{r['tokens_per_s']:>13.1f}{r['decode_step_ms']:>10.2f}{share:>11}{share_kv:>9}{vs:>8}")
    for r in result["rows"]:
        prof = r.get("profile")
        if prof:
            count = next(v for k, v in prof.items() if k.endswith("_per_step"))
            lines.append(f"decode step at batch {r['batch']}: {count} launches, {prof['ms_per_step']} ms; costliest:")
            lines += [f"  {t['us']:>9.1f} us {t['calls']:>6} x  {t['name']}" for t in prof["top"][:10]]
            if prof.get("sources"):
                lines.append(f"decode step at batch {r['batch']} by call site:")
                lines += [f"  {t['us']:>9.1f} us {t['calls']:>6} x  {t['site']}" for t in prof["sources"][:25]]
            pre = prof["prefill"]
            count = next(v for k, v in pre.items() if k in ("kernels", "operators"))
            lines.append(f"prefill and first draw at batch {r['batch']}: {count} launches, {pre['ms']} ms; costliest:")
            lines += [f"  {t['us']:>9.1f} us {t['calls']:>6} x  {t['name']}" for t in pre["top"][:10]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="core.config preset, or 'bench' (bench.configs.bench_config)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences decoded together (one row each)")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[32], metavar="LEN",
                   help="prompt length, or MIN MAX (uniform; not for the transformers row)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rows", default="cached,transformers", help="comma list of cached, uncached, transformers")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default=None, help="default: on for cuda")
    p.add_argument("--compile", choices=("on", "off"), default="off",
                   help="cached row: run the decode step as torch.compile (Inductor) code, compiled per slot bucket")
    p.add_argument("--kernel-backend", choices=("none", "triton", "tilelang", "cuda"), default="none",
                   help="the op table the engine computes with (none: the reference ops; cuda: the CUDA "
                        "attention forward, the triton kernels for the rest)")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="prompt tokens per prefill forward (at most)")
    p.add_argument("--hbm", type=float, default=None, help="HBM bytes/s (default: 4.8e12 on an H200)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per number (the best is kept)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="cached rows: profile this many decode steps (kernels per step, the costliest ones)")
    p.add_argument("--profile-sources", action="store_true",
                   help="with --profile-steps: also the kernels by the line of engine code that launched them "
                        "(CUDA: needs --cuda-graphs off)")
    p.add_argument("--ablate", nargs="+", default=[], metavar="OP",
                   help="cached rows again with each of these extra ops left out of the table (the torch code "
                        "runs instead): which kernel is worth its place, timed in one run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: dsv4 train's default)")
    p.add_argument("--layers", type=int, default=None, help="trunk layers (default: the preset's)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared host)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/rollout-MACHINE.json)")
    a = p.parse_args(argv)
    rows = tuple(r.strip() for r in a.rows.split(",") if r.strip())
    bad = sorted(set(rows) - {"cached", "uncached", "transformers"})
    if bad or len(a.prompt_len) > 2:
        p.error(f"--rows takes cached, uncached, transformers (got {bad}); --prompt-len takes LEN or MIN MAX")
    if a.profile_sources and (a.profile_steps <= 0 or (a.device.startswith("cuda") and a.cuda_graphs != "off")):
        p.error("--profile-sources needs --profile-steps N and, on CUDA, --cuda-graphs off (a graph's replay "
                "launches its kernels without the code that recorded them)")
    torch.set_num_threads(a.threads)
    if a.device.startswith("cuda"):                 # the nvidia target's setting: no TF32 in fp32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    graphs = None if a.cuda_graphs is None else a.cuda_graphs == "on"
    machine = _short_machine(torch.device(a.device))
    name = f"{'' if a.model == 'tiny' else '-' + a.model}{'' if a.layers is None else f'-{a.layers}layers'}"
    out = a.out or Path(__file__).parent / "results" / f"rollout-{machine}{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(result: dict) -> None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)

    def row_done(result: dict) -> None:
        write(result)
        last = result["rows"][-1]
        print(f"{last['engine']} batch {last.get('batch')}: "
              f"{last.get('skipped') or str(last.get('tokens_per_s')) + ' tokens/s'} (in {out})", flush=True)

    if a.ablate and (rows != ("cached",) or a.kernel_backend == "none"):
        p.error("--ablate times the cached rows of a kernel backend: pass --rows cached and --kernel-backend")
    done: list = []
    # with --ablate, the full table runs first and again last: the two rows' difference is the machine's drift
    # over the run, below which an ablated row's difference says nothing. One H100 run timed the first row of
    # one sequence at 1.367 ms and every ablated row at 1.75-1.95:
    # bench/results/rollout-h100-flash-shaped-triton-ablate-linear-group.json
    variants = [()] + [(op,) for op in a.ablate] + ([()] if a.ablate else [])

    for i, without in enumerate(variants):
        again = i > 0 and not without

        def marked(rows: list, again=again) -> list:
            return [{**r, "again": True} for r in rows] if again else rows

        def variant_done(result: dict) -> None:
            row_done({**result, "rows": done + marked(result["rows"])})

        result = run_bench(model=a.model, device=a.device, dtype=dtype, batch=tuple(a.batch),
                           prompt_len=tuple(a.prompt_len), new_tokens=a.new_tokens, repeats=a.repeats, seed=a.seed,
                           rows=rows, cuda_graphs=graphs, prefill_tokens=a.prefill_tokens, hbm=a.hbm,
                           kernel_backend=a.kernel_backend, compile=a.compile == "on", on_row=variant_done,
                           profile_steps=0 if without or again else a.profile_steps, top_p=a.top_p,
                           layers=a.layers, profile_sources=a.profile_sources, without=without)
        done += marked(result["rows"])
    result["rows"] = done
    print(format_table(result))
    write(result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
