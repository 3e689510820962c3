"""The triton backend's fused mHC kernels (``sinkhorn``, ``hc_pre``, ``hc_post``, ``hc_head``; forward and
backward) against the reference ops of ``kernels.reference.mhc``.

Oracle: the reference op in fp64 on the same bf16-valued inputs (and the same upstream gradients). Bounds per
tensor, relative to the oracle's largest magnitude: bf16 outputs (``u``, ``y``, ``hc_post``'s output, ``dx``,
``df``) within ``BF16_REL`` (one bf16 rounding step at the largest value), fp32 outputs (``post``, ``comb``,
``dpost``, ``dcomb``, ``dfn``, ``dscale``, ``dbase``) within ``FP32_REL``; the reference op's own error is
printed beside. Where the reference op is itself further off (``sinkhorn`` on bf16 logits: the reference
computes in bf16, the kernel in fp32), the kernel must be no further off than it.

Shapes: on a GPU the Flash-shaped per-token shape (4096 tokens, hc_mult 4, hidden 4096, 20 Sinkhorn rounds)
and small ones with hc_mult 3 and 4 and hidden sizes that are not a multiple of the tile (the padded paths).
With no GPU, ``TRITON_INTERPRET=1`` runs the small shapes in Triton's CPU interpreter (which truncates fp32 ->
bf16 casts where the GPU rounds to nearest, so its bf16 errors are about twice the GPU's; the bounds hold for
both); otherwise those tests skip with the reason. ``test_kernels_compile_for_sm90`` compiles every kernel for
sm_90 with triton alone, no GPU.

The model tests (GPU only) build the tiny miles and megatron models with ``--kernel-backend triton``, run a
forward and backward, and assert through ``core.kernel_ops.kernels_ran`` that the triton mHC kernels ran and the
reference mHC ops did not; the loss and gradient norm match ``--kernel-backend none``.
"""

import importlib.util
import os

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu

BF16_REL, FP32_REL = 8e-3, 1e-4
ITERS, NORM_EPS, HC_EPS = 20, 1e-6, 1e-6
FLASH = dict(B=1, S=4096, n=4, d=4096)
DECODE = dict(B=64, S=1, n=4, d=4096)      # a decode step of 64 sequences: the mixing GEMM split over K
DECODE1 = dict(B=1, S=1, n=4, d=4096)      # and of one: 64 partial sums of one token
# the last two: five tokens and one over 300 columns, so the coefficient kernel splits d over three programs and
# the mixing GEMM K over five (a decode step's launch, small enough for the interpreter)
SMALL = [dict(B=2, S=19, n=3, d=80), dict(B=1, S=37, n=4, d=96), dict(B=5, S=1, n=4, d=300),
         dict(B=1, S=1, n=4, d=300)]


def _shapes():
    return [pytest.param(s, id=f"n{s['n']}-d{s['d']}-T{s['B'] * s['S']}") for s in SMALL] + \
        [pytest.param(shape, id=name, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="Flash shape: GPU only"))
         for shape, name in ((FLASH, "flash-T4096"), (DECODE, "decode-T64"), (DECODE1, "decode-T1"))]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=_gen(seed)) * scale


def _check(name, got, ref32, oracle, rel):
    """``got`` (kernel) and ``ref32`` (fp32 reference op) against the fp64 ``oracle``, relative to its max."""
    assert got.dtype == ref32.dtype and got.shape == ref32.shape, (name, got.dtype, ref32.dtype, got.shape)
    top = oracle.abs().max().item() + 1e-30
    err = (got.double() - oracle).abs().max().item() / top
    err_ref = (ref32.double() - oracle).abs().max().item() / top
    print(f"  {name:7s} kernel {err:.2e}  reference {err_ref:.2e}  (bound {rel:.0e})")
    assert torch.isfinite(got).all(), name
    assert err <= max(rel, err_ref), f"{name}: kernel error {err:.3e} > {rel} (reference op: {err_ref:.3e})"


def _grads(fn, inputs, grad_outputs):
    """Outputs and input gradients of ``fn(*inputs)`` (every floating input requires grad)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, [t for t in leaves if t.requires_grad], grad_outputs)
    return [o.detach() for o in outs], list(grads)


def _compare(kernel_fn, ref_fn, inputs, grad_outputs, names, dev):
    """Run the kernel on ``dev`` and the reference in fp32 and fp64 (on the CPU for fp64 of the small shapes)."""
    got_out, got_grad = _grads(kernel_fn, [t.to(dev) for t in inputs], [g.to(dev) for g in grad_outputs])
    ref_out, ref_grad = _grads(ref_fn, [t.to(dev) for t in inputs], [g.to(dev) for g in grad_outputs])
    up = [t.to(dev).double() for t in inputs]
    ora_out, ora_grad = _grads(ref_fn, up, [g.to(dev).double() for g in grad_outputs])
    for name, got, ref32, ora in zip(names, got_out + got_grad, ref_out + ref_grad, ora_out + ora_grad):
        _check(name, got, ref32, ora, BF16_REL if got.dtype in (torch.bfloat16, torch.float16) else FP32_REL)


def _mhc_inputs(B, S, n, d, rows, n_scale, seed=0):
    x = _rand(B, S, n, d, seed=seed).bfloat16()
    fn = _rand(rows, n * d, seed=seed + 1, scale=(n * d) ** -0.5)
    scale = 0.5 + torch.rand(n_scale, generator=_gen(seed + 2))
    base = _rand(rows, seed=seed + 3, scale=0.5)
    return x, fn, scale, base


@pytest.mark.parametrize("shape", _shapes())
def test_hc_pre_matches_reference(shape):
    dev = triton_device()
    from kernels.reference import mhc as R
    from kernels.triton import mhc as K

    B, S, n, d = shape["B"], shape["S"], shape["n"], shape["d"]
    x, fn, scale, base = _mhc_inputs(B, S, n, d, (2 + n) * n, 3)
    gouts = [_rand(B, S, d, seed=7).bfloat16(), _rand(B, S, n, seed=8), _rand(B, S, n, n, seed=9)]
    _compare(lambda *a: K.hc_pre(*a, NORM_EPS, HC_EPS, ITERS), lambda *a: R.hc_pre(*a, NORM_EPS, HC_EPS, ITERS),
             [x, fn, scale, base], gouts, ["u", "post", "comb", "dx", "dfn", "dscale", "dbase"], dev)


@pytest.mark.parametrize("shape", _shapes())
def test_hc_head_matches_reference(shape):
    dev = triton_device()
    from kernels.reference import mhc as R
    from kernels.triton import mhc as K

    B, S, n, d = shape["B"], shape["S"], shape["n"], shape["d"]
    x, fn, scale, base = _mhc_inputs(B, S, n, d, n, 1, seed=10)
    _compare(lambda *a: K.hc_head(*a, NORM_EPS, HC_EPS), lambda *a: R.hc_head(*a, NORM_EPS, HC_EPS),
             [x, fn, scale, base], [_rand(B, S, d, seed=11).bfloat16()], ["y", "dx", "dfn", "dscale", "dbase"], dev)


@pytest.mark.parametrize("f_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", _shapes())
def test_hc_post_matches_reference(shape, f_dtype):
    """``f`` (the sublayer output) may be fp32 as well; ``df`` comes back in its dtype."""
    dev = triton_device()
    from kernels.reference import mhc as R
    from kernels.triton import mhc as K

    B, S, n, d = shape["B"], shape["S"], shape["n"], shape["d"]
    f = _rand(B, S, d, seed=20).bfloat16().to(f_dtype)
    x = _rand(B, S, n, d, seed=21).bfloat16()
    post = 2 * torch.sigmoid(_rand(B, S, n, seed=22))
    comb = R.sinkhorn(_rand(B, S, n, n, seed=23), ITERS, HC_EPS)
    _compare(K.hc_post, R.hc_post, [f, x, post, comb], [_rand(B, S, n, d, seed=24).bfloat16()],
             ["out", "df", "dx", "dpost", "dcomb"], dev)


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinkhorn_matches_reference(n, dtype):
    dev = triton_device()
    from kernels.reference import mhc as R
    from kernels.triton import sinkhorn as K

    T = 4096 if dev == "cuda" else 50
    logits = _rand(2, T // 2, n, n, seed=30, scale=2.0).to(dtype)
    _compare(lambda c: K.sinkhorn(c, ITERS, HC_EPS), lambda c: R.sinkhorn(c, ITERS, HC_EPS), [logits],
             [_rand(2, T // 2, n, n, seed=31).to(dtype)], ["M", "dlogits"], dev)


def test_unsupported_inputs_are_refused():
    """No silent hand-off to the reference op: every input the kernels do not take raises with the reason."""
    dev = triton_device()
    from kernels.triton import mhc as K
    from kernels.triton import sinkhorn as KS

    x, fn, scale, base = (t.to(dev) for t in _mhc_inputs(1, 4, 4, 64, 24, 3))
    with pytest.raises(ValueError, match="bf16/fp16 streams.*--kernel-backend none"):
        K.hc_pre(x.float(), fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="fp32 fn"):
        K.hc_pre(x, fn.bfloat16(), scale, base, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match=r"fn \[24, 256\]"):
        K.hc_pre(x, fn[:, :128], scale, base, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="hc_mult 1..8"):
        K.hc_head(torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16, device=dev), torch.zeros(16, 128, device=dev),
                  scale[:1], torch.zeros(16, device=dev), NORM_EPS, HC_EPS)
    with pytest.raises(ValueError, match="fp32 post"):
        K.hc_post(x[:, :, 0], x, torch.ones(1, 4, 4, dtype=torch.bfloat16, device=dev),
                  torch.ones(1, 4, 4, 4, device=dev))
    with pytest.raises(ValueError, match="fp64"):
        KS.sinkhorn(torch.zeros(3, 4, 4, dtype=torch.float64, device=dev), ITERS, HC_EPS)
    if dev == "cuda":
        with pytest.raises(ValueError, match="need CUDA tensors"):
            K.hc_post(x[:, :, 0].cpu(), x.cpu(), torch.ones(1, 4, 4).cpu(), torch.ones(1, 4, 4, 4).cpu())


def test_op_table_names_the_triton_mhc_kernels():
    """The triton backend's table serves the four mHC ops itself (counted under ``triton.``)."""
    dev = triton_device()
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from kernels.triton.backend import ops

    table = ops()
    for name in ("sinkhorn", "hc_pre", "hc_post", "hc_head"):
        assert table.provider[name] == "triton", table.provider
    assert set(table.provider.values()) == {"triton"}, table.provider     # since the Hadamard kernel: every op
    reset_kernels_ran()
    x, fn, scale, base = (t.to(dev) for t in _mhc_inputs(1, 4, 4, 64, 24, 3))
    u, post, comb = table.hc_pre(x, fn, scale, base, NORM_EPS, HC_EPS, ITERS)
    table.hc_post(u, x, post, comb)
    table.sinkhorn(comb, ITERS, HC_EPS)
    ran = kernels_ran()
    assert ran.get("triton.hc_pre") == 1 and ran.get("triton.hc_post") == 1 and ran.get("triton.sinkhorn") == 1, ran


# ----------------------------------------------------------------------------------------------
# the tiny models, forward and backward (GPU)
# ----------------------------------------------------------------------------------------------

SEQ = 140
LOSS_TOL, GNORM_RTOL = 1e-2, 5e-2


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        pytest.skip("the model tests need a CUDA GPU and triton")
    from backends.nvidia.target import NvidiaTarget
    from core.checkpoint import prepare_checkpoint
    from core.config import preset

    tiny = preset("tiny")
    NvidiaTarget().init_process_group(0, 1, tp=1)
    return tiny, prepare_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny, dtype="bf16", seed=0)


def _loss_and_grad_norm(impl, backend, tiny, ckpt):
    from core.assembly import assemble
    from core.run_config import Choices, normalize
    from engine.loading import load_hf_checkpoint
    from launchers.builtin_plugins import make_host

    rc = normalize(Choices(impl=impl, kernel_backend=backend, hardware="nvidia", model=tiny),
                   make_host(third_party=False), model_name="tiny")
    torch.manual_seed(0)
    m = assemble(rc).build_model(tiny)
    load_hf_checkpoint(m, ckpt)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, tiny.vocab_size, (SEQ,), generator=_gen(3)).cuda()
    loss = -m.logprobs(ids if impl == "megatron" else ids[None]).float().mean()
    loss.backward()
    params = [p for p in m.parameters() if p.grad is not None]
    gnorm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
    return loss.item(), gnorm


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_model_forward_backward_runs_the_triton_mhc_kernels(tiny_ckpt, impl):
    from core.kernel_ops import kernels_ran, reset_kernels_ran

    tiny, ckpt = tiny_ckpt
    want = _loss_and_grad_norm(impl, "none", tiny, ckpt)
    reset_kernels_ran()
    loss, gnorm = _loss_and_grad_norm(impl, "triton", tiny, ckpt)
    ran = kernels_ran()
    print(f"\n{impl}: loss {loss:.6f} vs none {want[0]:.6f}, grad norm {gnorm:.6f} vs {want[1]:.6f}; ran {ran}")
    sites = 2 * tiny.n_layers
    assert ran.get("triton.hc_pre", 0) >= sites and ran.get("triton.hc_post", 0) >= sites, ran
    assert ran.get("triton.hc_head", 0) >= 1, ran
    assert not any(ran.get(f"none.{op}") for op in ("hc_pre", "hc_post", "hc_head", "sinkhorn")), ran
    assert abs(loss - want[0]) <= LOSS_TOL
    assert abs(gnorm - want[1]) <= GNORM_RTOL * want[1]


# ----------------------------------------------------------------------------------------------
# compiled for the GPU without one (the interpreter does not type-check like the compiler does)
# ----------------------------------------------------------------------------------------------


def test_kernels_compile_for_sm90():
    """Every mHC kernel, at its launch settings for hc_mult 4, compiles to PTX for sm_90 (H100/H200); needs
    triton only, no GPU. The interpreter runs code the compiler rejects (it found a branch whose two arms give
    a variable different shapes)."""
    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton import mhc as K
    from kernels.triton import sinkhorn as KS

    c = K.MHC_CONFIG
    p32, pb, i, f = "*fp32", "*bf16", "i32", "fp32"
    coef = dict(NP=4, MP=32, BT=c["coef_BT"], BD=c["coef_BD"])
    cases = [
        (K._mix_kernel, [pb, p32, p32, p32, i, i, i, f],
         dict(BT=c["mix_BT"], BK=c["mix_BK"], MP=32, PREC=K.PRECISION, STAGES=c["mix_stages"]), c["mix_warps"]),
        (K._mix_part_kernel, [pb, p32, p32, p32, i, i, i, i],
         dict(BT=c["mix_BT"], BK=c["mix_BK"], MP=32, PREC=K.PRECISION, STAGES=c["mix_stages"]), c["mix_warps"]),
        (K._mix_finish_kernel, [p32, p32, p32, p32, i, i, i, f], dict(BT=1, MP=32, SB=64), 4),     # decode: 1 token
        (K._mix_finish_kernel, [p32, p32, p32, p32, i, i, i, f], dict(BT=4, MP=32, SB=32), 4),     # 64 tokens
        (K._pre_fwd_kernel, [p32, p32, p32, pb, pb, p32, p32, p32, i, i, i, f, i, i], dict(HAS_RES=True, **coef),
         c["coef_warps"]),
        (K._pre_fwd_kernel, [p32, p32, p32, pb, pb, p32, p32, p32, i, i, i, f, i, i], dict(HAS_RES=False, **coef),
         c["coef_warps"]),
        (K._pre_bwd_kernel, [p32, p32, p32, p32, pb, pb, p32, p32, p32, p32, p32, i, i, i, f, i],
         dict(HAS_RES=True, **coef), c["coef_warps"]),
        (K._dx_kernel, [pb, pb, p32, p32, p32, p32, pb, i, i, i, i],
         dict(BT=c["dx_BT"], BK=c["dx_BK"], MP=32, NP=4, PREC=K.PRECISION), c["dx_warps"]),
        (K._dfn_kernel, [p32, pb, p32, i, i, i],
         dict(BT=c["dfn_BT"], BK=c["dfn_BK"], MP=32, PREC=K.PRECISION, STAGES=c["dfn_stages"]), c["dfn_warps"]),
        (K._post_fwd_kernel, [pb, pb, p32, p32, pb, i, i, i],
         dict(BT=c["post_BT"], NP=4, BD=c["post_BD"], N=4, SHARED=None, TOPK=0), c["post_warps"]),
        (K._post_bwd_kernel, [pb, pb, p32, p32, pb, pb, pb, p32, p32, i, i, i],
         dict(BT=c["post_bwd_BT"], NP=4, BD=c["post_bwd_BD"], N=4), c["post_bwd_warps"]),
        (KS._sinkhorn_fwd_kernel, [p32, p32, i, i, i, f], dict(BT=KS.SINKHORN_BT, NP=4), 4),
        (KS._sinkhorn_bwd_kernel, [p32, p32, p32, i, i, i, f], dict(BT=KS.SINKHORN_BT, NP=4), 4),
    ]
    for fn, types, consts, warps in cases:
        if "PDL" in fn.arg_names:                    # the forward kernels of a decode step: as a Hopper launches them
            consts = dict(consts, PDL=True)
        runtime = [a for a in fn.arg_names if a not in consts]
        assert len(runtime) == len(types), (fn.__name__, runtime)
        sig = {**dict(zip(runtime, types)), **{k: "constexpr" for k in consts}}
        compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, launch_pdl="PDL" in consts))
        assert ".entry" in compiled.asm["ptx"], fn.__name__
