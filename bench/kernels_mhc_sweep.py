"""Launch settings of the triton mHC backward kernels at one Flash-shaped site, timed and checked on one GPU.

    python -m bench.kernels_mhc_sweep --out FILE.json

Why: ``kernels.triton.mhc.MHC_CONFIG`` was first chosen so that ptxas reports no register spills; the profile of
``dsv4 train`` then showed ``hc_post``'s backward at 7.1-7.7 ms of a 178 ms step, about a tenth of the HBM
bandwidth for the bytes it moves. This sweeps the settings of the two backward launchers that the step's budget
names (``hc_post_bwd``: ``post_bwd_*``; ``hc_pre_bwd``: ``dx_*`` and ``coef_*``) over the streams ``x [T, n, d]``
(bf16, T 4096, n 4, d 4096, 20 Sinkhorn rounds), times each (``triton.testing.do_bench``, median) and compares its
outputs with those of the default settings: ``equal`` where every output has the same bits, ``close`` where they
agree to fp32 rounding (a reduction in another grouping: ``dpost``, ``dcomb``, the coefficients). The sweep only
measures; the defaults in ``MHC_CONFIG`` change by hand, after ``tests/kernels/test_mhc_gpu.py`` holds the new
ones to the fp64 reference.
"""

from __future__ import annotations

import itertools
import json

import torch

from bench import kernels_common as bc

T, N, D, ITERS, EPS = 4096, 4, 4096, 20, 1e-6


def _post_case():
    from kernels.triton import mhc as K

    f = torch.randn(T, D, device="cuda").bfloat16()
    x = torch.randn(T, N, D, device="cuda").bfloat16()
    post = 2 * torch.sigmoid(torch.randn(T, N, device="cuda"))
    comb = torch.softmax(torch.randn(T, N, N, device="cuda"), -1)
    g = torch.randn(T, N, D, device="cuda").bfloat16()
    configs = [dict(post_bwd_BT=bt, post_bwd_BD=bd, post_bwd_warps=w)
               for bt, bd, w in itertools.product([4, 8, 16], [64, 128], [4, 8])]
    return (lambda cfg: K.hc_post_bwd(f, x, post, comb, g, config=cfg)), configs


def _pre_case():
    from kernels.triton import mhc as K

    x = torch.randn(T, N, D, device="cuda").bfloat16()
    M = (2 + N) * N
    fn = torch.randn(M, N * D, device="cuda") * (N * D) ** -0.5
    scale, base = 0.5 + torch.rand(3, device="cuda"), torch.randn(M, device="cuda") * 0.5
    _, _, _, pre, mix, rho = K.hc_pre_fwd(x, fn, scale, base, EPS, EPS, ITERS)
    du = torch.randn(T, D, device="cuda").bfloat16()
    dpost, dcomb = torch.randn(T, N, device="cuda"), torch.randn(T, N, N, device="cuda")
    configs = [dict(dx_BT=bt, dx_BK=bk, dx_warps=w) for bt, bk, w in itertools.product([32, 64], [64, 128, 256], [4, 8])]
    configs += [dict(coef_BT=bt, coef_BD=bd, coef_warps=4) for bt, bd in itertools.product([4, 8, 16], [64, 128])]
    return (lambda cfg: K.hc_pre_bwd(x, fn, scale, base, pre, mix, rho, du, dpost, dcomb, EPS, ITERS, config=cfg)), configs


def _agreement(got, ref) -> str:
    if all(torch.equal(a, b) for a, b in zip(got, ref)):
        return "equal"
    close = all(torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3) for a, b in zip(got, ref))
    return "close" if close else "differ"


def main(argv=None):
    out = bc.sweep_args(__doc__, argv).out
    import triton

    from kernels.triton import mhc as K

    torch.manual_seed(0)
    meta = bc.base_meta(triton=triton.__version__)
    rows = []
    for op, case in (("hc_post_bwd", _post_case), ("hc_pre_bwd", _pre_case)):
        run, configs = case()
        ref = run(None)
        us_default = bc.bench(lambda: run(None), rep=30) * 1e3
        print(f"== {op}: default settings {us_default:.1f} us", flush=True)
        for cfg in configs:
            us = bc.bench(lambda: run(cfg), rep=30) * 1e3
            rows.append(dict(op=op, config=cfg, us=round(us, 1), vs_default=_agreement(run(cfg), ref),
                             default_us=round(us_default, 1), **meta))
        for r in sorted((r for r in rows if r["op"] == op), key=lambda r: r["us"])[:6]:
            print(f"  {r['us']:8.1f} us  {r['vs_default']:6s} {r['config']}", flush=True)
    with open(out, "w") as fh:
        json.dump(dict(bench="kernels_mhc_sweep", shape=f"T={T} n={N} d={D} iters={ITERS}",
                       defaults={k: v for k, v in K.MHC_CONFIG.items() if k.startswith(("post_bwd_", "dx_", "coef_"))},
                       rows=rows), fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
