"""Benchmark: rollout tokens/s of the reference engine with the KV cache against without it.

    python -m bench.rollout [--device cpu|cuda] [--dtype fp32|bf16] [--model tiny] [--prompts 4] [--n 4]
                            [--prompt-len 16 64] [--new-tokens 32] [--repeats 2] [--out FILE.json]

One engine per row (:class:`train.engines.ReferenceEngine`), random weights (``init_weights``, seeded) loaded
through the engine's weight-update calls, ``--prompts`` random prompts with lengths uniform in
``--prompt-len`` (seeded), ``--n`` samples each, temperature 1, top-p 0.95, no stop token (every sample
generates ``--new-tokens`` tokens, so both rows do the same sampling work):

* ``cached``: ``kv_cache=True``: one prefill of the distinct prompts, then one-token decode steps over all
  samples (``kernels.reference.decode``);
* ``uncached``: ``kv_cache=False``: one prompt's samples at a time, the whole prefix re-run per token (the
  former engine).

Each row times (best of ``--repeats``) one ``generate`` call after a short warm-up call. ``tokens`` counts
generated tokens, ``positions_fed`` the token positions the model processed, ``tokens_per_s = tokens /
seconds``. Both rows sample from the same per-sample streams; ``same_tokens`` says whether they drew the same
tokens here (they can differ where the indexer's top-k has exact score ties, which rows of different lengths
break differently, e.g. the ``tiny`` preset past 32 tokens, or in bf16 where the two paths round differently:
docs/rollout.md#exactness). A table is printed and a JSON object (``date``, ``machine``, the settings and
the rows) is written to ``--out`` (default ``bench/results/rollout-<cpu|gpu name>.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def _engine(config, device, dtype, kv_cache: bool, seed: int):
    from kernels.reference.model import init_weights
    from train.engines import ReferenceEngine

    engine = ReferenceEngine(config, dtype=dtype, device=device, kv_cache=kv_cache)
    init_weights(engine.model, seed)
    engine.begin_update(1)              # the weight-update path, with the engine's own tensors
    engine.load_bucket([(n, t.clone()) for n, t in engine.model.state_dict().items()])
    engine.finish_update()
    return engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(*, model: str = "tiny", device: str = "cpu", dtype: str = "fp32", prompts: int = 4, n: int = 4,
              prompt_len=(16, 64), new_tokens: int = 32, repeats: int = 2, seed: int = 0,
              rows=("cached", "uncached")) -> dict:
    from core.config import preset
    from train.engines import SamplingParams

    config = preset(model)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    lo, hi = prompt_len
    lengths = torch.randint(lo, hi + 1, (prompts,), generator=g).tolist()
    batch = [torch.randint(2, config.vocab_size, (L,), generator=g).tolist() for L in lengths]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new_tokens, stop_token_ids=())
    warm = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=2, stop_token_ids=())
    out_rows, tokens_of = [], {}
    for name in rows:
        engine = _engine(config, dev, DTYPES[dtype], name == "cached", seed)
        engine.generate(batch, warm, n=n, seed=seed)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        best, fed = float("inf"), 0
        for _ in range(repeats):
            engine.positions_fed = 0
            _sync(dev)
            t0 = time.perf_counter()
            groups = engine.generate(batch, params, n=n, seed=seed)
            _sync(dev)
            best = min(best, time.perf_counter() - t0)
            fed = engine.positions_fed
        tokens_of[name] = [s.response_ids for grp in groups for s in grp]
        generated = sum(len(t) for t in tokens_of[name])
        row = dict(engine=name, tokens=generated, positions_fed=fed, seconds=round(best, 4),
                   tokens_per_s=round(generated / best, 1))
        if dev.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 2)
        out_rows.append(row)
        del engine
    same = tokens_of.get("cached") == tokens_of.get("uncached") if len(tokens_of) == 2 else None
    return dict(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=_machine(dev),
                model=model, device=str(dev), dtype=dtype, prompts=prompts, samples_per_prompt=n,
                prompt_lengths=lengths, new_tokens=new_tokens, same_tokens=same, rows=out_rows)


def format_table(result: dict) -> str:
    head = f"{'engine':<10}{'tokens':>8}{'fed':>9}{'seconds':>10}{'tokens/s':>11}"
    lines = [f"{result['model']} on {result['machine']}, {result['dtype']}: {result['prompts']} prompts x "
             f"{result['samples_per_prompt']} samples, {result['new_tokens']} new tokens", head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['engine']:<10}{r['tokens']:>8}{r['positions_fed']:>9}{r['seconds']:>10.3f}"
                     f"{r['tokens_per_s']:>11.1f}")
    by = {r["engine"]: r for r in result["rows"]}
    if "cached" in by and "uncached" in by:
        lines.append(f"cached/uncached speed-up: {by['cached']['tokens_per_s'] / by['uncached']['tokens_per_s']:.2f}x"
                     f" (same tokens: {result['same_tokens']})")
        if result["same_tokens"] is False:
            lines.append("(tokens can differ where the indexer's top-k has exact score ties, which rows of "
                         "different lengths break differently, or in bf16 where rounding flips a draw: "
                         "docs/rollout.md#exactness)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="core.config preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="timed calls per row (the best is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("cached", "uncached"), default=None, help="run one row")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared host)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/rollout-MACHINE.json)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.device.startswith("cuda"):                 # the nvidia target's setting: no TF32 in fp32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    result = run_bench(model=a.model, device=a.device, dtype=dtype, prompts=a.prompts, n=a.n,
                       prompt_len=tuple(a.prompt_len), new_tokens=a.new_tokens, repeats=a.repeats, seed=a.seed,
                       rows=(a.only,) if a.only else ("cached", "uncached"))
    print(format_table(result))
    out = a.out or Path(__file__).parent / "results" / f"rollout-{_short_machine(torch.device(a.device))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
