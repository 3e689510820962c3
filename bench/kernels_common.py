"""Benchmark harness shared by ``bench/kernels_triton.py`` and ``bench/kernels_tilelang.py``.

Shapes (S = 4096 query tokens, head dim 512, window 128 + top-k compressed = K slots per query):

* ``v4-flash``: H=64,  K = 128 + 512  = 640
* ``v4-pro``:   H=128, K = 128 + 1024 = 1152

kv has S window rows + S/4 compressed rows. Indices: the causal window (-1 only for the first 127
queries) followed by top-k distinct uniformly random compressed ids, all valid (as FlashMLA's
sparse-prefill test does), so almost every slot is real work. Indexer: T=4096, H=64, D=128, N=1024.

FLOP conventions (performance_anchors.md §8.3):

* forward:  FlashMLA ``2*H*S*K*(D_qk + D_v)`` = ``4*H*S*K*D``, every slot counted (incl. -1 ones);
* backward: 2.5x forward = ``10*H*S*K*D`` (= cuDNN's ``2*S*H*K*(3*D_qk + 2*D_v)``).
  Backward time = delta + dq pass + dkv pass (+ zeroing the fp32 dkv buffer, the cast, d_sink).
* indexer scores: ``2*T*N*H*D`` over the full [T, N] grid.

Timing: ``triton.testing.do_bench`` (CUDA events, median, L2 flushed between reps). With the sweep on
(default) several launch configs are timed, each checked against the default config's output, and the
fastest is reported (its config goes into the JSON row).
"""

import json

import torch

SHAPES = {
    "v4-flash": dict(H=64, topk=512),
    "v4-pro": dict(H=128, topk=1024),
}
S, D, WINDOW = 4096, 512, 128
DEVICE = "cuda"
# the indexer shape: T, H, D, N
INDEXER_SHAPE = (S, 64, 128, S // 4)


def attention_inputs(H, topk, seed=0):
    """``q [S,H,D]``, ``kv [S + S/4, D]`` (bf16), ``idx [S, WINDOW + topk]`` int32, ``sink [H]``, ``do``."""
    from kernels.reference.attention import window_indices

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n_comp = S // 4
    q = torch.randn(S, H, D, device=DEVICE, generator=g).bfloat16()
    kv = torch.randn(S + n_comp, D, device=DEVICE, generator=g).bfloat16()
    sink = torch.randn(H, device=DEVICE, generator=g)
    do = torch.randn(S, H, D, device=DEVICE, generator=g).bfloat16()
    comp = torch.rand(S, n_comp, device=DEVICE, generator=g).topk(topk, dim=-1).indices + S
    idx = torch.cat([window_indices(S, WINDOW, DEVICE), comp], dim=1).to(torch.int32)
    return q, kv, idx, sink, do


def indexer_inputs():
    """``q [T,H,D]``, ``k [N,D]`` (bf16), ``w [T,H]``, causal ``ks, ke [T]`` and the shape string."""
    T, H, Di, N = INDEXER_SHAPE
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(T, H, Di, device=DEVICE, generator=g).bfloat16()
    k = torch.randn(N, Di, device=DEVICE, generator=g).bfloat16()
    w = torch.randn(T, H, device=DEVICE, generator=g)
    ke = ((torch.arange(T, device=DEVICE) + 1) // 4).int()
    ks = torch.zeros_like(ke)
    return q, k, w, ks, ke, f"indexer: T={T} H={H} D={Di} N={N}"


def bench(fn, rep=200):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def attention_flops(H, idx):
    """``(fwd_flop, bwd_flop, n_valid, K)`` of one attention call over ``idx [S, K]``."""
    K = idx.shape[1]
    fwd_flop = 4.0 * H * S * K * D
    return fwd_flop, 2.5 * fwd_flop, int((idx >= 0).sum()), K


def attention_shape(name, H, topk, K, kv):
    return f"{name}: S={S} H={H} D={D} K={K} (window {WINDOW} + top-k {topk}), Tkv={kv.shape[0]}"


def attention_row(rows, meta, shape, n_valid, K, backend, direction, ms, flop, label=None, **extra):
    """Append one ``sparse_attention_with_sink`` row and print it (``label``: the printed backend column)."""
    r = dict(kernel="sparse_attention_with_sink", backend=backend, shape=shape, direction=direction,
             ms=round(ms, 4), tflops=round(flop / ms * 1e-9, 1),
             tflops_valid_slots=round(flop * n_valid / (S * K) / ms * 1e-9, 1), **meta, **extra)
    rows.append(r)
    print(f"  {label or f'{backend:10s}'} {direction:4s} {ms:9.3f} ms {r['tflops']:7.1f} TFLOPS  "
          f"{extra.get('config', '')}", flush=True)


def sweep_fwd(A, q, kv, idx, sink, scale, configs, fwd_flop):
    """Time ``A.sparse_attention_fwd`` for each config that agrees with the default one (max diff 1e-2).
    Returns ``(o0, lse0, best)`` with ``best = (ms, config)`` or None."""
    o0, lse0 = A.sparse_attention_fwd(q, kv, idx, sink, scale)
    best = None
    for cfg in configs:
        try:
            o, lse = A.sparse_attention_fwd(q, kv, idx, sink, scale, config=cfg)
            err = max(maxdiff(o, o0), maxdiff(lse, lse0))
            if err > 1e-2:
                print(f"  fwd config {cfg} disagrees with the default config (max diff {err}); skipped")
                continue
            ms = bench(lambda: A.sparse_attention_fwd(q, kv, idx, sink, scale, config=cfg))
            print(f"  sweep fwd {cfg}: {ms:.3f} ms, {fwd_flop / ms * 1e-9:.1f} TFLOPS", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        except Exception as e:  # e.g. out of shared memory for one config
            print(f"  fwd config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    return o0, lse0, best


def sweep_bwd(A, q, kv, idx, sink, o0, lse0, do, scale, configs, bwd_flop):
    """Time ``A.sparse_attention_bwd`` for each config that agrees with the default one (2e-2; dkv relative
    to its max). Returns ``best = (ms, config)`` or None."""
    dq0, dkv0, ds0 = A.sparse_attention_bwd(q, kv, idx, sink, o0, lse0, do, scale)
    best = None
    for cfg in configs:
        try:
            dq, dkv, ds = A.sparse_attention_bwd(q, kv, idx, sink, o0, lse0, do, scale, config=cfg)
            err = max(maxdiff(dq, dq0), maxdiff(dkv, dkv0) / (dkv0.float().abs().max().item() + 1e-9),
                      maxdiff(ds, ds0))
            if err > 2e-2:
                print(f"  bwd config {cfg} disagrees with the default config (max diff {err}); skipped")
                continue
            ms = bench(lambda: A.sparse_attention_bwd(q, kv, idx, sink, o0, lse0, do, scale, config=cfg))
            print(f"  sweep bwd {cfg}: {ms:.3f} ms, {bwd_flop / ms * 1e-9:.1f} TFLOPS", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        except Exception as e:
            print(f"  bwd config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    return best


def print_bwd_split(t_dq, t_dkv, bwd_flop, extra=""):
    unit = bwd_flop / 5  # one of the 5 matmuls
    print(f"  bwd split: dq pass {t_dq:.3f} ms ({3 * unit / t_dq * 1e-9:.0f} TFLOPS on its 3 matmuls), "
          f"dkv pass {t_dkv:.3f} ms ({2 * unit / t_dkv * 1e-9:.0f} TFLOPS on its 2 matmuls{extra})", flush=True)


def add_arguments(p, shapes=True):
    """The arguments both benches take: ``--no-sweep``, ``--shapes``."""
    p.add_argument("--no-sweep", action="store_true", help="time only the default launch configs")
    if shapes:
        p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))


def sweep_args(doc: str, argv=None, parents=()):
    """A launch-settings sweep's command line: ``--out FILE.json`` (required) and the flags of ``parents`` (the
    sweep's own parsers, ``add_help=False``, so that ``--help`` lists them too) -> the parsed arguments, after
    making sure a CUDA GPU is here (the sweeps time Triton kernels on it; elsewhere the process exits with the
    reason)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(description=doc.splitlines()[0], parents=list(parents))
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU and triton")
    return args


def base_meta(**versions):
    import datetime

    return dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, **versions)


def write_results(rows, out):
    """Print the summary table of ``rows`` and write them to the JSON file ``out``."""
    print()
    print(f"{'kernel':28s} {'shape':10s} {'dir':10s} {'backend':10s} {'ms':>9s} {'TFLOPS':>8s}")
    for r in rows:
        tf = "" if r["tflops"] is None else f"{r['tflops']:8.1f}"
        print(f"{r['kernel']:28s} {r['shape'].split(':')[0]:10s} {r['direction']:10s} {r['backend']:10s} "
              f"{r['ms']:9.3f} {tf}")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out}")
