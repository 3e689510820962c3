"""Benchmark of the TileLang kernels, on one GPU (same shapes, FLOP conventions and timing as
``bench/kernels_triton.py``, so the rows sit next to the triton rows of ``bench/results/kernels-h200.json``).

    python -m bench.kernels_tilelang --out FILE.json [--no-sweep] [--jobs N]

Shapes, inputs, FLOP conventions and timing: ``bench/kernels_common.py`` (the causal indexer row counts
the full grid too: the TileLang indexer does not skip invisible tiles).

Timing: ``triton.testing.do_bench`` (CUDA events, median, L2 flushed between reps). With the sweep on
(default) a few launch configs are timed, each checked against the default config's output, and the
fastest is reported (its config goes into the row). All configs are compiled first in ``--jobs``
parallel processes (TileLang's disk cache), then timed in this process.
"""

import argparse
import sys

import torch

from bench.kernels_common import D, DEVICE, S, SHAPES, WINDOW  # noqa: F401  (the bench's shapes)
from bench import kernels_common as bc

FWD_SWEEP = [
    dict(BK=64, num_stages=1),
    dict(BK=64, num_stages=2),
    dict(BK=32, num_stages=2),
]
DQ_SWEEP = [
    dict(BK=32, num_stages=1),
    dict(BK=64, num_stages=1),
]
DKV_SWEEP = [
    dict(BK2=64, DC=64),
    dict(BK2=64, DC=128),
]
IDX_SWEEP = [
    dict(BT=64, BN=128, num_stages=2),
    dict(BT=128, BN=128, num_stages=2, threads=256),
]


def kernel_specs(shapes, sweep: bool):
    """``(factory name, args)`` of every kernel the bench compiles (for :func:`precompile`)."""
    from kernels.tilelang import attention as A
    from kernels.tilelang import indexer as I

    out = []
    for name in shapes:
        H = SHAPES[name]["H"]
        f = A.FWD_CONFIG
        for c in (FWD_SWEEP if sweep else [{}]):
            c = {**f, **c}
            out.append(("fwd", (H, D, "bfloat16", c["BH"], c["BK"], c["threads"], c["num_stages"])))
        b = A.BWD_CONFIG
        for c in (DQ_SWEEP if sweep else [{}]):
            c = {**b, **c}
            out.append(("dq", (H, D, "bfloat16", c["BH"], c["BK"], c["threads"], c["num_stages"])))
        for c in (DKV_SWEEP if sweep else [{}]):
            c = {**b, **c}
            out.append(("dkv", (H, D, "bfloat16", c["BK2"], c["DC"], c["threads2"], c["num_stages2"])))
    for c in (IDX_SWEEP if sweep else [{}]):
        c = {**I.INDEXER_CONFIG, **c}
        for rng in (False, True):
            out.append(("indexer", (64, 128, "bfloat16", rng, c["BT"], c["BN"], c["threads"], c["num_stages"])))
    return out


def test_specs():
    """The kernels ``tests/kernels/test_*_gpu.py`` and the tiny-model GPU test compile (default configs)."""
    from kernels.tilelang import attention as A
    from kernels.tilelang import indexer as I

    f, b, c = A.FWD_CONFIG, A.BWD_CONFIG, I.INDEXER_CONFIG
    out = []
    for H, Dh in ((64, 512), (128, 512), (20, 64), (4, 128)):
        out.append(("fwd", (H, Dh, "bfloat16", f["BH"], f["BK"], f["threads"], f["num_stages"])))
        out.append(("dq", (H, Dh, "bfloat16", b["BH"], b["BK"], b["threads"], b["num_stages"])))
        out.append(("dkv", (H, Dh, "bfloat16", b["BK2"], min(b["DC"], Dh), b["threads2"], b["num_stages2"])))
    for rng in (False, True):
        out.append(("indexer", (64, 128, "bfloat16", rng, c["BT"], c["BN"], c["threads"], c["num_stages"])))
    return out


def _compile_one(spec):
    import time

    from kernels.tilelang import attention as A
    from kernels.tilelang import indexer as I

    kind, args = spec
    fn = {"fwd": A.fwd_kernel, "dq": A.dq_kernel, "dkv": A.dkv_kernel, "indexer": I.indexer_kernel}[kind]
    t0 = time.time()
    try:
        fn(*args)
        return kind, args, time.time() - t0, None
    except Exception as e:  # a config that does not fit (shared memory, registers) is skipped later
        return kind, args, time.time() - t0, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(specs, jobs: int = 8):
    """Compile ``specs`` in ``jobs`` processes; TileLang caches each kernel on disk for later calls."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs) as pool:
        for kind, args, secs, err in pool.imap_unordered(_compile_one, specs):
            print(f"  compiled {kind}{args} in {secs:.1f} s" + (f"  FAILED {err}" if err else ""), flush=True)


_bench = bc.bench
_maxdiff = bc.maxdiff


def bench_attention(name, H, topk, sweep, rows, meta):
    from kernels.tilelang import attention as A

    q, kv, idx, sink, do = bc.attention_inputs(H, topk)
    scale = D ** -0.5
    fwd_flop, bwd_flop, n_valid, K = bc.attention_flops(H, idx)
    shape = bc.attention_shape(name, H, topk, K, kv)

    def row(direction, ms, flop, **extra):
        bc.attention_row(rows, meta, shape, n_valid, K, "tilelang", direction, ms, flop, label="tilelang  ",
                         **extra)

    o0, lse0, best = bc.sweep_fwd(A, q, kv, idx, sink, scale,
                                  [{**A.FWD_CONFIG, **cfg} for cfg in (FWD_SWEEP if sweep else [{}])], fwd_flop)
    if best:
        row("fwd", best[0], fwd_flop, config=best[1])

    combos = [{**A.BWD_CONFIG, **a, **b} for a in DQ_SWEEP for b in DKV_SWEEP] if sweep else [dict(A.BWD_CONFIG)]
    best = bc.sweep_bwd(A, q, kv, idx, sink, o0, lse0, do, scale, combos, bwd_flop)
    if best:
        row("bwd", best[0], bwd_flop, config=best[1])
        _bwd_split(A, q, kv, idx, sink, o0, lse0, do, scale, best[1], bwd_flop)


def _bwd_split(A, q, kv, idx, sink, o, lse2, do, scale, cfg, bwd_flop):
    T, H, _ = q.shape
    K = idx.shape[1]
    delta = (o.float() * do.float()).sum(-1)
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    pt = torch.empty(T, H, K, dtype=q.dtype, device=q.device)
    dst = torch.empty_like(pt)
    kdq = A.dq_kernel(H, D, "bfloat16", cfg["BH"], cfg["BK"], cfg["threads"], cfg["num_stages"])
    kdkv = A.dkv_kernel(H, D, "bfloat16", cfg["BK2"], min(cfg["DC"], D), cfg["threads2"], cfg["num_stages2"])
    t_dq = _bench(lambda: kdq(q, kv, idx, do, lse2, delta, dq, pt, dst, scale, scale * A.LOG2E))
    t_dkv = _bench(lambda: kdkv(q, do, idx, pt, dst, dkv32))
    bc.print_bwd_split(t_dq, t_dkv, bwd_flop)


def bench_indexer(sweep, rows, meta):
    from kernels.tilelang.indexer import INDEXER_CONFIG, indexer_scores_thd

    q, k, w, ks, ke, shape = bc.indexer_inputs()
    T, H, Di, N = bc.INDEXER_SHAPE
    full = 2.0 * T * N * H * Di
    for direction, rng in (("fwd", None), ("fwd-causal", (ks, ke))):
        ref = indexer_scores_thd(q, k, w, *(rng or ()))
        best = None
        for cfg in (IDX_SWEEP if sweep else [{}]):
            cfg = {**INDEXER_CONFIG, **cfg}
            try:
                out = indexer_scores_thd(q, k, w, *(rng or ()), config=cfg)
                fin = torch.isfinite(ref)
                bad = _maxdiff(out[fin], ref[fin]) > 1e-3 * ref[fin].abs().max().item()
                if bad or not torch.equal(fin, torch.isfinite(out)):
                    print(f"  indexer config {cfg} disagrees with the default config; skipped")
                    continue
                ms = _bench(lambda: indexer_scores_thd(q, k, w, *(rng or ()), config=cfg))
                print(f"  sweep indexer {direction} {cfg}: {ms:.3f} ms, {full / ms * 1e-9:.1f} TFLOPS", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            except Exception as e:
                print(f"  indexer config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
        if best:
            note = "full [T,N] grid" if rng is None else \
                "ks=0, ke=(t+1)//4; every tile computed, invisible scores masked; FLOPs of the full grid"
            rows.append(dict(kernel="indexer_scores", backend="tilelang", shape=shape, direction=direction,
                             ms=round(best[0], 4), tflops=round(full / best[0] * 1e-9, 1), **meta,
                             config=best[1], note=note))
            print(f"  tilelang   {direction:10s} {best[0]:9.3f} ms {full / best[0] * 1e-9:7.1f} TFLOPS", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write (required unless --precompile)")
    p.add_argument("--no-sweep", action="store_true", help="time only the default launch configs")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--jobs", type=int, default=8, help="parallel compile processes (0: compile lazily)")
    p.add_argument("--precompile", choices=("tests", "all"),
                   help="only compile (in --jobs processes, into TileLang's disk cache) the kernels of the GPU "
                        "tests, or of the tests and this bench, then exit (no GPU needed with "
                        "DSV4_TILELANG_TARGET set)")
    args = p.parse_args(argv)
    if args.precompile:
        specs = test_specs() + (kernel_specs(list(SHAPES), True) if args.precompile == "all" else [])
        precompile(list(dict.fromkeys(specs)), max(args.jobs, 1))
        return
    if not args.out:
        p.error("--out is required")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU and tilelang")
    import tilelang

    shapes = args.shapes.split(",")
    if args.jobs:
        print("== compiling", flush=True)
        precompile(kernel_specs(shapes, not args.no_sweep), args.jobs)
    meta = bc.base_meta(tilelang=tilelang.__version__)
    rows = []
    for name in shapes:
        print(f"== {name}", flush=True)
        bench_attention(name, **SHAPES[name], sweep=not args.no_sweep, rows=rows, meta=meta)
    print("== indexer", flush=True)
    bench_indexer(not args.no_sweep, rows, meta)

    bc.write_results(rows, args.out)


if __name__ == "__main__":
    main()
