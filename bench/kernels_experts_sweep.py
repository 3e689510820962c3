"""Launch settings of the triton decode experts kernel (``kernels/triton/experts.py``) at the Flash-shaped decode
step's shapes, timed and checked on one GPU.

    python -m bench.kernels_experts_sweep [--sequences 1 64 256] [--split | --wide | --deep | --grid | --reference]
        [--skew S] --out FILE.json

Why: in the product's decode step (triton kernels, compiled, CUDA graphs; ``bench.rollout --kernel-backend triton
--compile on --profile-steps``) the kernel took 1.70 ms of a 3.85 ms step at 64 sequences, about 79% of the HBM
bandwidth for the expert weights it reads, and 0.31 ms of 1.63 at one sequence; at 256 sequences, with 16-row
steps, 5.65 ms of 8.83 (``launch_settings`` now widens the row step). This times every setting of a small grid
(``BM`` rows, ``BN`` output columns and ``BK`` reduction a step of one program, pipeline ``STAGES``, ``WARPS``)
on the step's two GEMMs (gate and up: ``w [32, 4096, 4096]``; down: ``w [32, 4096, 2048]``) at 1, 64 and 256
sequences (6, 384 and 1,536 rows, top-6 of 32 experts drawn at random), with ``triton.testing.do_bench`` (median), reports the
weight bytes the experts with rows read over the time, and compares each output with the launch settings' (``equal``
bits, or ``close``: within bf16 rounding, a reduction in another order). The sweep only measures; the settings
(``EXPERTS_CONFIG``, ``launch_settings``) change by hand after ``tests/kernels/test_experts_gpu.py`` holds them to the exact products.

``--reference`` times, instead of the grid, the launch settings' kernel beside other reads of the same bytes (the
weights of the experts with rows): a torch GEMM of one row (cuBLAS), a copy (half its time: it reads and writes
them) and an fp32 sum: what a kernel gets from HBM for reads of this size on the machine, the limit the experts
kernel is measured against. ``--wide`` sweeps around the many-rows settings (64 and 256 sequences) instead of the
whole grid, ``BN`` 256 among them. ``--skew S`` draws the experts unevenly (weights ``(rank + 1) ** -S``), as a
trained router loads them on one batch: a few experts then take several row blocks.
"""

from __future__ import annotations

import itertools
import json

import torch

from bench import kernels_common as bc

E, TOPK, DIM, INTER = 32, 6, 4096, 2048


def _case(seqs: int, N: int, K: int, skew: float = 0.0):
    """The step's rows for ``seqs`` sequences, each token's ``TOPK`` experts drawn without replacement at random:
    uniform (``skew`` 0), or with expert ``e`` (in a shuffled order) drawn in proportion to ``(rank + 1) ** -skew``,
    the skewed load of a trained router on one batch. Returns ``(x, w, offs, counts, bytes)``: each expert's rows
    and the weight bytes the experts with rows read."""
    g = torch.Generator().manual_seed(seqs)
    if skew:
        p = (torch.arange(E, dtype=torch.float64) + 1) ** -skew
        p = p[torch.randperm(E, generator=g)]
        picks = torch.multinomial(p.expand(seqs, E), TOPK, generator=g).flatten()
    else:
        picks = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(seqs)]).flatten()
    counts = torch.bincount(picks, minlength=E)
    x = torch.randn(picks.numel(), K, generator=g).bfloat16().cuda()
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).bfloat16().cuda()
    offs = counts.cumsum(0).to(torch.int32).cuda()
    return x, w, offs, counts, int((counts > 0).sum()) * N * K * 2


def _same_bytes(x, w, offs, counts, nbytes):
    """The launch settings' kernel and other reads of the weights of the experts with rows, each timed: rows of
    ``reader``, ``us``, ``gb_per_s`` (the bytes over the time), printed as they come."""
    from kernels.triton import experts as KE

    busy = [w[e] for e in range(w.shape[0]) if counts[e] > 0]
    row, whole = x[:1].contiguous(), torch.cat(busy)
    readers = {"experts_grouped_mm (launch settings)": lambda: KE.experts_grouped_mm_launch(x, w, offs),
               "torch mm, one row": lambda: row @ whole.t(),
               "copy (half its time)": lambda: whole.clone(),
               "fp32 sum": lambda: whole.sum(dtype=torch.float32)}
    out = []
    for name, fn in readers.items():
        us = bc.bench(fn, rep=100) * 1e3 / (2 if name.startswith("copy") else 1)
        out.append(dict(reader=name, us=round(us, 1), gb_per_s=round(nbytes / us / 1e3)))
        print(f"  {x.shape[0]:5d} rows over {len(busy):2d} experts {w.shape[1]}x{w.shape[2]}: {name:38s} "
              f"{us:8.1f} us {out[-1]['gb_per_s']:6d} GB/s", flush=True)
    return out


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--sequences", nargs="+", type=int, default=[1, 64, 256],
                   help="decode steps of these many sequences (default 1 64 256)")
    grid = p.add_mutually_exclusive_group()      # one grid a run: a second flag would silently replace the first
    grid.add_argument("--split", action="store_true",
                      help="sweep SPLIT (shares of K, each a block's program, summed by its last) with BN, STAGES "
                           "and WARPS around the few-rows settings instead")
    grid.add_argument("--grid", action="store_true",
                      help="time the launch settings with the grid's routed blocks bounded by the experts that can "
                           "have rows (TIGHT_GRID, the default) and without, and at few rows with SPLIT 2 and 4 at "
                           "4 and 8 warps, instead")
    grid.add_argument("--reference", action="store_true",
                      help="time the launch settings beside other reads of the same weight bytes instead")
    grid.add_argument("--wide", action="store_true",
                      help="sweep around the many-rows settings instead (BM 64; BN up to 256, which reads each row "
                           "of x half as often)")
    grid.add_argument("--deep", action="store_true",
                      help="sweep the few-rows settings' depth instead: BK 128 and 256 with 2 to 6 pipeline stages "
                           "(BN 32, 64 and 128, 4 warps), the weight bytes a program has in flight")
    p.add_argument("--skew", type=float, default=0.0,
                   help="draw the experts with weights (rank + 1) ** -SKEW (a trained router's uneven load on one "
                        "batch) instead of uniformly (0, the default)")
    known = bc.sweep_args(__doc__, argv, parents=[p])
    out = known.out
    import triton

    from kernels.triton import experts as KE

    meta = bc.base_meta(triton=triton.__version__)
    # fewer pipeline stages leave a program less shared memory, so more of them fit an SM at once: at one
    # sequence the seven experts with rows make one and a half waves of four-stage programs
    configs = [dict(BM=bm, BN=bn, BK=bk, STAGES=st, WARPS=wp, SPLIT=1)
               for bm, bn, bk, st, wp in itertools.product([16, 32, 64], [32, 64, 128], [64, 128], [2, 3, 4], [4, 8])]
    if known.split:
        # at 4 warps the shares' plan spills (ptxas: 380 and 476 bytes for the gather and scatter GEMMs at 4 shares,
        # none and 32 at 8 warps; triton 3.6, sm_90)
        configs = [dict(KE.EXPERTS_CONFIG, BN=bn, STAGES=st, SPLIT=sp, WARPS=wp)
                   for bn, st, sp, wp in itertools.product([32, 64], [3, 4], [1, 2, 4, 8], [4, 8])]
    elif known.deep:
        configs = [dict(BM=16, BN=bn, BK=bk, STAGES=st, WARPS=wp, SPLIT=1)
                   for bn, bk, st, wp in itertools.product([32, 64, 128], [128, 256], [2, 3, 4, 5, 6], [4])
                   if bn * bk * st <= 64 * 256 * 4]                 # bf16 weight tiles within 128 KB of shared memory
    elif known.wide:
        configs = [dict(BM=64, BN=bn, BK=bk, STAGES=st, WARPS=wp, SPLIT=1)
                   for bn, bk, st, wp in itertools.product([128, 256], [32, 64], [3, 4], [4, 8])]
    rows = []
    for seqs, (site, N, K) in itertools.product(known.sequences,
                                                (("gate_up", 2 * INTER, DIM), ("down", DIM, INTER))):
        x, w, offs, counts, nbytes = _case(seqs, N, K, known.skew)
        case = dict(sequences=seqs, site=site, N=N, K=K, weight_bytes=nbytes, skew=known.skew,
                    max_rows=int(counts.max()), busy_experts=int((counts > 0).sum()))
        if known.reference:
            rows += [dict(case, **r, **meta) for r in _same_bytes(x, w, offs, counts, nbytes)]
            continue
        ref = KE.experts_grouped_mm_launch(x, w, offs)
        if known.grid:
            base = KE.launch_settings(x.shape[0], E)
            few = x.shape[0] <= KE.FEW_ROWS
            configs = [dict(base, SPLIT=sp, WARPS=wp, TIGHT_GRID=tight)
                       for sp, wp, tight in itertools.product([1, 2, 4] if few else [base["SPLIT"]],
                                                              [base["WARPS"], 8] if few else [base["WARPS"]],
                                                              [False, True])]
        us_default = bc.bench(lambda: KE.experts_grouped_mm_launch(x, w, offs), rep=50) * 1e3
        print(f"== {seqs} sequence(s), {site} {N}x{K}, at most {case['max_rows']} rows an expert: launch settings "
              f"{KE.launch_settings(x.shape[0], E)} "
              f"{us_default:.1f} us, "
              f"{nbytes / us_default / 1e3:.0f} GB/s", flush=True)
        here = []
        for cfg in configs:
            try:
                got = KE.experts_grouped_mm_launch(x, w, offs, cfg)
                us = bc.bench(lambda: KE.experts_grouped_mm_launch(x, w, offs, cfg), rep=50) * 1e3
            except Exception as e:                                  # e.g. out of shared memory: recorded, skipped
                here.append(dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:120]}"))
                continue
            agree = "equal" if torch.equal(got, ref) else (
                "close" if torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2) else "differ")
            here.append(dict(config=cfg, us=round(us, 1), gb_per_s=round(nbytes / us / 1e3), vs_default=agree))
        for r in sorted((r for r in here if "us" in r), key=lambda r: r["us"])[:None if known.grid else 5]:
            print(f"  {r['us']:8.1f} us {r['gb_per_s']:6d} GB/s {r['vs_default']:6s} {r['config']}", flush=True)
        rows += [dict(case, default_us=round(us_default, 1), **r, **meta) for r in here]
    with open(out, "w") as fh:
        json.dump(dict(bench="kernels_experts_sweep", defaults=KE.EXPERTS_CONFIG,
                       launch_settings={s: KE.launch_settings(s * TOPK, E) for s in (1, 64, 256)}, rows=rows), fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
