"""The routed experts' weight gradient into the fp32 main-grad buffer: today's two passes against one kernel.

    python -m bench.kernels_grouped_wgrad --out FILE.json [--sweep] [--weights w1 w2] [--rows 24576 49152]

Why: a training step writes the bf16 gradient of the stacked expert weights (``torch._grouped_mm``'s backward in
``engine.moe.grouped_linear``) and then casts or adds it into megatron-core's fp32 ``main_grad``
(``kernels.triton.grad_copy.cast_into``, from ``engine.grad_buffers``); ``kernels.triton.grouped_wgrad`` sums the
products into the fp32 buffer directly. At the Flash-shaped sizes (32 experts; w1 ``[4096, 4096]``, w2
``[4096, 2048]``; 24576 and 49152 routed rows spread unevenly, three experts empty) this times

* ``grouped_mm``: the bf16 ``[E, O, I]`` weight gradient (``torch._grouped_mm(g.t(), x, offs=ends)``, grouped
  along the rows; where torch refuses that call, the weight part of autograd through the forward's
  ``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)``; the row says which);
* ``cast_add`` / ``cast_copy``: ``cast_into(main, grad, accumulate=True / False)``, a later micro-batch's add and
  the first one's copy;
* ``today`` / ``today_first``: the GEMM and the add / the copy in a row; ``kernel_add`` / ``kernel_overwrite``:
  ``grouped_wgrad_into`` with ``accumulate`` True / False (the default launch settings,
  ``kernels.triton.grouped_wgrad.CONFIGS``), to compare with ``today`` / ``today_first``.

It prints ms, TFLOP/s (``2 * rows * O * I`` FLOPs; GB/s for the cast passes, which do no GEMM: per element 2 bytes
read and 4 written, and 4 more read by the add) and the fraction of the H200's dense bf16 peak (989 TFLOP/s),
and checks the kernel against today's path (they differ by today's bf16 rounding of the gradient). ``--sweep``
also times a few launch settings of the kernel (accumulate) per shape, each compared with the defaults' result.
Timing: ``triton.testing.do_bench`` (median, L2 flushed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys

import torch

from bench import kernels_common as bc

E = 32
SHAPES = {"w1": (4096, 4096), "w2": (4096, 2048)}
ROWS = (4096 * 6, 8192 * 6)
EMPTY = (0, 13, 31)
PEAK_TFLOPS = 989.0          # H200 SXM dense bf16 tensor-core peak
SWEEP = [dict(BLOCK_O=bo, BLOCK_I=bi, BLOCK_K=bk, num_warps=w, num_stages=s)
         for (bo, bi), bk, w, s in itertools.product([(128, 128), (128, 256), (256, 128), (64, 128)], [32, 64],
                                                     [4, 8], [3, 4])]


def _inputs(O: int, I: int, rows: int, seed: int):
    """bf16 ``x [rows, I]``, ``g [rows, O]``, int32 ``ends [E]`` (uneven, the experts in EMPTY with no rows) and an
    fp32 ``main [E, O, I]``, on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(E, generator=gen), 0)
    probs[list(EMPTY)] = 0
    counts = torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen), minlength=E)
    x = torch.randn(rows, I, device="cuda").bfloat16()
    g = torch.randn(rows, O, device="cuda").bfloat16()
    main = torch.randn(E, O, I, device="cuda")
    return x, g, counts.cumsum(0).to(torch.int32).cuda(), main, counts


def _grouped_mm_wgrad(x, g, ends):
    """``(fn, how)``: ``fn()`` returns the bf16 ``[E, O, I]`` weight gradient the way a training step gets it."""
    w = torch.zeros(E, g.shape[1], x.shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def autograd():
        h = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
        return torch.autograd.grad(h, w, g)[0]

    want = autograd()
    try:
        direct = torch._grouped_mm(g.t(), x, offs=ends)
        if direct.shape == want.shape and torch.equal(direct, want):
            return (lambda: torch._grouped_mm(g.t(), x, offs=ends)), "grouped_mm(g.t(), x)"
        print(f"  grouped_mm(g.t(), x) differs from autograd's ({bc.maxdiff(direct, want):.3g}); timing autograd")
    except (RuntimeError, ValueError) as err:
        print(f"  grouped_mm(g.t(), x) refused ({str(err).splitlines()[0]}); timing autograd")
    return autograd, "autograd through grouped_mm(x, w^T)"


def _row(meta, weight, O, I, rows, path, ms, flop, **extra):
    """One JSON row; ``flop`` None for a pass that does no GEMM (the cast passes: their rows have GB/s instead)."""
    tflops = None if flop is None else flop / ms / 1e9
    return dict(bench="kernels_grouped_wgrad", weight=weight, E=E, O=O, I=I, rows=rows, path=path, ms=round(ms, 4),
                tflops=None if tflops is None else round(tflops, 1),
                peak_fraction=None if tflops is None else round(tflops / PEAK_TFLOPS, 3), **extra, **meta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--sweep", action="store_true", help="also time the launch settings in SWEEP")
    p.add_argument("--weights", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES), help="which weights")
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS), help="routed rows per case")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU and triton")
    import triton

    from kernels.triton.grad_copy import cast_into
    from kernels.triton.grouped_wgrad import grouped_wgrad_into, launch_config
    from kernels.wgrad import grouped_wgrad_gemms

    torch.manual_seed(0)
    meta = bc.base_meta(triton=triton.__version__, host=platform.node())
    rows_out = []
    print(f"{'weight':6s} {'rows':>6s} {'path':18s} {'ms':>8s} {'TFLOP/s':>8s} {'of peak':>8s}")
    for weight, rows in itertools.product(args.weights, args.rows):
        O, I = SHAPES[weight]
        x, g, ends, main, counts = _inputs(O, I, rows, seed=rows + O + I)
        flop = 2.0 * int(counts.sum()) * O * I
        wgrad, how = _grouped_mm_wgrad(x, g, ends)
        grad = wgrad()
        flat_main, flat_grad = main.view(-1), grad.view(-1)
        bounds = [0] + ends.tolist()          # the per-expert GEMMs' row bounds (the trainer copies them in the forward)

        # agreement: today's fp32 result (bf16 gradient added) against the kernel's (fp32 sums added)
        today_out = main.clone().add_(grad)
        kernel_out = main.clone()
        grouped_wgrad_into(kernel_out, x, g, ends, True)
        scale = (today_out - main).abs().amax().item()
        diff = bc.maxdiff(today_out, kernel_out) / max(scale, 1e-30)
        del today_out, kernel_out

        timed = {
            "grouped_mm": (wgrad, dict(how=how)),
            "cast_add": (lambda: cast_into(flat_main, flat_grad, True), dict(bytes=E * O * I * (2 + 4 + 4))),
            "cast_copy": (lambda: cast_into(flat_main, flat_grad, False), dict(bytes=E * O * I * (2 + 4))),
            "today": (lambda: cast_into(flat_main, wgrad().view(-1), True), dict(how=how)),
            "today_first": (lambda: cast_into(flat_main, wgrad().view(-1), False), dict(how=how)),
            "kernel_add": (lambda: grouped_wgrad_into(main, x, g, ends, True), dict(config=launch_config(O, I))),
            "gemms_add": (lambda: grouped_wgrad_gemms(main, x, g, bounds, True), {}),
            "gemms_overwrite": (lambda: grouped_wgrad_gemms(main, x, g, bounds, False), {}),
            "kernel_overwrite": (lambda: grouped_wgrad_into(main, x, g, ends, False),
                                 dict(config=launch_config(O, I))),
        }
        for path, (fn, extra) in timed.items():
            ms = bc.bench(fn, rep=100)
            cast = path.startswith("cast")
            row = _row(meta, weight, O, I, rows, path, ms, None if cast else flop, **extra)
            if path.startswith("kernel"):
                row["max_diff_vs_today_of_max_grad"] = diff
            if cast:
                row["gbps"] = round(extra["bytes"] / ms / 1e6, 1)
            rows_out.append(row)
            rate = (f"{row['gbps']:8.0f} GB/s" if row["tflops"] is None
                    else f"{row['tflops']:8.1f} {row['peak_fraction']:8.1%}")
            print(f"{weight:6s} {rows:6d} {path:18s} {ms:8.3f} {rate}", flush=True)
        print(f"  kernel vs today: max |diff| {diff:.2e} of the largest gradient element ({how})", flush=True)

        if args.sweep:
            ref = main.clone().zero_()
            grouped_wgrad_into(ref, x, g, ends, False)
            for cfg in SWEEP:
                out = torch.empty_like(main)
                try:
                    grouped_wgrad_into(out, x, g, ends, False, config=cfg)
                except Exception as err:            # settings the compiler cannot fit (shared memory, registers)
                    print(f"  sweep {cfg}: failed ({type(err).__name__})", flush=True)
                    continue
                agree = bc.maxdiff(out, ref) / max(ref.abs().amax().item(), 1e-30)
                ms = bc.bench(lambda: grouped_wgrad_into(main, x, g, ends, True, config=cfg), rep=50)
                row = _row(meta, weight, O, I, rows, "sweep_add", ms, flop, config=cfg, max_diff_vs_default=agree)
                rows_out.append(row)
                print(f"  sweep {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s {row['peak_fraction']:6.1%} "
                      f"diff {agree:.1e} {cfg}", flush=True)
        del x, g, main, grad, flat_grad, flat_main
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(rows_out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
