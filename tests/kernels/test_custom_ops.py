"""The GPU backends' ``torch.library`` custom ops (``kernels.gpu_ops``) on the CPU, without triton or tilelang.

* Fake implementations: for every op of ``dsv4_triton`` and ``dsv4_tilelang``, the fake outputs (shapes and
  dtypes under ``FakeTensorMode``) and the gradients that the registered autograd gives through the ``*_bwd``
  op's fake are those of the reference ops (``kernels.reference``) on the same inputs, flattened the way the
  entry points flatten them; the outputs only the kernels have (``lse2``, the saved ``pre`` / ``mix`` /
  ``rho`` of ``hc_pre`` / ``hc_head``) have the widths the launchers allocate (``kernels/triton/mhc.py``).
* Counting (``core.kernel_ops``): an op called from compiled code is counted when traced, not on runs, and
  the count does not break the graph.

Not here (needs a kernel to run): the real implementations against the fakes (``torch.library.opcheck``) and
compiled models, in ``test_compile_gpu.py`` (a GPU, or ``TRITON_INTERPRET=1`` with triton installed).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import gpu_ops
from kernels.reference import attention as RA
from kernels.reference import indexer as RI
from kernels.reference import mhc as RM

T, H, D, NKV, K = 6, 4, 64, 9, 5
N_HC, D_HC, ITERS, EPS = 4, 32, 3, 1e-6


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _sig(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _fake_run(op, inputs, grad_of):
    """Outputs of ``op`` on fake copies of ``inputs`` and the gradients of ``inputs[i]`` for ``i`` in ``grad_of``
    through the op's registered autograd (a backward seeded on the first output)."""
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t).requires_grad_(i in grad_of) if isinstance(t, torch.Tensor) else t
                for i, t in enumerate(inputs)]
        out = op(*fake)
        out = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(out[0].float().sum(), [fake[i] for i in grad_of]) if grad_of else ()
    return out, grads


def _ref_run(fn, inputs, grad_of):
    leaves = [t.detach().requires_grad_(i in grad_of) if isinstance(t, torch.Tensor) else t
              for i, t in enumerate(inputs)]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(out[0].float().sum(), [leaves[i] for i in grad_of]) if grad_of else ()
    return out, grads


NAMESPACES = [pytest.param(gpu_ops.TRITON, id="triton"), pytest.param(gpu_ops.TILELANG, id="tilelang")]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_attention_fakes_match_reference(ns):
    g = _gen(0)
    q = torch.randn(T, H, D, generator=g).bfloat16()
    kv = torch.randn(NKV, D, generator=g).bfloat16()
    idx = torch.randint(-1, NKV, (T, K), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    out, grads = _fake_run(ns.sparse_attention_fwd, [q, kv, idx, sink, 0.125], grad_of=(0, 1, 3))
    ref, rgrads = _ref_run(lambda q, kv, i, s: RA.sparse_attention_with_sink(q[None], kv[None], i[None], s, 0.125)[0],
                           [q, kv, idx.long(), sink], grad_of=(0, 1, 3))
    assert _sig(out[:1]) == _sig(ref) and _sig(grads) == _sig(rgrads)
    assert _sig(out[1:]) == [((T, H), torch.float32)]  # lse2, log2 units
    # the backward op itself (its autograd casts dsink to sink's dtype): dq, dkv as the reference, fp32 dsink
    o, lse2, do = q.clone(), torch.zeros(T, H), torch.randn(T, H, D, generator=g).bfloat16()
    bwd, _ = _fake_run(ns.sparse_attention_bwd, [q, kv, idx, sink.bfloat16(), o, lse2, do, 0.125], grad_of=())
    assert _sig(bwd) == _sig(rgrads[:2]) + [((H,), torch.float32)]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("ranges", [False, True])
def test_indexer_fake_matches_reference(ns, ranges):
    g = _gen(1)
    q, k, w = torch.randn(T, H, 32, generator=g).bfloat16(), torch.randn(NKV, 32, generator=g).bfloat16(), \
        torch.randn(T, H, generator=g)
    ks = ke = None
    if ranges:
        ks, ke = torch.zeros(T, dtype=torch.int32), torch.arange(1, T + 1, dtype=torch.int32)
    (out,), _ = _fake_run(ns.indexer_scores, [q, k, w, ks, ke], grad_of=())
    ref = RI.indexer_scores(q[None], k[None], w[None].to(q.dtype))[0]
    assert tuple(out.shape) == tuple(ref.shape) and out.dtype == torch.float32  # the kernels return fp32


def test_triton_indexer_fake_takes_a_batch():
    """The triton op also takes a whole batch (one launch): ``[B,S,H,D] x [B,N,D] -> [B,S,N]``."""
    from kernels import gpu_ops

    g = _gen(2)
    q, k, w = torch.randn(3, 1, H, 32, generator=g).bfloat16(), torch.randn(3, NKV, 32, generator=g).bfloat16(), \
        torch.randn(3, 1, H, generator=g)
    (out,), _ = _fake_run(gpu_ops.TRITON.indexer_scores, [q, k, w, None, None], grad_of=())
    assert tuple(out.shape) == (3, 1, NKV) and out.dtype == torch.float32


def _mhc_inputs(rows, n_scale, seed):
    g = _gen(seed)
    x = torch.randn(T, N_HC, D_HC, generator=g).bfloat16()
    fn = torch.randn(rows, N_HC * D_HC, generator=g) * 0.05
    return x, fn, torch.rand(n_scale, generator=g), torch.randn(rows, generator=g) * 0.1


def test_hc_pre_fake_matches_reference():
    rows = (2 + N_HC) * N_HC
    x, fn, scale, base = _mhc_inputs(rows, 3, 2)
    args = [x, fn, scale, base, 1e-6, EPS, ITERS]
    out, grads = _fake_run(gpu_ops.TRITON.hc_pre, args, grad_of=(0, 1, 2, 3))
    ref, rgrads = _ref_run(RM.hc_pre, args, grad_of=(0, 1, 2, 3))
    assert _sig(out[:3]) == _sig(ref) and _sig(grads) == _sig(rgrads)
    assert _sig(out[3:]) == [((T, 4), torch.float32), ((T, 32), torch.float32), ((T,), torch.float32)]


def test_hc_head_fake_matches_reference():
    x, fn, scale, base = _mhc_inputs(N_HC, 1, 3)
    args = [x, fn, scale, base, 1e-6, EPS]
    out, grads = _fake_run(gpu_ops.TRITON.hc_head, args, grad_of=(0, 1, 2, 3))
    ref, rgrads = _ref_run(RM.hc_head, args, grad_of=(0, 1, 2, 3))
    assert _sig(out[:1]) == _sig(ref) and _sig(grads) == _sig(rgrads)
    assert _sig(out[1:]) == [((T, 4), torch.float32), ((T, 16), torch.float32), ((T,), torch.float32)]


@pytest.mark.parametrize("f_dtype", [torch.bfloat16, torch.float32])
def test_hc_post_fake_matches_reference(f_dtype):
    g = _gen(4)
    f = torch.randn(T, D_HC, generator=g).to(f_dtype)
    x = torch.randn(T, N_HC, D_HC, generator=g).bfloat16()
    post, comb = torch.rand(T, N_HC, generator=g), torch.rand(T, N_HC, N_HC, generator=g)
    out, grads = _fake_run(gpu_ops.TRITON.hc_post, [f, x, post, comb], grad_of=(0, 1, 2, 3))
    ref, rgrads = _ref_run(lambda f, x, p, c: RM.hc_post(f[None], x[None], p[None], c[None])[0], [f, x, post, comb],
                           grad_of=(0, 1, 2, 3))
    assert _sig(out) == _sig(ref) and _sig(grads) == _sig(rgrads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sinkhorn_fake_matches_reference(dtype):
    logits = torch.randn(T, N_HC, N_HC, generator=_gen(5)).to(dtype)
    out, grads = _fake_run(gpu_ops.TRITON.sinkhorn, [logits, ITERS, EPS], grad_of=(0,))
    ref, rgrads = _ref_run(RM.sinkhorn, [logits, ITERS, EPS], grad_of=(0,))
    assert _sig(out) == _sig(ref) and _sig(grads) == _sig(rgrads)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_fake_matches_reference(inverse):
    """The op takes the rows flattened (``[B*S*H, D]``, fp32 angles) and gives the reference's shape, dtype and
    gradient signature."""
    from kernels.reference.rope import apply_rope, rope_cos_sin, rope_inv_freq

    x = torch.randn(2, T, H, D, generator=_gen(7)).bfloat16()
    cos, sin = rope_cos_sin(rope_inv_freq(16, 10000.0), torch.arange(T), dtype=torch.float32)
    out, grads = _fake_run(gpu_ops.TRITON.rope, [x.view(-1, D), cos, sin, H, inverse], grad_of=(0,))
    ref, rgrads = _ref_run(lambda x: apply_rope(x, cos, sin, inverse=inverse).view(-1, D), [x], grad_of=(0,))
    assert _sig(out) == _sig(ref) and [g.shape for g in grads] == [(2 * T * H, D)]
    assert grads[0].dtype == rgrads[0].dtype


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_rms_normalize_fake_matches_reference(out_dtype):
    from kernels.reference.layers import rms_normalize

    x = torch.randn(T * H, D, generator=_gen(8)).bfloat16()
    out, grads = _fake_run(gpu_ops.TRITON.rms_normalize, [x, 1e-6, out_dtype], grad_of=(0,))
    ref, rgrads = _ref_run(lambda x: rms_normalize(x, 1e-6, out_dtype), [x], grad_of=(0,))
    assert _sig(out) == _sig(ref) and _sig(grads) == _sig(rgrads)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weight", "fp32-weight"])
def test_rms_norm_fake_matches_reference(w_dtype):
    from kernels.reference.layers import rms_norm

    x, w = torch.randn(T * H, D, generator=_gen(8)).bfloat16(), torch.rand(D, generator=_gen(11)).to(w_dtype)
    out, grads = _fake_run(gpu_ops.TRITON.rms_norm, [x, w, 1e-6], grad_of=(0, 1))
    ref, rgrads = _ref_run(lambda x, w: rms_norm(x, w, 1e-6), [x, w], grad_of=(0, 1))
    assert _sig(out) == _sig(ref) and _sig(grads) == _sig(rgrads)


@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_weighted_swiglu_fake_matches_reference(limit):
    from kernels.reference.moe import weighted_swiglu

    h, w = torch.randn(T * 3, 2 * D, generator=_gen(9)).bfloat16(), torch.rand(T * 3, generator=_gen(10))
    out, grads = _fake_run(gpu_ops.TRITON.weighted_swiglu, [h, w, limit, torch.bfloat16], grad_of=(0, 1))
    ref, rgrads = _ref_run(lambda h, w: weighted_swiglu(h, w, limit, torch.bfloat16), [h, w], grad_of=(0, 1))
    assert _sig(out) == _sig(ref) and _sig(grads) == _sig(rgrads)


def test_logprob_fakes_match_the_reference_head():
    """The head's log-prob passes (no autograd of their own: ``kernels.triton.logprobs`` runs the GEMMs): the
    stats give the reference's ``[N]`` fp32 log-probs (and an ``[N]`` fp32 lse), the gradient the logits' shape in
    the operands' dtype, which the head's GEMMs take."""
    from kernels.reference.layers import head_logprobs

    y, w = torch.randn(T, D, generator=_gen(12)).bfloat16(), torch.randn(40, D, generator=_gen(13)).bfloat16()
    labels, logits = torch.randint(0, 40, (T,), generator=_gen(14)), torch.randn(T, 40, generator=_gen(15))
    (lp, lse), _ = _fake_run(gpu_ops.TRITON.logprob_stats, [logits, labels, 0.7], grad_of=())
    ref, _ = _ref_run(lambda y, w: head_logprobs(y, w, labels, 0.7), [y, w], grad_of=())
    assert _sig([lp, lse]) == _sig([ref[0], ref[0]])
    (d,), _ = _fake_run(gpu_ops.TRITON.logprob_grad, [logits, labels, torch.zeros(T), torch.ones(T), 0.7,
                                                      torch.bfloat16], grad_of=())
    assert _sig([d]) == [((T, 40), torch.bfloat16)]


def test_experts_grouped_mm_fake_matches_torchs_grouped_gemm():
    """The decode step's grouped experts: ``[R, N]`` in ``x``'s dtype, as ``torch._grouped_mm`` gives."""
    x, w = torch.randn(7, D, generator=_gen(16)).bfloat16(), torch.randn(3, 24, D, generator=_gen(17)).bfloat16()
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    (y,), _ = _fake_run(gpu_ops.TRITON.experts_grouped_mm, [x, w, offs], grad_of=())
    ref, _ = _ref_run(lambda x, w: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), [x, w], grad_of=())
    assert _sig([y]) == _sig([ref[0]]) == [((7, 24), torch.bfloat16)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hadamard_fake_matches_reference(dtype):
    """The rows flattened ``[R, n]``, the output and its gradient in the input's dtype and shape, as the reference."""
    from kernels.reference.compressor import hadamard_transform

    x = torch.randn(T * H, 128, generator=_gen(18)).to(dtype)
    out, grads = _fake_run(gpu_ops.TRITON.hadamard, [x], grad_of=(0,))
    ref, rgrads = _ref_run(hadamard_transform, [x], grad_of=(0,))
    assert _sig(out) == _sig(ref) and _sig(grads) == _sig(rgrads)


def test_every_op_has_a_fake():
    """Each registered op, forward and backward, answers under FakeTensorMode (the tests above reach them all)."""
    names = {n for n in vars(gpu_ops.TRITON) if n != "namespace"}
    assert names == {"sparse_attention_fwd", "sparse_attention_bwd", "indexer_scores", "hc_pre", "hc_pre_bwd",
                     "hc_head", "hc_head_bwd", "hc_post", "hc_post_bwd", "sinkhorn", "sinkhorn_bwd", "rope",
                     "rms_normalize", "rms_normalize_bwd", "rms_norm", "rms_norm_bwd", "weighted_swiglu",
                     "weighted_swiglu_bwd", "logprob_stats", "logprob_grad", "experts_grouped_mm", "hadamard"}
    assert {n for n in vars(gpu_ops.TILELANG) if n != "namespace"} == \
        {"sparse_attention_fwd", "sparse_attention_bwd", "indexer_scores"}
    for ns in ("dsv4_triton", "dsv4_tilelang"):
        assert hasattr(getattr(torch.ops, ns), "sparse_attention_bwd")


def test_ops_called_from_compiled_code_are_counted_when_traced():
    from core.kernel_ops import OpTable, kernels_ran, reset_kernels_ran
    from kernels.reference.backend import reference_functions

    table = OpTable("test", {"sinkhorn": RM.sinkhorn},
                    delegated={n: ("none", f) for n, f in reference_functions().items()})

    def two_calls(c):
        return table.sinkhorn(c, ITERS, EPS) + table.sinkhorn(c.cos(), ITERS, EPS)

    torch._dynamo.reset()
    compiled = torch.compile(two_calls, backend="eager", fullgraph=True)  # fullgraph: counting breaks nothing
    c = torch.randn(3, N_HC, N_HC, generator=_gen(6))
    reset_kernels_ran()
    for _ in range(3):
        torch.testing.assert_close(compiled(c), two_calls(c))
    # three eager calls of two_calls (6 counts) plus the one trace (2); the compiled runs add none
    assert kernels_ran() == {"test.sinkhorn": 8}
