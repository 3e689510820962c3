"""Benchmark of the triton kernels against the PyTorch reference ops, on one GPU.

    python -m kernels.triton.bench --out FILE.json [--no-sweep] [--no-reference]

Shapes (S = 4096 query tokens, head dim 512, window 128 + top-k compressed = K slots per query):

* ``v4-flash``: H=64,  K = 128 + 512  = 640
* ``v4-pro``:   H=128, K = 128 + 1024 = 1152

kv has S window rows + S/4 compressed rows. Indices: the causal window (-1 only for the first 127
queries) followed by top-k distinct uniformly random compressed ids, all valid (as FlashMLA's
sparse-prefill test does), so almost every slot is real work.

FLOP conventions (performance_anchors.md §8.3):

* forward:  FlashMLA ``2*H*S*K*(D_qk + D_v)`` = ``4*H*S*K*D``, every slot counted (incl. -1 ones);
* backward: 2.5x forward = ``10*H*S*K*D`` (= cuDNN's ``2*S*H*K*(3*D_qk + 2*D_v)``).
  Backward time = delta + dq pass + dkv pass (+ zeroing the fp32 dkv buffer, the cast, d_sink).
* indexer scores: ``2*T*N*H*D`` over the full [T, N] grid; ``tflops`` for the causal run counts
  only the visible half (``2*H*D*sum_t ke[t]``).

Timing: ``triton.testing.do_bench`` (CUDA events, median, L2 flushed between reps). The reference rows
time ``kernels.reference`` (gather + fp32 einsum/softmax; backward = fp32 autograd of it).
With the sweep on (default) several launch configs are timed, each checked against the default
config's output, and the fastest is reported (its config goes into the JSON row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

SHAPES = {
    "v4-flash": dict(H=64, topk=512),
    "v4-pro": dict(H=128, topk=1024),
}
S, D, WINDOW = 4096, 512, 128
DEVICE = "cuda"

FWD_SWEEP = [
    dict(BK=64, num_stages=2, num_warps=8),
    dict(BK=32, num_stages=3, num_warps=8),
    dict(BK=32, num_stages=2, num_warps=8),
    dict(BK=64, num_stages=1, num_warps=8),
]
DQ_SWEEP = [
    dict(BK=32, num_stages=1, num_warps=8),
    dict(BK=16, num_stages=1, num_warps=8),
    dict(BK=64, num_stages=1, num_warps=8),
    dict(BK=32, num_stages=2, num_warps=8),
]
DKV_SWEEP = [
    dict(BK2=64, DC=128, num_warps2=4, num_stages2=2),
    dict(BK2=64, DC=64, num_warps2=4, num_stages2=3),
    dict(BK2=64, DC=128, num_warps2=8, num_stages2=2),
]


def _inputs(H, topk, seed=0):
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


def _bench(fn, rep=200):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def bench_attention(name, H, topk, sweep, reference, rows, meta):
    from kernels.triton import attention as A

    q, kv, idx, sink, do = _inputs(H, topk)
    K = idx.shape[1]
    scale = D ** -0.5
    fwd_flop = 4.0 * H * S * K * D
    bwd_flop = 2.5 * fwd_flop
    n_valid = int((idx >= 0).sum())
    shape = f"{name}: S={S} H={H} D={D} K={K} (window {WINDOW} + top-k {topk}), Tkv={kv.shape[0]}"

    def row(backend, direction, ms, flop, **extra):
        r = dict(kernel="sparse_attention_with_sink", backend=backend, shape=shape, direction=direction,
                 ms=round(ms, 4), tflops=round(flop / ms * 1e-9, 1),
                 tflops_valid_slots=round(flop * n_valid / (S * K) / ms * 1e-9, 1), **meta, **extra)
        rows.append(r)
        print(f"  {backend:10s} {direction:4s} {ms:9.3f} ms {r['tflops']:7.1f} TFLOPS  {extra.get('config', '')}",
              flush=True)

    # forward
    o0, lse0 = A.sparse_attention_fwd(q, kv, idx, sink, scale)
    best = None
    for cfg in (FWD_SWEEP if sweep else [dict(A.FWD_CONFIG)]):
        try:
            o, lse = A.sparse_attention_fwd(q, kv, idx, sink, scale, config=cfg)
            err = max(_maxdiff(o, o0), _maxdiff(lse, lse0))
            if err > 1e-2:
                print(f"  fwd config {cfg} disagrees with the default config (max diff {err}); skipped")
                continue
            ms = _bench(lambda: A.sparse_attention_fwd(q, kv, idx, sink, scale, config=cfg))
            print(f"  sweep fwd {cfg}: {ms:.3f} ms, {fwd_flop / ms * 1e-9:.1f} TFLOPS", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        except Exception as e:  # e.g. out of shared memory for one config
            print(f"  fwd config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    row("triton", "fwd", best[0], fwd_flop, config=best[1])

    # backward
    dq0, dkv0, ds0 = A.sparse_attention_bwd(q, kv, idx, sink, o0, lse0, do, scale)
    combos = [dict(**a, **b) for a in DQ_SWEEP for b in DKV_SWEEP] if sweep else [dict(A.BWD_CONFIG)]
    best = None
    for cfg in combos:
        try:
            dq, dkv, ds = A.sparse_attention_bwd(q, kv, idx, sink, o0, lse0, do, scale, config=cfg)
            err = max(_maxdiff(dq, dq0), _maxdiff(dkv, dkv0) / (dkv0.float().abs().max().item() + 1e-9),
                      _maxdiff(ds, ds0))
            if err > 2e-2:
                print(f"  bwd config {cfg} disagrees with the default config (max diff {err}); skipped")
                continue
            ms = _bench(lambda: A.sparse_attention_bwd(q, kv, idx, sink, o0, lse0, do, scale, config=cfg))
            print(f"  sweep bwd {cfg}: {ms:.3f} ms, {bwd_flop / ms * 1e-9:.1f} TFLOPS", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        except Exception as e:
            print(f"  bwd config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    row("triton", "bwd", best[0], bwd_flop, config=best[1])

    # split of the best backward into its passes (dq pass vs dkv pass), for the report
    _bwd_split(A, q, kv, idx, sink, o0, lse0, do, scale, best[1], bwd_flop)

    if reference:
        from kernels.reference.attention import sparse_attention_with_sink as ref

        idx64 = idx.long()
        with torch.no_grad():
            ms = _bench(lambda: ref(q[None], kv[None], idx64, sink, scale), rep=300)
        row("reference", "fwd", ms, fwd_flop, note="gather + fp32 einsum/softmax (kernels.reference)")
        qr, kvr, sr = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
        o_ref = ref(qr[None], kvr[None], idx64, sr, scale)
        ms = _bench(lambda: torch.autograd.grad(o_ref, (qr, kvr, sr), do[None], retain_graph=True), rep=300)
        row("reference", "bwd", ms, bwd_flop, note="fp32 autograd of the reference op")
        del o_ref, qr, kvr, sr
        torch.cuda.empty_cache()


def _bwd_split(A, q, kv, idx, sink, o, lse2, do, scale, cfg, bwd_flop):
    import triton

    T, H, _ = q.shape
    K = idx.shape[1]
    c = {**A.BWD_CONFIG, **cfg}
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    A._delta_kernel[(triton.cdiv(T * H, 16),)](o, do, delta, T * H, D=D, BR=16, num_warps=4)
    dq = torch.empty_like(q)
    dkv32 = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    pt = torch.empty(T, H, K, dtype=q.dtype, device=q.device)
    dst = torch.empty_like(pt)
    BH = A._head_block(H, c["BH"])
    scale_log2 = scale * A.LOG2E

    def dq_pass():
        A._bwd_dq_kernel[(triton.cdiv(H, BH), T)](
            q, kv, idx, do, lse2, delta, dq, pt, dst, H, K, scale, scale_log2,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), do.stride(0), do.stride(1),
            BH=BH, BK=c["BK"], D=D, NUM_STAGES=c["num_stages"], num_warps=c["num_warps"])

    def dkv_pass():
        A._bwd_dkv_kernel[(D // c["DC"], T)](
            q, do, idx, pt, dst, dkv32, H, K, q.stride(0), q.stride(1), idx.stride(0), do.stride(0), do.stride(1),
            HP=max(16, triton.next_power_of_2(H)), BK=c["BK2"], DC=c["DC"], D=D,
            NUM_STAGES=c["num_stages2"], num_warps=c["num_warps2"])

    t_dq = _bench(dq_pass)
    t_dkv = _bench(dkv_pass)
    unit = bwd_flop / 5  # one of the 5 matmuls
    print(f"  bwd split: dq pass {t_dq:.3f} ms ({3 * unit / t_dq * 1e-9:.0f} TFLOPS on its 3 matmuls), "
          f"dkv pass {t_dkv:.3f} ms ({2 * unit / t_dkv * 1e-9:.0f} TFLOPS on its 2 matmuls, "
          f"{T * K * D * 4 / t_dkv * 1e-6:.0f} GB/s of fp32 atomics)", flush=True)


def bench_indexer(reference, rows, meta):
    from kernels.reference.indexer import indexer_scores as ref
    from kernels.triton.indexer import indexer_scores_thd, indexer_topk

    T, H, Di, N, topk = S, 64, 128, S // 4, 512
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(T, H, Di, device=DEVICE, generator=g).bfloat16()
    k = torch.randn(N, Di, device=DEVICE, generator=g).bfloat16()
    w = torch.randn(T, H, device=DEVICE, generator=g)
    ke = ((torch.arange(T, device=DEVICE) + 1) // 4).int()
    ks = torch.zeros_like(ke)
    full = 2.0 * T * N * H * Di
    causal = 2.0 * H * Di * float(ke.sum())
    shape = f"indexer: T={T} H={H} D={Di} N={N}"

    def row(backend, direction, ms, flop, **extra):
        r = dict(kernel="indexer_scores", backend=backend, shape=shape, direction=direction, ms=round(ms, 4),
                 tflops=round(flop / ms * 1e-9, 1), **meta, **extra)
        rows.append(r)
        print(f"  {backend:10s} {direction:10s} {ms:9.3f} ms {r['tflops']:7.1f} TFLOPS", flush=True)

    row("triton", "fwd", _bench(lambda: indexer_scores_thd(q, k, w)), full, note="full [T,N] grid")
    row("triton", "fwd-causal", _bench(lambda: indexer_scores_thd(q, k, w, ks, ke)), causal,
        note="ks=0, ke=(t+1)//4; invisible tiles skipped; FLOPs of visible pairs only")
    scores = indexer_scores_thd(q, k, w, ks, ke)
    ms = _bench(lambda: indexer_topk(scores, topk))
    rows.append(dict(kernel="indexer_topk", backend="torch.topk", shape=f"{shape} topk={topk}", direction="fwd",
                     ms=round(ms, 4), tflops=None, **meta))
    print(f"  torch.topk {topk}: {ms:.3f} ms", flush=True)
    if reference:
        with torch.no_grad():
            ms = _bench(lambda: ref(q.float()[None], k.float()[None], w[None]))
        row("reference", "fwd", ms, full, note="fp32 einsum (kernels.reference)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--no-sweep", action="store_true", help="time only the default launch configs")
    p.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference rows")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU and triton")
    import triton

    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__)
    rows = []
    for name in args.shapes.split(","):
        print(f"== {name}", flush=True)
        bench_attention(name, **SHAPES[name], sweep=not args.no_sweep, reference=not args.no_reference,
                        rows=rows, meta=meta)
    print("== indexer", flush=True)
    bench_indexer(not args.no_reference, rows, meta)

    print()
    print(f"{'kernel':28s} {'shape':10s} {'dir':10s} {'backend':10s} {'ms':>9s} {'TFLOPS':>8s}")
    for r in rows:
        tf = "" if r["tflops"] is None else f"{r['tflops']:8.1f}"
        print(f"{r['kernel']:28s} {r['shape'].split(':')[0]:10s} {r['direction']:10s} {r['backend']:10s} "
              f"{r['ms']:9.3f} {tf}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
