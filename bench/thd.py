"""Benchmark: packed sequences (THD) against padded batches (BSHD) on the same sample lengths (CPU).

    python -m bench.thd --out FILE.json [--samples 12] [--seed 0] [--budget 768] [--mode train]

One sample-length distribution (log-uniform lengths in ``[8, 384]``, seeded), the ``tiny`` preset,
fp32, reference kernels, one process:

* ``miles`` / ``bshd``: samples in order, in micro-batches of as many samples as fit the token budget
  once padded to the longest sample of the micro-batch (``B * max_len <= budget``; one sample alone
  may exceed it); every sample right-padded to that length.
* ``miles`` / ``thd`` and ``megatron`` / ``thd``: the same samples packed by ``core.packing``
  (``max_tokens_per_rank = budget``; no padding at cp 1).

Each row times (best of ``--repeats`` passes) a forward + backward of the next-token loss (``--mode train``, default) or a forward
only (``--mode forward``) over all micro-batches, after one warm-up micro-batch. ``tokens`` counts real
tokens, ``padded_tokens`` what the model processed, ``tokens_per_s = tokens / seconds``. A table is
printed and a JSON list of objects (``layout, impl, tokens, padded_tokens, seconds, tokens_per_s, date``,
plus ``mode`` and ``micro_batches``) is written to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import time
from pathlib import Path

import torch


def sample_lengths(n: int, seed: int, lo: int = 8, hi: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return [int(round(math.exp(math.log(lo) + float(x) * (math.log(hi) - math.log(lo))))) for x in u]


def bshd_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of each padded micro-batch (in order; ``count * longest <= budget``, at least one sample)."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def _run_config(impl: str, fmt: str, config):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, qkv_format=fmt, model=config), make_host(third_party=False), model_name="tiny")


def _setup():
    from core.assembly import assemble
    from core.config import preset

    assemble(_run_config("miles", "thd", preset("tiny"))).setup_process()


def _model(impl: str, fmt: str, config):
    from core.assembly import assemble

    return assemble(_run_config(impl, fmt, config)).build_model(config)


def _nll_thd(model, impl: str, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    if impl == "miles":
        logits = model(ids[None], cu_seqlens=cu)[0]
    else:
        logits = model(ids, cu)
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    cu_l = cu.tolist()
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[[c - 1 for c in cu_l[1:] if 0 < c <= lp.numel()]] = False  # no target across a segment end
    return -(lp * keep).sum() / keep.sum().clamp(min=1)


def _nll_bshd(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    return -(lp * m).sum() / m.sum().clamp(min=1)


def run_bench(n_samples: int = 12, seed: int = 0, budget: int = 768, mode: str = "train",
              repeats: int = 2) -> list[dict]:
    from core.config import preset
    from core.packing import pack_micro_batches

    _setup()
    torch.manual_seed(seed)
    config = preset("tiny")
    lengths = sample_lengths(n_samples, seed)
    g = torch.Generator().manual_seed(seed + 1)
    samples = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    rows = []

    def timed(step, batches):
        step(batches[0])  # warm-up
        best = float("inf")
        for _ in range(repeats):  # best of ``repeats`` passes: CPU timings on a shared host are noisy
            t0 = time.perf_counter()
            for b in batches:
                step(b)
            best = min(best, time.perf_counter() - t0)
        return best

    def run_step(loss_fn):
        def step(b):
            if mode == "train":
                loss_fn(b).backward()
            else:
                with torch.no_grad():
                    loss_fn(b)
        return step

    # BSHD with padding (miles)
    groups = bshd_batches(lengths, budget)
    padded = []
    for grp in groups:
        L = max(lengths[i] for i in grp)
        ids = torch.zeros(len(grp), L, dtype=torch.long)
        mask = torch.zeros(len(grp), L, dtype=torch.bool)
        for r, i in enumerate(grp):
            ids[r, : lengths[i]] = samples[i]
            mask[r, : lengths[i]] = True
        padded.append((ids, mask))
    model = _model("miles", "bshd", config)
    secs = timed(run_step(lambda b: _nll_bshd(model, *b)), padded)
    rows.append(dict(layout="bshd", impl="miles", tokens=sum(lengths), padded_tokens=sum(i.numel() for i, _ in padded),
                     seconds=secs, micro_batches=len(padded)))

    # THD packed (both implementations)
    packs = pack_micro_batches(lengths, budget).micro_batches
    streams = []
    for mb in packs:
        ids = torch.zeros(mb.num_tokens, dtype=torch.long)
        ids[: mb.num_real_tokens] = torch.cat([samples[i] for i in mb.sample_indices])
        streams.append((ids, mb.cu_seqlens))
    for impl in ("miles", "megatron"):
        model = _model(impl, "thd", config)
        secs = timed(run_step(lambda b, m=model, i=impl: _nll_thd(m, i, *b)), streams)
        rows.append(dict(layout="thd", impl=impl, tokens=sum(lengths), padded_tokens=sum(mb.num_tokens for mb in packs),
                         seconds=secs, micro_batches=len(streams)))
    for r in rows:
        r["seconds"] = round(r["seconds"], 4)
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1) if r["seconds"] > 0 else None
        r["date"] = date
        r["mode"] = mode
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'layout':<7}{'impl':<10}{'tokens':>8}{'padded':>8}{'mbs':>5}{'seconds':>10}{'tokens/s':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['layout']:<7}{r['impl']:<10}{r['tokens']:>8}{r['padded_tokens']:>8}{r['micro_batches']:>5}"
                     f"{r['seconds']:>10.3f}{r['tokens_per_s']:>11.1f}")
    base = next((r for r in rows if r["layout"] == "bshd"), None)
    if base:
        for r in rows:
            if r is not base and r["impl"] == base["impl"]:
                lines.append(f"thd/bshd speed-up ({r['impl']}): {r['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="JSON file to write")
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=768, help="tokens per micro-batch (padded)")
    p.add_argument("--mode", choices=("train", "forward"), default="train")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per row (the best is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared host)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = run_bench(a.samples, a.seed, a.budget, a.mode, a.repeats)
    print(format_table(rows))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
