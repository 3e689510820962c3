"""The triton backend's ``hc_pre_norm`` and ``hc_head_norm`` (``kernels/triton/mhc_decode.py``: a decode site's mHC
pre and its sublayer's norm, or the head's collapse and the final norm, in one launch, the split mixing GEMM's last
program doing the rest) against the reference contracts ``kernels.reference.mhc.hc_pre_norm`` (``hc_pre``, then
``rms_norm`` of ``u``) and ``hc_head_norm``.

Oracle: the reference in fp64 on the same bf16-valued inputs; ``y`` within a bf16 rounding step (two under the
interpreter, which truncates) of the oracle's largest value and no further than the fp32 reference op itself,
``post`` and ``comb`` within ``FP32_REL``. The one-launch plan serves up to ``max_tokens`` tokens and the split
kernels above it (asserted by which launcher runs); the ticket counter is back at 0 after every launch, and a
CUDA graph of the op replays to the same bits. On a GPU at the Flash-shaped sizes too; with no GPU,
``TRITON_INTERPRET=1`` runs the small shapes on the CPU; ``test_kernel_compiles_for_sm90`` compiles it for
sm_90 with triton alone."""

import os

import pytest
import torch

from kernels.triton.tickets import counters

from ._backends import compiles_for_sm90_without_spills, triton_device

pytestmark = pytest.mark.gpu

FP32_REL = 1e-4
ITERS, NORM_EPS, HC_EPS, RMS_EPS = 20, 1e-6, 1e-6, 1e-6


def _inputs(T, n, d, seed=0, weight_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = (2 + n) * n
    x = torch.randn(T, 1, n, d, generator=g).bfloat16()
    fn = torch.randn(rows, n * d, generator=g) * (n * d) ** -0.5
    scale = 0.5 + torch.rand(3, generator=g)
    base = torch.randn(rows, generator=g) * 0.5
    weight = (0.5 + torch.rand(d, generator=g)).to(weight_dtype)
    return x, fn, scale, base, weight


def _run(fn, inputs, dev):
    x, mapping, scale, base, weight = [t.to(dev) for t in inputs]
    return fn(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS)


def _small_and_flash():
    # d 300 and 1100: the one launch's tail holds u in registers (tail_plan); d 2100 at two tokens: it takes its u
    # loop in three steps; 3, 4 and 6 tokens take the split kernels
    small = [pytest.param(T, 4, 300, id=f"T{T}-d300") for T in (1, 2, 3, 4, 6)] + \
        [pytest.param(2, 4, d, id=f"T2-d{d}") for d in (1100, 2100)]
    flash = [pytest.param(T, 4, 4096, id=f"flash-T{T}", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="Flash shape: GPU only")) for T in (1, 2, 4, 64)]
    return small + flash


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, n, d", _small_and_flash())
def test_hc_pre_norm_matches_reference(T, n, d, weight_dtype):
    dev = triton_device()
    from kernels.reference import mhc as R
    from kernels.triton import mhc_decode as K

    inputs = _inputs(T, n, d, weight_dtype=weight_dtype)
    got = _run(K.hc_pre_norm, inputs, dev)
    ref = _run(R.hc_pre_norm, inputs, dev)
    x, mapping, scale, base, weight = inputs
    oracle = R.hc_pre_norm(x.double(), mapping.double(), scale.double(), base.double(), NORM_EPS, HC_EPS, ITERS,
                           weight.double(), RMS_EPS)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    for name, a, r, o in zip(("y", "post", "comb"), got, ref, oracle):
        assert a.dtype == r.dtype and a.shape == r.shape, (name, a.dtype, r.dtype, a.shape, r.shape)
        top = o.abs().max().item()
        err = (a.cpu().double() - o).abs().max().item() / top
        err_ref = (r.cpu().double() - o).abs().max().item() / top
        bound = (2 if interpreted else 1) * 2.0 ** -7 if name == "y" else FP32_REL
        print(f"  {name}: kernel {err:.2e} reference {err_ref:.2e} (bound {bound:.0e})")
        assert torch.isfinite(a).all() and err <= max(bound, err_ref), (name, err, err_ref)
    assert not counters(torch.device(dev), 1).any()                     # set back for the next launch


@pytest.mark.parametrize("T, n, d", _small_and_flash())
def test_hc_head_norm_matches_reference(T, n, d):
    """The head's collapse and the final norm: the same kernel without the residual coefficients."""
    dev = triton_device()
    from kernels.reference import mhc as R
    from kernels.triton import mhc_decode as K

    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, 1, n, d, generator=g).bfloat16()
    inputs = [x, torch.randn(n, n * d, generator=g) * (n * d) ** -0.5, 0.5 + torch.rand(1, generator=g),
              torch.randn(n, generator=g) * 0.5]
    weight = 0.5 + torch.rand(d, generator=g)
    got = K.hc_head_norm(*[t.to(dev) for t in inputs], NORM_EPS, HC_EPS, weight.to(dev), RMS_EPS)
    ref = R.hc_head_norm(*[t.to(dev) for t in inputs], NORM_EPS, HC_EPS, weight.to(dev), RMS_EPS)
    oracle = R.hc_head_norm(*[t.double() for t in inputs], NORM_EPS, HC_EPS, weight.double(), RMS_EPS)
    top = oracle.abs().max().item()
    err = (got.cpu().double() - oracle).abs().max().item() / top
    err_ref = (ref.cpu().double() - oracle).abs().max().item() / top
    bound = (2 if os.environ.get("TRITON_INTERPRET") == "1" else 1) * 2.0 ** -7
    assert got.dtype == ref.dtype and got.shape == ref.shape == (T, 1, d)
    assert torch.isfinite(got).all() and err <= max(bound, err_ref), (err, err_ref)
    assert not counters(torch.device(dev), 1).any()


def test_the_tail_holds_u_in_registers_where_the_streams_fit():
    """One token of a Flash site (four streams of 4,096) in one pass; two tokens of it, or Pro's 7,168, in steps."""
    from kernels.triton import mhc_decode as K

    assert K.tail_plan(1, 4, 4096) == (True, 4096)
    assert K.tail_plan(2, 4, 4096) == (False, 1024)
    assert K.tail_plan(1, 4, 7168) == (False, 2048)
    assert K.tail_plan(2, 4, 2100) == (False, 1024)
    assert K.tail_plan(1, 4, 4096, dict(one_pass=False)) == (False, 2048)


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("T, n, d", [(1, 4, 300), (2, 4, 300), (3, 4, 300), (6, 4, 300)])
def test_one_launch_up_to_max_tokens_two_above(monkeypatch, T, n, d, rows):
    """At most ``max_tokens`` tokens run the one launch; more the split mixing GEMM and a program a token
    (``rows``), or with ``rows`` off ``kernels.triton.mhc``'s ``hc_pre`` and the norm: the launchers that ran are
    counted, and each plan gives the same bits call after call."""
    dev = triton_device()
    from kernels.triton import mhc, mhc_decode as K

    assert K.PRE_NORM_CONFIG["max_tokens"] == 2
    ran = []
    for mod, name in ((K, "_launch"), (K, "_launch_rows"), (mhc, "hc_pre_fwd")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: ran.append(_n) or _r(*a, **k))
    inputs = [t.to(dev) for t in _inputs(T, n, d, seed=3)]
    x, mapping, scale, base, weight = inputs
    call = lambda: K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS,  # noqa: E731
                                 config=dict(rows=rows))
    y, post, comb = call()
    want = "_launch" if T <= 2 else "_launch_rows" if rows else "hc_pre_fwd"
    assert ran == [want], ran
    assert y.shape == (T, 1, d) and post.shape == (T, 1, n) and comb.shape == (T, 1, n, n)
    assert all(torch.equal(a, b) for a, b in zip((y, post, comb), call()))   # the partials summed in one order
    _assert_near_oracle((y, post, comb), inputs, rows)


@pytest.mark.parametrize("bt, bk", [(16, 64), (64, 32)])
def test_the_split_gemm_takes_the_launch_settings_token_and_channel_steps(monkeypatch, bt, bk):
    """Above ``max_tokens`` the split mixing GEMM's programs take ``split_BT`` tokens and ``split_BK`` channels a
    step (the launch settings' or the sweep's); either gives the reference's outputs."""
    dev = triton_device()
    from kernels.triton import mhc, mhc_decode as K

    seen = []
    real = mhc.mix_parts
    monkeypatch.setattr(mhc, "mix_parts", lambda x2, fn, MP, cfg, split: seen.append((cfg["mix_BT"], cfg["mix_BK"]))
                        or real(x2, fn, MP, cfg, split))
    inputs = [t.to(dev) for t in _inputs(6, 4, 300, seed=4)]
    x, mapping, scale, base, weight = inputs
    got = K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS,
                        config=dict(split_BT=bt, split_BK=bk))
    assert seen == [(bt, bk)]
    _assert_near_oracle(got, inputs, (bt, bk))


def _assert_near_oracle(got, inputs, label):
    """``got = (y, post, comb)`` against the reference ``hc_pre_norm`` in fp64 on the inputs' values: ``y`` within a
    bf16 rounding step (two under the interpreter) of the oracle's largest value, ``post`` and ``comb`` within
    ``FP32_REL``."""
    from kernels.reference import mhc as R

    x, mapping, scale, base, weight = [t.cpu().double() for t in inputs]
    oracle = R.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS)
    for name, a, o in zip(("y", "post", "comb"), got, oracle):
        bound = (2 if os.environ.get("TRITON_INTERPRET") == "1" else 1) * 2.0 ** -7 if name == "y" else FP32_REL
        assert (a.cpu().double() - o).abs().max().item() / o.abs().max().item() <= bound, (name, label)


def test_bad_inputs_are_refused():
    dev = triton_device()
    from kernels.triton import mhc_decode as K

    x, mapping, scale, base, weight = [t.to(dev) for t in _inputs(1, 4, 300)]
    with pytest.raises(ValueError, match="weight"):
        K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight[:-1], RMS_EPS)
    with pytest.raises(ValueError, match="weight"):
        K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight.double(), RMS_EPS)
    with pytest.raises(ValueError, match="gradient"):
        K.hc_pre_norm(x.float().requires_grad_().bfloat16(), mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight,
                      RMS_EPS)
    with pytest.raises(ValueError):                                  # the mapping's own checks (mhc_checks)
        K.hc_pre_norm(x, mapping[:-1], scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
def test_a_cuda_graph_of_the_op_replays_to_the_same_bits():
    """The decode step's use: captured once, replayed on new streams each step; the counter made before capture."""
    from kernels.triton import mhc_decode as K

    x, mapping, scale, base, weight = [t.cuda() for t in _inputs(1, 4, 4096, seed=5)]
    K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS)          # warm-up, the counter
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS)
    for seed in (6, 7, 6):
        x.copy_(_inputs(1, 4, 4096, seed=seed)[0].cuda())
        graph.replay()
        want = K.hc_pre_norm(x, mapping, scale, base, NORM_EPS, HC_EPS, ITERS, weight, RMS_EPS)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), seed
    torch.cuda.synchronize()
    assert not counters(x.device, 1).any()


def test_kernel_compiles_for_sm90_without_spills():
    """Each plan of the tail at a Flash site (one token's u in registers, two tokens' in steps, the head's without the
    residual coefficients), the program a token above ``max_tokens`` (Flash, its head, Pro's 7,168 in steps) and the
    split GEMM before it at its launch settings, with dependent launches off and on: ptxas for sm_90 spills no
    register."""
    from kernels.triton import mhc, mhc_decode as K

    c = K.PRE_NORM_CONFIG
    pointers = {"X": "*bf16", "Y": "*bf16", "TICKET": "*i32", **{a: "*fp32" for a in ("FN", "PART", "SSP", "MIXS",
                                                                                      "SCALE", "BASE", "W", "POST",
                                                                                      "COMB")}}
    types = {a: pointers.get(a, "fp32" if "eps" in a else "i32") for a in K._pre_norm_kernel.arg_names}
    for has_res, tb in ((True, 1), (True, 2), (False, 1)):
        one_pass, bd = K.tail_plan(tb, 4, 4096)
        consts = dict(HAS_RES=has_res, BT=c["BT"], BK=c["BK"], MP=32, PREC=mhc.PRECISION, STAGES=c["stages"], TB=tb,
                      NP=4, BD=bd, SB=mhc.FINISH_TILE // (32 * tb), ONE_PASS=one_pass)
        compiles_for_sm90_without_spills(K._pre_norm_kernel, types, consts, c["warps"])
    rows = {a: pointers.get(a, "fp32" if "eps" in a else "i32") for a in K._rows_kernel.arg_names}
    for has_res, d in ((True, 4096), (False, 4096), (True, 7168)):     # above max_tokens: a program a token
        one_pass, bd = K.tail_plan(1, 4, d)
        compiles_for_sm90_without_spills(K._rows_kernel, rows, dict(HAS_RES=has_res, MP=32, NP=4, BD=bd, SB=128,
                                                                    ONE_PASS=one_pass), c["warps"])
    m = mhc.MHC_CONFIG
    part = {a: pointers.get(a, "i32") for a in mhc._mix_part_kernel.arg_names}
    compiles_for_sm90_without_spills(mhc._mix_part_kernel, part, dict(BT=c["split_BT"], BK=c["split_BK"], MP=32,
                                                                      PREC=mhc.PRECISION, STAGES=m["mix_stages"]),
                                     m["mix_warps"])
