"""Lightning-Indexer scores and top-k of the GPU kernel backends (triton, tilelang) vs the PyTorch reference
(GPU only); every test runs once per backend.

Scores: relative Frobenius error <= 1e-4 against fp32 ``kernels.reference.indexer.indexer_scores`` on the
same bf16 values (fp32 accumulation both sides), and the same -inf pattern for causal / segment ranges.
Top-k: the reference scores of the picked ids equal the reference top-k values (to 1e-4 relative).
On a machine without a CUDA GPU, or without a backend's package, that backend's cases skip (with the reason).
"""

import pytest
import torch

from ._backends import PER_BACKEND, backend_module

pytestmark = PER_BACKEND


def _inputs(T, H, D, N, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    w = torch.randn(T, H, device="cuda", generator=g) * (H * D) ** -0.5
    return q, k, w


def _ref(q, k, w):
    from kernels.reference.indexer import indexer_scores

    return indexer_scores(q.float()[None], k.float()[None], w.float()[None])[0]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scores_match_reference(backend, dtype):
    indexer_scores_thd = backend_module(backend, "indexer").indexer_scores_thd
    q, k, w = _inputs(300, 64, 128, 1000, dtype=dtype)

    if backend == "tilelang" and dtype == torch.float32:   # no fp32 TileLang kernel: refused, not handed on
        with pytest.raises(ValueError, match="--kernel-backend none"):
            indexer_scores_thd(q, k, w)
        return
    got = indexer_scores_thd(q, k, w)
    assert got.dtype == torch.float32
    assert _rel(got, _ref(q, k, w)) <= 1e-4


def test_causal_and_segment_ranges(backend):
    indexer_scores_thd = backend_module(backend, "indexer").indexer_scores_thd

    # two packed segments of 200 and 312 tokens; compressed keys laid out per segment (50 + 78)
    lens = [200, 312]
    T = sum(lens)
    n = [L // 4 for L in lens]
    q, k, w = _inputs(T, 64, 128, sum(n), seed=1)
    ks, ke = [], []
    for s, (L, base) in enumerate(zip(lens, [0, n[0]])):
        p = torch.arange(L, device="cuda")
        ks.append(torch.full_like(p, base))
        ke.append(base + (p + 1) // 4)
    ks, ke = torch.cat(ks).int(), torch.cat(ke).int()
    got = indexer_scores_thd(q, k, w, ks, ke)
    want = _ref(q, k, w)
    j = torch.arange(sum(n), device="cuda")[None, :]
    vis = (j >= ks[:, None].long()) & (j < ke[:, None].long())
    assert torch.equal(torch.isneginf(got), ~vis)
    assert _rel(got[vis], want[vis]) <= 1e-4


def test_topk_picks_reference_best(backend):
    indexer = backend_module(backend, "indexer")
    indexer_scores_thd, indexer_topk = indexer.indexer_scores_thd, indexer.indexer_topk

    T, N, topk = 2048, 512, 128
    q, k, w = _inputs(T, 64, 128, N, seed=2)
    ke = ((torch.arange(T, device="cuda") + 1) // 4).int()
    ks = torch.zeros_like(ke)
    top = indexer_topk(indexer_scores_thd(q, k, w, ks, ke), topk)
    assert top.dtype == torch.int32 and top.shape == (T, topk)
    want = _ref(q, k, w).masked_fill(torch.arange(N, device="cuda")[None, :] >= ke[:, None], float("-inf"))
    ref_vals = want.topk(topk, dim=-1).values
    n_valid = (top >= 0).sum(-1)
    assert torch.equal(n_valid, torch.clamp(ke.long(), max=topk))
    picked = torch.where(top >= 0, want.gather(1, top.long().clamp(min=0)), torch.full_like(ref_vals, float("-inf")))
    picked = picked.sort(dim=-1, descending=True).values
    fin = torch.isfinite(ref_vals)
    assert torch.equal(torch.isfinite(picked), fin)
    assert ((picked[fin] - ref_vals[fin]).abs().max() / ref_vals[fin].abs().max()).item() <= 1e-4


@pytest.mark.parametrize("B,S,N", [(2, 128, 32), (64, 1, 96)], ids=["prefill", "decode-batch64"])
def test_batched_api_matches_reference_op(backend, B, S, N):
    from kernels.reference.indexer import indexer_scores as ref
    ops = backend_module(backend, "backend").ops

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, S, 64, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, N, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, S, 64, device="cuda", generator=g)
    got = ops().indexer_scores(q, k, w)
    assert got.shape == (B, S, N)
    assert _rel(got, ref(q.float(), k.float(), w)) <= 1e-4


def test_inputs_that_want_a_gradient_are_refused(backend):
    """The indexer kernels have no backward: a trained indexer's inputs are refused, not silently cut off."""
    indexer_scores_thd = backend_module(backend, "indexer").indexer_scores_thd
    q, k, w = _inputs(64, 64, 128, 32)
    with pytest.raises(ValueError, match="no backward"):
        indexer_scores_thd(q.requires_grad_(), k, w)
