"""Benchmark of the triton kernels against the PyTorch reference ops, on one GPU.

    python -m bench.kernels_triton --out FILE.json [--no-sweep] [--no-reference]

Shapes, inputs, FLOP conventions and timing: ``bench/kernels_common.py``. The indexer's ``tflops`` for the
causal run counts only the visible half (``2*H*D*sum_t ke[t]``). The reference rows time
``kernels.reference`` (gather + fp32 einsum/softmax; backward = fp32 autograd of it).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.kernels_common import D, DEVICE, S, SHAPES, WINDOW  # noqa: F401  (the bench's shapes)
from bench import kernels_common as bc

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

_bench = bc.bench


def bench_attention(name, H, topk, sweep, reference, rows, meta):
    from kernels.triton import attention as A

    q, kv, idx, sink, do = bc.attention_inputs(H, topk)
    scale = D ** -0.5
    fwd_flop, bwd_flop, n_valid, K = bc.attention_flops(H, idx)
    shape = bc.attention_shape(name, H, topk, K, kv)

    def row(backend, direction, ms, flop, **extra):
        bc.attention_row(rows, meta, shape, n_valid, K, backend, direction, ms, flop, **extra)

    o0, lse0, best = bc.sweep_fwd(A, q, kv, idx, sink, scale, FWD_SWEEP if sweep else [dict(A.FWD_CONFIG)],
                                  fwd_flop)
    row("triton", "fwd", best[0], fwd_flop, config=best[1])

    combos = [dict(**a, **b) for a in DQ_SWEEP for b in DKV_SWEEP] if sweep else [dict(A.BWD_CONFIG)]
    best = bc.sweep_bwd(A, q, kv, idx, sink, o0, lse0, do, scale, combos, bwd_flop)
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
    bc.print_bwd_split(t_dq, t_dkv, bwd_flop, f", {T * K * D * 4 / t_dkv * 1e-6:.0f} GB/s of fp32 atomics")


def bench_indexer(reference, rows, meta):
    from kernels.reference.indexer import indexer_scores as ref
    from kernels.triton.indexer import indexer_scores_thd, indexer_topk

    q, k, w, ks, ke, shape = bc.indexer_inputs()
    T, H, Di, N = bc.INDEXER_SHAPE
    topk = 512
    full = 2.0 * T * N * H * Di
    causal = 2.0 * H * Di * float(ke.sum())

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
    rows.append(dict(kernel="indexer_topk", backend="stable_topk", shape=f"{shape} topk={topk}", direction="fwd",
                     ms=round(ms, 4), tflops=None, **meta))
    print(f"  stable_topk {topk}: {ms:.3f} ms", flush=True)
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

    meta = bc.base_meta(triton=triton.__version__)
    rows = []
    for name in args.shapes.split(","):
        print(f"== {name}", flush=True)
        bench_attention(name, **SHAPES[name], sweep=not args.no_sweep, reference=not args.no_reference,
                        rows=rows, meta=meta)
    print("== indexer", flush=True)
    bench_indexer(not args.no_reference, rows, meta)
    bc.write_results(rows, args.out)


if __name__ == "__main__":
    main()
