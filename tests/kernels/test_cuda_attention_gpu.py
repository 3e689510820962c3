"""The CUDA C++ sparse attention forward (``kernels/cuda/attention.py``, sm_90a) against the fp32 reference.

Reference = ``kernels.reference.attention.sparse_attention_with_sink`` on the same bf16 values upcast to
fp32 (and a logsumexp with the sink for lse). Error = ||o - ref||_F / ||ref||_F; lse in natural log.
Bounds: o <= 1e-2 (bf16 P and output rounding are ~4e-3), lse max-abs <= 2e-3.

Every numeric case runs once per PV variant (``VARIANTS``; the variants differ only in how O += P.V is
issued, see the kernel header). Everything here needs an sm_90 GPU (skipped elsewhere, with the reason); the
refusals that CPU tensors reach run in the CPU suite (test_cuda_backend.py).
"""

import os

import pytest
import torch

from kernels.cuda import attention as CA

pytestmark = pytest.mark.gpu

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
O_REL, LSE_ABS = 1e-2, 2e-3


def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU (H100/H200), this one is {torch.cuda.get_device_capability()}"
    return None


needs_gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
# DSV4_CUDA_TEST_VARIANTS=0,3 restricts the variants (e.g. to those that passed `bench.kernels_cuda --smoke`)
_VARIANTS = tuple(int(v) for v in os.environ.get("DSV4_CUDA_TEST_VARIANTS", "").split(",") if v) or CA.VARIANTS
per_variant = pytest.mark.parametrize("variant", _VARIANTS)


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ref(q, kv, idx, sink, scale):
    """fp32 reference: o [T,H,D] fp32 and lse [T,H] (natural log, incl. the sink), in token chunks."""
    from kernels.reference.attention import sparse_attention_with_sink as ref

    T, H, D = q.shape
    os_, lses = [], []
    for t0 in range(0, T, 1024):
        qf = q[t0:t0 + 1024].float()
        ix = idx[t0:t0 + 1024].long()
        os_.append(ref(qf[None], kv.float()[None], ix, sink.float(), scale)[0])
        g = kv.float()[ix.clamp(min=0)]  # [t,K,D]
        z = torch.einsum("thd,tkd->thk", qf, g) * scale
        z = z.masked_fill((ix < 0)[:, None, :], float("-inf"))
        s = sink.float().view(1, H, 1).expand(z.shape[0], H, 1)
        lses.append(torch.logsumexp(torch.cat([z, s], -1), -1))
        del g, z
    return torch.cat(os_), torch.cat(lses)


def _inputs(T, H, Tkv, seed, q_mult=1.0, D=512):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(T, H, D, device="cuda", generator=g) * q_mult).bfloat16()
    kv = torch.randn(Tkv, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    return q, kv, sink, g


def _run(q, kv, idx, sink, scale, variant):
    """Run with NaN-poisoned outputs, check every element was written and is finite; returns (o, lse nat)."""
    T, H, D = q.shape
    o = torch.full_like(q, float("nan"))
    lse2 = torch.full((T, H), float("nan"), device=q.device)
    o2, l2 = CA.sparse_attention_fwd(q, kv, idx, sink, scale, variant=variant, out=(o, lse2))
    torch.cuda.synchronize()
    assert o2.data_ptr() == o.data_ptr() and l2.data_ptr() == lse2.data_ptr()
    assert torch.isfinite(o.float()).all(), f"o has NaN/Inf ({torch.isnan(o.float()).sum().item()} NaN)"
    assert torch.isfinite(lse2).all(), "lse has NaN/Inf"
    return o, lse2 * LN2


def _check(got, want, o_rel=O_REL, lse_abs=LSE_ABS):
    (o, lse), (ro, rlse) = got, want
    e, le = _rel(o, ro), (lse - rlse).abs().max().item()
    print(f"o rel {e:.3e}, lse max abs {le:.3e}")
    assert e <= o_rel, f"o: relative error {e:.3e} > {o_rel:.0e}"
    assert le <= lse_abs, f"lse max abs error {le:.3e} > {lse_abs:.0e}"


def _bench_indices(T, topk, n_comp, g, window=128):
    from kernels.reference.attention import window_indices

    comp = torch.rand(T, n_comp, device="cuda", generator=g).topk(topk, dim=-1).indices + T
    return torch.cat([window_indices(T, window, "cuda"), comp], dim=1).to(torch.int32)


# ----------------------------------------------------------------------------------------------


@needs_gpu
@per_variant
@pytest.mark.parametrize("T,H,K", [(96, 64, 640), (40, 128, 1152), (33, 64, 100), (17, 192, 64), (5, 64, 1)])
def test_small_shapes_random_indices(variant, T, H, K):
    Tkv = 700
    q, kv, sink, g = _inputs(T, H, Tkv, seed=T * 7 + H + K)
    idx = torch.randint(0, Tkv, (T, K), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(T, K, device="cuda", generator=g) < 0.15] = -1
    scale = 512 ** -0.5
    _check(_run(q, kv, idx, sink, scale, variant), _ref(q, kv, idx, sink, scale))


@needs_gpu
@per_variant
@pytest.mark.parametrize("H,topk", [(64, 512), (128, 1024)], ids=["flash", "pro"])
def test_dsv4_shapes(variant, H, topk):
    """The benchmark's inputs: S=4096, window 128 + top-k distinct compressed rows among S/4."""
    S = 4096
    q, kv, sink, g = _inputs(S, H, S + S // 4, seed=H)
    idx = _bench_indices(S, topk, S // 4, g)
    scale = 512 ** -0.5
    _check(_run(q, kv, idx, sink, scale, variant), _ref(q, kv, idx, sink, scale))


@needs_gpu
@per_variant
def test_all_invalid_rows_and_rows_with_few_valid_slots(variant):
    T, H, K, Tkv = 300, 64, 640, 900
    q, kv, sink, g = _inputs(T, H, Tkv, seed=11)
    idx = torch.full((T, K), -1, device="cuda", dtype=torch.int32)
    few = torch.arange(T, device="cuda") % 3 == 1
    for t in torch.nonzero(few).flatten().tolist():  # 1..3 valid slots at random positions
        n = 1 + t % 3
        pos = torch.randperm(K, device="cuda", generator=g)[:n]
        idx[t, pos] = torch.randint(0, Tkv, (n,), device="cuda", generator=g, dtype=torch.int32)
    full = torch.arange(T, device="cuda") % 3 == 2
    idx[full] = torch.randint(0, Tkv, (int(full.sum()), K), device="cuda", generator=g, dtype=torch.int32)
    dead = ~(few | full)
    scale = 512 ** -0.5
    o, lse = _run(q, kv, idx, sink, scale, variant)
    assert torch.count_nonzero(o[dead]) == 0
    assert (lse[dead] - sink[None, :]).abs().max().item() <= 1e-5
    _check((o, lse), _ref(q, kv, idx, sink, scale))
    # nothing valid at all
    idx.fill_(-1)
    o, lse = _run(q, kv, idx, sink, scale, variant)
    assert torch.count_nonzero(o) == 0
    assert (lse - sink[None, :]).abs().max().item() <= 1e-5


@needs_gpu
@per_variant
def test_large_logits(variant):
    """q x 30: logits of order 30, a near one-hot softmax."""
    T, H, Tkv = 256, 64, 1280
    q, kv, sink, g = _inputs(T, H, Tkv, seed=3, q_mult=30.0)
    idx = _bench_indices(T, 512, Tkv - T, g)
    scale = 512 ** -0.5
    o, lse = _run(q, kv, idx, sink, scale, variant)
    ro, rlse = _ref(q, kv, idx, sink, scale)
    e = _rel(o, ro)
    le = ((lse - rlse).abs() / rlse.abs().clamp_min(1)).max().item()
    print(f"o rel {e:.3e}, lse max rel {le:.3e}")
    assert e <= 2e-2 and le <= 1e-3


@needs_gpu
@per_variant
def test_sink_extremes(variant):
    T, H, Tkv = 128, 64, 1000
    q, kv, sink, g = _inputs(T, H, Tkv, seed=5)
    sink = torch.tensor([-1e4, -30.0, 0.0, 30.0, 1e4, 3.0, -3.0, 12.0], device="cuda").repeat(H // 8)
    idx = torch.randint(0, Tkv, (T, 640), device="cuda", generator=g, dtype=torch.int32)
    idx[torch.rand(T, 640, device="cuda", generator=g) < 0.1] = -1
    scale = 512 ** -0.5
    o, lse = _run(q, kv, idx, sink, scale, variant)
    ro, rlse = _ref(q, kv, idx, sink, scale)
    # heads whose sink is 1e4 take all the mass: o = 0 exactly, lse = sink
    big = sink == 1e4
    assert torch.count_nonzero(o[:, big]) == 0
    assert ((lse[:, big] - 1e4).abs() <= 1e-2).all()
    for h in range(8):  # each sink value on its own, o relative to its own norm
        hs = slice(h, H, 8)
        if ro[:, hs].norm() > 0:
            assert _rel(o[:, hs], ro[:, hs]) <= O_REL, f"sink {sink[h].item()}"
    assert (lse[:, ~big] - rlse[:, ~big]).abs().max().item() <= LSE_ABS


@needs_gpu
@per_variant
def test_duplicate_indices_count_twice(variant):
    T, H, Tkv = 64, 64, 200
    q, kv, sink, g = _inputs(T, H, Tkv, seed=6)
    idx = torch.randint(0, Tkv, (T, 256), device="cuda", generator=g, dtype=torch.int32)
    idx[:, 1] = idx[:, 0]
    idx[:, 64:128] = idx[:, 0:1]  # one row 65 times
    idx[::4] = 7  # every slot the same row
    scale = 512 ** -0.5
    _check(_run(q, kv, idx, sink, scale, variant), _ref(q, kv, idx, sink, scale))


@needs_gpu
@per_variant
def test_deterministic(variant):
    S, H = 1024, 128
    q, kv, sink, g = _inputs(S, H, S + 512, seed=8)
    idx = _bench_indices(S, 512, 512, g)
    a = CA.sparse_attention_fwd(q, kv, idx, sink, 512 ** -0.5, variant=variant)
    b = CA.sparse_attention_fwd(q, kv, idx, sink, 512 ** -0.5, variant=variant)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_gpu
def test_variants_agree_and_int64_indices():
    S, H = 512, 64
    q, kv, sink, g = _inputs(S, H, S + 512, seed=9)
    idx = _bench_indices(S, 512, 512, g)
    outs = [CA.sparse_attention_fwd(q, kv, idx, sink, 512 ** -0.5, variant=v) for v in _VARIANTS]
    o64 = CA.sparse_attention_fwd(q, kv, idx.long(), sink, 512 ** -0.5)
    assert torch.equal(o64[0], CA.sparse_attention_fwd(q, kv, idx, sink, 512 ** -0.5)[0])
    ref = _ref(q, kv, idx, sink, 512 ** -0.5)
    for v, o in zip(_VARIANTS, outs):
        print(f"variant {v}: o rel {_rel(o[0], ref[0]):.3e}")


@needs_gpu
def test_triton_backward_takes_the_cuda_forward():
    """(o, lse2) of the CUDA forward feed kernels/triton's backward like Triton's own forward does."""
    pytest.importorskip("triton")
    from kernels.triton import attention as TA

    S, H = 512, 64
    q, kv, sink, g = _inputs(S, H, S + 512, seed=10)
    idx = _bench_indices(S, 512, 512, g)
    do = torch.randn_like(q)
    scale = 512 ** -0.5
    oc, lc = CA.sparse_attention_fwd(q, kv, idx, sink, scale)
    ot, lt = TA.sparse_attention_fwd(q, kv, idx, sink, scale)
    assert _rel(oc, ot) <= 1e-2 and (lc - lt).abs().max().item() <= 3e-3
    gc = TA.sparse_attention_bwd(q, kv, idx, sink, oc, lc, do, scale)
    gt = TA.sparse_attention_bwd(q, kv, idx, sink, ot, lt, do, scale)
    for n, a, b in zip(("dq", "dkv", "dsink"), gc, gt):
        assert _rel(a, b) <= 2e-2, n


@needs_gpu
def test_refusals_on_the_gpu_name_the_fix():
    """The refusals that need CUDA tensors to reach (the rest run in the CPU suite: test_cuda_backend.py)."""
    q = torch.randn(4, 64, 512, device="cuda").bfloat16()
    kv = torch.randn(10, 512, device="cuda").bfloat16()
    idx = torch.zeros(4, 8, dtype=torch.int32, device="cuda")
    sink = torch.zeros(64, device="cuda")
    f = CA.sparse_attention_fwd
    with pytest.raises(ValueError, match="contiguous"):
        f(q.transpose(0, 1).contiguous().transpose(0, 1), kv, idx, sink, 0.1)
    with pytest.raises(ValueError, match="CUDA"):
        f(q.cpu(), kv, idx, sink, 0.1)
