"""Benchmark of the triton backend's fused mHC kernels against the PyTorch reference ops, on one GPU.

    python -m bench.kernels_mhc --out FILE.json [--seq 4096] [--hidden 4096] [--hc 4] [--iters 20]

One mHC site of the Flash-shaped training step: streams ``x [1, S, n, d]`` bf16, fp32 mapping weights,
``iters`` Sinkhorn rounds. For each op (``hc_pre``, ``hc_post``, ``hc_head``, ``sinkhorn``) it times the
forward alone and the forward + backward (``torch.autograd.grad`` of all inputs against fixed upstream
gradients), of ``kernels.reference.mhc`` (eager PyTorch, fp32 math) and of ``kernels.triton.mhc``, checks that
the two agree (max |diff| of the outputs, printed) and prints a table with the speed-up; the rows go to the JSON
file ``--out``. A training step runs ``hc_pre`` and ``hc_post`` at two sites per layer (attention and FFN) and
``hc_head`` once per trunk / MTP exit. Timing: ``triton.testing.do_bench`` (median, L2 flushed).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import kernels_common as bc

NORM_EPS = HC_EPS = 1e-6


def _inputs(S, n, d, iters):
    """Per op: ``(inputs, upstream gradients, extra positional args)`` on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g) * scale

    x = rnd(1, S, n, d).bfloat16()
    M = (2 + n) * n
    pre = ([x, rnd(M, n * d, scale=(n * d) ** -0.5), 0.5 + torch.rand(3, device="cuda", generator=g), rnd(M) * 0.5],
           [rnd(1, S, d).bfloat16(), rnd(1, S, n), rnd(1, S, n, n)], (NORM_EPS, HC_EPS, iters))
    head = ([x, rnd(n, n * d, scale=(n * d) ** -0.5), torch.ones(1, device="cuda"), rnd(n) * 0.5],
            [rnd(1, S, d).bfloat16()], (NORM_EPS, HC_EPS))
    post = ([rnd(1, S, d).bfloat16(), x, 2 * torch.sigmoid(rnd(1, S, n)),
             torch.softmax(rnd(1, S, n, n), -1)], [rnd(1, S, n, d).bfloat16()], ())
    sink = ([rnd(1, S, n, n, scale=2.0)], [rnd(1, S, n, n)], (iters, HC_EPS))
    return dict(hc_pre=pre, hc_post=post, hc_head=head, sinkhorn=sink)


def _timers(fn, inputs, grads, extra):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def fwd():
        with torch.no_grad():
            return fn(*inputs, *extra)

    def fwd_bwd():
        outs = fn(*leaves, *extra)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad(outs, leaves, grads)

    return fwd, fwd_bwd


def _maxdiff(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(bc.maxdiff(x, y) for x, y in zip(a, b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--seq", type=int, default=4096, help="tokens (batch 1)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--hc", type=int, default=4, help="hc_mult (residual streams)")
    p.add_argument("--iters", type=int, default=20, help="Sinkhorn rounds")
    p.add_argument("--ops", default="hc_pre,hc_post,hc_head,sinkhorn")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU and triton")
    import triton

    from kernels.reference import mhc as ref
    from kernels.triton import mhc as fused

    shape = f"mhc: S={args.seq} n={args.hc} d={args.hidden} iters={args.iters}"
    meta = bc.base_meta(triton=triton.__version__)
    rows = []
    cases = _inputs(args.seq, args.hc, args.hidden, args.iters)
    for op in args.ops.split(","):
        inputs, grads, extra = cases[op]
        print(f"== {op}", flush=True)
        ref_fwd, ref_fb = _timers(getattr(ref, op), inputs, grads, extra)
        k_fwd, k_fb = _timers(getattr(fused, op), inputs, grads, extra)
        out_diff, grad_diff = _maxdiff(k_fwd(), ref_fwd()), _maxdiff(k_fb(), ref_fb())
        print(f"  triton vs reference: outputs max|diff| {out_diff:.3e}, gradients max|diff| {grad_diff:.3e}")
        for direction, r_fn, k_fn in (("fwd", ref_fwd, k_fwd), ("fwd+bwd", ref_fb, k_fb)):
            ms_ref, ms_k = bc.bench(r_fn), bc.bench(k_fn)
            for backend, ms in (("reference", ms_ref), ("triton", ms_k)):
                rows.append(dict(kernel=op, backend=backend, shape=shape, direction=direction, ms=round(ms, 4),
                                 tflops=None, speedup=round(ms_ref / ms, 2), max_abs_diff=max(out_diff, grad_diff),
                                 **meta))
            print(f"  {direction:8s} reference {ms_ref:8.3f} ms   triton {ms_k:8.3f} ms   {ms_ref / ms_k:6.1f}x",
                  flush=True)
        torch.cuda.empty_cache()
    bc.write_results(rows, args.out)


if __name__ == "__main__":
    main()
