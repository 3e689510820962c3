"""Launch settings of the small triton kernels of the decode step, timed on one GPU inside CUDA graphs (as the
step replays them): the router (``kernels/triton/routing.py``), the pairs' expert order
(``kernels/triton/experts.py``), the sparse attention's forward for few tokens (``kernels/triton/attention.py``),
the indexer scores of one query a sequence (``kernels/triton/indexer.py``' few-query kernel, beside the head loop
it replaced), a layer's projections of its attention input and its grouped ``wo_a``
(``kernels/triton/linear_group.py``, beside the GEMMs they replace), a site's mHC pre with its norm
(``kernels/triton/mhc_decode.py``, beside the four kernels it replaces) and the split mHC pre of many tokens
(``kernels/triton/mhc.py``).

    python -m bench.kernels_decode_sweep --out FILE.json [--only route attention indexer linear_group projections wo_a
                                                                 many_tokens mhc mhc_rows mhc_split]

Why: in the eager Flash-shaped decode step (``bench.rollout --kernel-backend triton --profile-steps``) the router
took 26 us a layer at every batch, the expert order 31 us a layer at 256 sequences, and the attention 16 us a layer
at one sequence (``bench/results/rollout-h200-flash-shaped-triton-eager-route-order.json``), each far from the
bytes it reads. Each setting of a small grid is timed with ``triton.testing.do_bench_cudagraph`` (one replay of a
graph of the launch, so the host's launch time is not counted) at the step's shapes: 1, 64 and 256 tokens;
the router over the Flash-shaped model's 32 experts and V4-Flash's 256 (``d = 4096``, top 6), the order of their
pairs, the attention of 64 heads of 512 over 128 (a window) and 640 gathered rows (a window and the indexer's 512), and
the split of one to 16 tokens' 640 rows over programs; the router's one-pass settings (``SPLIT=1``) and its split
over channel ranges (``SPLIT`` 1 to 32 at the launch settings, ``routing.split_of``).
Each output is compared with the launch settings' (``equal`` bits, ``close`` within bf16 rounding). The sweep only
measures; the settings change by hand.
"""

from __future__ import annotations

import itertools
import json

import torch

from bench import kernels_common as bc


def _time(fn) -> float:
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3           # us


def _agree(got, ref) -> str:
    got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
    if all(torch.equal(a, b) for a, b in zip(got, ref)):
        return "equal"
    return "close" if all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(got, ref)) \
        else "differ"


def _sweep(label, fn, configs, default, meta, per: int = 1, **shape):
    """Time ``fn(config)`` for the launch settings (``config`` None) and each of ``configs``; rows for each. ``per``:
    the launches one call of ``fn`` makes (each row's time is one launch's)."""
    ref = fn(None)
    us_default = _time(lambda: fn(None)) / per
    print(f"== {label} {shape}: launch settings {default} {us_default:.1f} us", flush=True)
    rows = [dict(kernel=label, config=default, us=round(us_default, 2), vs_default="default", **shape, **meta)]
    for cfg in configs:
        try:
            got = fn(cfg)
            us = _time(lambda: fn(cfg)) / per
        except Exception as e:                                      # e.g. out of shared memory: recorded, skipped
            rows.append(dict(kernel=label, config=cfg, error=f"{type(e).__name__}: {str(e)[:120]}", **shape, **meta))
            continue
        rows.append(dict(kernel=label, config=cfg, us=round(us, 2), vs_default=_agree(got, ref), **shape, **meta))
    for r in sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:4]:
        print(f"  {r['us']:8.2f} us {r['vs_default']:8s} {r['config']}", flush=True)
    return rows


def _attention_case(T: int, K: int, g, dev, H: int = 64, D: int = 512):
    """``(q, kv, idx, sink)`` of ``T`` tokens of ``H`` heads, each over ``K`` rows of its own (a decode step's
    sequences share no cache rows), in a random order."""
    q = torch.randn(T, H, D, generator=g).bfloat16().to(dev)
    kv = torch.randn(T * K, D, generator=g).bfloat16().to(dev)
    idx = (torch.arange(T)[:, None] * K + torch.randperm(K, generator=g)[None, :]).to(torch.int32).to(dev)
    return q, kv, idx, torch.randn(H, generator=g).to(dev)


def _indexer_rows(g, dev, meta, H: int = 64, D: int = 128) -> list:
    """The indexer scores of one query a sequence (a decode step) at 1, 64 and 256 sequences over 80 and 512
    entries: the few-query kernel's settings (``heads_BN``, ``heads_warps``), and the head loop the call took
    before it (``head_loop_us``)."""
    from kernels.triton import indexer as I

    grid = [dict(heads_BN=bn, heads_warps=wp) for bn, wp in itertools.product([32, 64, 128], [2, 4, 8])]
    rows = []
    for B, N in itertools.product((1, 64, 256), (80, 512)):
        q = torch.randn(B, 1, H, D, generator=g).bfloat16().to(dev)
        k = torch.randn(B, N, D, generator=g).bfloat16().to(dev)
        w = (torch.randn(B, 1, H, generator=g) * (H * D) ** -0.5).to(dev)
        default = {key: I.INDEXER_CONFIG[key] for key in grid[0]}
        got = _sweep("indexer_scores", lambda c: I.indexer_scores_launch(q, k, w, None, None, c), grid, default,
                     meta, sequences=B, entries=N)
        us = _time(lambda: I.indexer_scores_launch(q, k, w, None, None, dict(heads_below=0)))
        print(f"  the head loop: {us:.1f} us")
        got[0]["head_loop_us"] = round(us, 2)
        rows += got
    return rows


COPIES = 4          # weight sets a timed linear_group graph cycles through (L2-cold, as in a decode step)


def _linear_group_rows(g, dev, meta, d: int = 4096) -> list:
    """``linear_group`` of a Flash CSA layer's attention input (``wq_a``, ``wkv``, two compressors' ``wkv`` and
    ``wgate`` with fp32 results, ``weights_proj``) and a window layer's (``wq_a``, ``wkv``) at 1 and 16 tokens: the
    kernel's settings (``SPLIT``: shares of K), and the GEMMs it replaces, one a weight (``gemms_us``, the torch
    contract). Each timed graph runs :data:`COPIES` launches on as many copies of the weights (130 MB): in a decode
    step the weights come from HBM, where one set (32.5 MB) replayed alone stays in the H100's and H200's 50 MB L2
    (a first sweep that way timed 9.81 us a launch where the step's profile had about 16)."""
    layers = {"csa": ((1024, 512, 1024, 1024, 256, 256, 64), [False, False, True, True, True, True, False]),
              "window": ((1024, 512), [False, False])}            # a window layer's wq_a and wkv: fewer programs
    grid = [dict(BN=bn, BK=bk, warps=4, stages=st, SPLIT=sp)
            for bn, bk, st, sp in itertools.product([16, 32], [128, 256], [3, 4], [1, 2, 4, 8])]
    return [r for layer, (rows_of, fp32) in layers.items()
            for r in _group_rows(g, dev, meta, rows_of, fp32, d, COPIES, grid, layer=layer)]


def _product_settings(L, T: int, grid) -> dict:
    """The launch settings ``kernels.triton.linear_group`` takes for ``T`` rows (``token_settings``; above its
    token limits the one-to-16-token ones), as ``grid``'s keys: the sweep's default row."""
    cfg = L.token_settings(T) or L.LINEAR_GROUP_CONFIG
    return {k: cfg[k] for k in grid[0]}


def _group_rows(g, dev, meta, rows_of, fp32, d: int, copies: int, grid, tokens=(1, 16), **shape) -> list:
    """``linear_group`` of weights ``[n, d]`` for ``n`` in ``rows_of`` at each of ``tokens`` over ``grid``, each timed
    graph cycling through ``copies`` copies of the weights (read from HBM, as in a decode step), and the GEMMs one
    by one, cuBLAS's (``gemms_us`` on the launch settings' row). The launcher itself runs, whatever the settings'
    ``max_tokens``; its default is the settings the decode step takes for ``T`` rows."""
    from kernels.reference.linear_group import linear_group as gemms
    from kernels.triton import linear_group as L

    sets = [[(torch.randn(n, d, generator=g) * d ** -0.5).bfloat16().to(dev) for n in rows_of] for _ in range(copies)]
    rows = []
    for T in tokens:
        default = _product_settings(L, T, grid)
        x = torch.randn(T, d, generator=g).bfloat16().to(dev)
        got = _sweep("linear_group", lambda c: tuple(y for ws in sets for y in L.linear_group_launch(x, ws, fp32, c)),
                     grid, default, meta, per=copies, tokens=T, weight_copies=copies, **shape)
        us = _time(lambda: [gemms(x, ws, fp32) for ws in sets]) / copies
        print(f"  the GEMMs one by one: {us:.1f} us")
        got[0]["gemms_us"] = round(us, 2)
        rows += got
    return rows


def _projection_rows(g, dev, meta) -> list:
    """The attention's large projections of one token through ``linear_group`` (the query's ``wq_b`` with a CSA
    layer's indexer ``wq_b``, both of the query's low rank; ``wo_b``) and the output head (fp32 logits, as
    ``linear_fp32``) against cuBLAS's GEMMs one by one
    (``gemms_us``), at 1 and 16 tokens, two copies of the weights a timed graph (each past the 50 MB L2): whether
    the decode step should send them to the kernel (cuBLAS read them at about 77% of an H100's bandwidth at one
    token, ``bench/results/rollout-h100-flash-shaped-triton-profile-hc-pre-norm.json``)."""
    grid = [dict(BN=bn, BK=256, warps=4, stages=st, SPLIT=sp)
            for bn, st, sp in itertools.product([32, 64], [3, 4], [1, 2, 4])]
    return [r for name, rows_of, d, f32 in (("wq_b+indexer_wq_b", (32768, 8192), 1024, False),
                                            ("wo_b", (4096,), 8192, False), ("head", (129280,), 4096, True))
            for r in _group_rows(g, dev, meta, rows_of, [f32] * len(rows_of), d, 2, grid, projection=name)]


def _wo_a_rows(g, dev, meta, G: int = 8, R: int = 1024, d: int = 4096, copies: int = 2, tokens=(1, 16),
               grid=None) -> list:
    """A Flash layer's grouped ``wo_a`` (8 groups of ``[1024, 4096]``, 64 MiB) through ``grouped_projection``
    (``kernels/triton/linear_group.py``) against the batched GEMM it replaces (``bmm_us``: the torch contract,
    ``kernels.reference.layers.grouped_projection``), at each of ``tokens``, ``copies`` weight sets a timed graph
    (a setting's ``max_tokens`` above the settings' sends more tokens to the kernel)."""
    from kernels.reference.layers import grouped_projection as bmm
    from kernels.triton import linear_group as L

    grid = grid or [dict(BN=bn, BK=256, warps=4, stages=st, SPLIT=sp)
                    for bn, st, sp in itertools.product([32, 64], [3, 4], [1, 2, 4])]
    sets = [(torch.randn(G, R, d, generator=g) * d ** -0.5).bfloat16().to(dev) for _ in range(copies)]
    rows = []
    for T in tokens:
        default = _product_settings(L, T, grid)
        o = torch.randn(T, 1, G, d, generator=g).bfloat16().to(dev)
        got = _sweep("grouped_projection", lambda c: tuple(L.grouped_projection(o, w, c) for w in sets), grid,
                     default, meta, per=copies, tokens=T, weight_copies=copies, projection="wo_a")
        us = _time(lambda: [bmm(o, w) for w in sets]) / copies
        print(f"  the batched GEMM: {us:.1f} us")
        got[0]["bmm_us"] = round(us, 2)
        rows += got
    return rows


def _many_token_rows(g, dev, meta, tokens=(64,)) -> list:
    """The projections of 64 tokens (a GRPO step's 64 samples) through the weight-streaming kernels over a grid
    around ``kernels.triton.linear_group.MANY_TOKENS_CONFIG`` (where cuBLAS's GEMMs ran them): a Flash
    CSA layer's attention-input group, the query's ``wq_b`` with the indexer's, ``wo_b`` (``linear_group``) and
    the grouped ``wo_a`` (``grouped_projection``), against cuBLAS (``gemms_us``, ``bmm_us``). At
    64 tokens a Flash-shaped layer's projections are about 13 GFLOP over 205 MB of weights, bandwidth-bound; on one
    H100 at 64 sequences cuBLAS's projection GEMMs took about 400 us of a 3.48 ms step
    (``bench/results/rollout-h100-flash-shaped-triton-linear-post-profile.json``)."""
    grid = [dict(BN=bn, BK=bk, warps=wp, stages=st, SPLIT=1, max_tokens=max(tokens))
            for bn, bk, st, wp in itertools.product([32, 64], [64, 128, 256], [3, 4], [4, 8])]
    rows = []
    for name, rows_of, fp32, d in (("csa", (1024, 512, 1024, 1024, 256, 256, 64),
                                    [False, False, True, True, True, True, False], 4096),
                                   ("wq_b+indexer_wq_b", (32768, 8192), [False, False], 1024),
                                   ("wo_b", (4096,), [False], 8192)):
        rows += _group_rows(g, dev, meta, rows_of, fp32, d, 2, grid, tokens=tokens, projection=name)
    return rows + _wo_a_rows(g, dev, meta, tokens=tokens, grid=grid)


def _mhc_rows(g, dev, meta, n: int = 4, d: int = 4096, tokens=(1, 2, 4, 64, 256)) -> list:
    """``hc_pre_norm`` (``kernels/triton/mhc_decode.py``) of a Flash block site: at 1 and 2 tokens the one-launch
    kernel's settings (its tail in one pass or in steps: ``one_pass``) and the four kernels it replaces
    (``four_us``: the split mixing GEMM, its sum, the coefficients, the norm; ``kernels.triton.mhc`` and
    ``kernels.triton.norm``); at 4, 64 and 256 tokens its two launches (``rows``: the split mixing GEMM, then a
    program a token; ``split_BT``, ``split_BK``: the GEMM's tokens and channels a step) against those four (``rows``
    off). ``tokens``: the counts timed (the section ``mhc_rows``: 4, 64 and 256 alone, the two-launch plan)."""
    from kernels.triton import mhc as KM
    from kernels.triton import mhc_decode as MD
    from kernels.triton import norm as KN

    rows_m = (2 + n) * n
    fn = (torch.randn(rows_m, n * d, generator=g) * (n * d) ** -0.5).to(dev)
    scale, base = (0.5 + torch.rand(3, generator=g)).to(dev), (torch.randn(rows_m, generator=g) * 0.5).to(dev)
    weight = (0.5 + torch.rand(d, generator=g)).to(dev)
    grid = [dict(programs=p, BK=bk, warps=wp, stages=st, one_pass=op)
            for p, bk, wp, st, op in itertools.product([64, 128, 256], [64, 128], [4, 8], [2, 3], [True, False])]
    rows = []
    for T in tokens:
        x = torch.randn(T, n, d, generator=g).bfloat16().to(dev)
        one = T <= MD.PRE_NORM_CONFIG["max_tokens"]
        cfgs = grid if one else [dict(rows=False)] + [dict(split_BT=bt, split_BK=bk)
                                                      for bt, bk in itertools.product([16, 32, 64], [32, 64])]
        default = {k: MD.PRE_NORM_CONFIG[k] for k in cfgs[0]}
        got = _sweep("hc_pre_norm", lambda c: MD.hc_pre_norm(x, fn, scale, base, 1e-6, 1e-6, 20, weight, 1e-6, c),
                     cfgs, default, meta, tokens=T)
        if one:
            def four():
                u = KM.hc_pre_fwd(x, fn, scale, base, 1e-6, 1e-6, 20)[0]
                return KN.rms_norm_launch(u, weight, 1e-6)

            us = _time(four)
            print(f"  the four kernels: {us:.1f} us")
            got[0]["four_us"] = round(us, 2)
            # the launch with one Sinkhorn iteration (the fewest the op takes): what the other 19 serial iterations
            # cost the one program that ends it
            us = _time(lambda: MD.hc_pre_norm(x, fn, scale, base, 1e-6, 1e-6, 1, weight, 1e-6))
            print(f"  one Sinkhorn iteration: {us:.1f} us")
            got[0]["one_sinkhorn_iter_us"] = round(us, 2)
        rows += got
    return rows


def _mhc_split_rows(g, dev, meta, n: int = 4, d: int = 4096) -> list:
    """The mHC pre of a Flash block site at 64 and 256 tokens, ``kernels.triton.mhc``'s split mixing GEMM, its sum
    and the coefficients (the decode step's before ``hc_pre_norm`` took many tokens too, and where its table lacks
    that op; 9 sites a Flash-shaped step took 186.28 us in the mixing GEMM at
    256 sequences on an H200, about 2 us of bytes each; ``bench/results/rollout-h200-flash-shaped-triton-profile-
    linear-group-head.json``): its programs (``mix_programs``, ``coef_programs``) and steps (``mix_BT``, ``mix_BK``)."""
    from kernels.triton import mhc as KM

    rows_m = (2 + n) * n
    fn = (torch.randn(rows_m, n * d, generator=g) * (n * d) ** -0.5).to(dev)
    scale, base = (0.5 + torch.rand(3, generator=g)).to(dev), (torch.randn(rows_m, generator=g) * 0.5).to(dev)
    grid = [dict(mix_programs=p, mix_BT=bt, mix_BK=bk, coef_programs=cp, mix_warps=wp)
            for p, bt, bk, cp, wp in itertools.product([128, 256, 512, 1024], [16, 32, 64], [64, 128], [256, 1024],
                                                       [4, 8])]
    rows = []
    for T in (64, 256):
        x = torch.randn(T, n, d, generator=g).bfloat16().to(dev)
        default = {k: KM.MHC_CONFIG[k] for k in grid[0]}
        rows += _sweep("hc_pre split", lambda c: KM.hc_pre_fwd(x, fn, scale, base, 1e-6, 1e-6, 20, c)[:3], grid,
                       default, meta, tokens=T)
    return rows


SECTIONS = ("route", "attention", "indexer", "linear_group", "projections", "wo_a", "many_tokens", "mhc", "mhc_rows",
            "mhc_split")


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--only", nargs="+", choices=SECTIONS,
                   default=[s for s in SECTIONS if s not in ("mhc_rows", "many_tokens")],
                   help="the kernels to time (default: all but mhc_rows, which mhc holds, and many_tokens, the "
                        "projections at 64 tokens; a run of all takes over 200 s on an H100)")
    known = bc.sweep_args(__doc__, argv, parents=[p])
    out = known.out
    import triton

    meta = bc.base_meta(triton=triton.__version__)
    dev, g = "cuda", torch.Generator().manual_seed(0)
    rows = []
    for name in SECTIONS:
        if name in known.only:
            rows += _SECTION_ROWS[name](g, dev, meta)
            with open(out, "w") as fh:          # after each section: a run stopped by a time limit keeps them
                json.dump(dict(bench="kernels_decode_sweep", rows=rows), fh, indent=1)
    print(f"wrote {out}")


def _route_rows(g, dev, meta) -> list:
    """The router's one-pass settings and its split over channel ranges, and the pairs' expert order."""
    import triton

    from kernels.triton import experts as KE
    from kernels.triton import routing as R

    rows = []
    route_grid = [dict(BD=bd, STAGES=st, WARPS=wp, SPLIT=1) for bd, st, wp in itertools.product([64, 128, 256, 512],
                                                                                               [1, 2, 3], [4, 8])]
    split_grid = [dict(SPLIT=n) for n in (1, 2, 4, 8, 16, 32)]          # the split router (routing.split_of)
    for E, T in itertools.product((32, 256), (1, 64, 256)):
        x = torch.randn(T, 4096, generator=g).bfloat16().to(dev)
        w = (torch.randn(E, 4096, generator=g) * 4096 ** -0.5).bfloat16().to(dev)
        bias = torch.randn(E, generator=g).to(dev) * 0.1
        BE = max(16, triton.next_power_of_2(E))
        rows += _sweep("route_experts", lambda c: R.route_experts_launch(x, w, bias, None, None, 6, 1.5,
                                                                         "sqrtsoftplus", c),
                       route_grid, {**R.launch_settings(BE), "SPLIT": R.split_of(T, 4096)}, meta, experts=E, tokens=T)
        rows += _sweep("route_experts_split", lambda c: R.route_experts_launch(x, w, bias, None, None, 6, 1.5,
                                                                               "sqrtsoftplus", c),
                       split_grid, {**R.launch_settings(BE), "SPLIT": R.split_of(T, 4096)}, meta, experts=E, tokens=T)
        flat = torch.randint(0, E, (T * 6,), generator=g).to(dev)
        us = _time(lambda: KE.expert_order_launch(flat, E))
        us_sort = _time(lambda: flat.sort(stable=True))
        print(f"== expert_order {E} experts, {T * 6} pairs: {us:.1f} us (torch's stable sort {us_sort:.1f} us)")
        rows.append(dict(kernel="expert_order", experts=E, pairs=T * 6, us=round(us, 2),
                         torch_stable_sort_us=round(us_sort, 2), **meta))
    return rows


def _attention_rows(g, dev, meta) -> list:
    """The few-token attention's head blocks, then one to 16 tokens' 640 rows split over programs, and one token's
    128 and 200 rows (a Flash-shaped step's window and CSA layers at 256 to 304 positions, unsplit by
    :func:`kernels.triton.attention.fwd_settings`: fewer than two tiles a split) in one or two tiles a split."""
    from kernels.triton import attention as A

    rows = []
    att_grid = [dict(BH=bh, BK=bk, num_warps=wp, num_stages=st)
                for bh, bk, wp, st in itertools.product([16, 32], [32, 64], [4, 8], [1, 2, 3])]
    H, D = 64, 512
    split_grid = [dict(A.FEW_TOKENS_CONFIG, SPLIT=sp) for sp in (1, 2, 3, 5, 10)]
    few_rows_grid = [dict(A.FEW_TOKENS_CONFIG, BK=bk, SPLIT=sp) for bk, sp in itertools.product([32, 64], [1, 2, 3, 4])]
    for label, T, K, grid in [("sparse_attention_fwd", T, K, att_grid)
                              for T, K in itertools.product((1, 64, 256), (128, 640))] + \
                             [("sparse_attention_fwd split", T, 640, split_grid) for T in (1, 4, 16)] + \
                             [("sparse_attention_fwd split", 1, K, few_rows_grid) for K in (128, 200)]:
        q, kv, idx, sink = _attention_case(T, K, g, dev, H, D)
        rows += _sweep(label, lambda c: A.sparse_attention_fwd(q, kv, idx, sink, D ** -0.5, c), grid,
                       A.fwd_settings(T, H, K), meta, tokens=T, heads=H, rows=K)
    return rows


_SECTION_ROWS = {"route": _route_rows, "attention": _attention_rows, "indexer": _indexer_rows,
                 "linear_group": _linear_group_rows, "projections": _projection_rows, "wo_a": _wo_a_rows,
                 "many_tokens": _many_token_rows,
                 "mhc": _mhc_rows, "mhc_rows": lambda g, dev, meta: _mhc_rows(g, dev, meta, tokens=(4, 64, 256)),
                 "mhc_split": _mhc_split_rows}


if __name__ == "__main__":
    main()
