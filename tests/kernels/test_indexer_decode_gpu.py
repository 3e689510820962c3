"""The triton indexer scores at a decode step's few queries a sequence (``kernels/triton/indexer.py``'s
``_indexer_heads_kernel``: a query's heads as the rows of one dot) against the torch contract
``kernels.reference.indexer.indexer_scores`` (fp32, relative error at most 1e-4, as the head loop's tests), at
one query (the decode step) and a few, heads padded to the dot's 16 rows or not, keys in several blocks and a
partial one. The launcher takes that kernel below 16 queries a sequence without key ranges and the head loop
otherwise; the test counts the launches of each. With no GPU, ``TRITON_INTERPRET=1`` runs it (fp16, small
shapes); otherwise it skips."""

import pytest
import torch

from ._backends import CountedLaunches, compiles_for_sm90_without_spills, triton_device

pytestmark = pytest.mark.gpu


@pytest.fixture
def launches(monkeypatch):
    from kernels.triton import indexer as K

    heads, loop = CountedLaunches(K._indexer_heads_kernel), CountedLaunches(K._indexer_kernel)
    monkeypatch.setattr(K, "_indexer_heads_kernel", heads)
    monkeypatch.setattr(K, "_indexer_kernel", loop)
    return heads, loop


@pytest.mark.parametrize("B,S,H,N", [(3, 1, 4, 150), (2, 3, 16, 64), (1, 1, 64, 40)])
def test_few_queries_take_one_dot_of_the_heads(launches, B, S, H, N):
    from kernels.reference.indexer import indexer_scores as ref
    from kernels.triton.indexer import indexer_scores

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(B * 100 + S * 10 + H)
    q = torch.randn(B, S, H, 128, generator=g).to(dt)
    k = torch.randn(B, N, 128, generator=g).to(dt)
    w = torch.randn(B, S, H, generator=g) * (H * 128) ** -0.5
    got = indexer_scores(q.to(dev), k.to(dev), w.to(dev)).cpu()
    want = ref(q.float(), k.float(), w)
    assert got.dtype == torch.float32 and got.shape == (B, S, N)
    assert ((got - want).norm() / want.norm()).item() <= 1e-4
    heads, loop = launches
    assert (heads.calls, loop.calls) == (1, 0)


def test_many_queries_and_key_ranges_keep_the_head_loop(launches):
    from kernels.triton.indexer import indexer_scores, indexer_scores_thd

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    q = torch.randn(1, 16, 16, 64, dtype=dt, device=dev)
    k = torch.randn(1, 32, 64, dtype=dt, device=dev)
    indexer_scores(q, k, torch.randn(1, 16, 16, device=dev))
    ks = torch.zeros(2, dtype=torch.int32, device=dev)
    indexer_scores_thd(q[0, :2], k[0], torch.randn(2, 16, device=dev), ks, ks + 5)
    heads, loop = launches
    assert (heads.calls, loop.calls) == (0, 2)


def test_the_heads_kernel_compiles_for_sm90_without_spills():
    """V4's indexer (64 heads of 128) at the launch settings compiles for sm_90 with triton alone, no GPU, and
    ptxas reports no spilled registers."""
    from kernels.triton import indexer as K

    cfg = K.INDEXER_CONFIG
    consts = dict(BH=64, BN=cfg["heads_BN"], D=128, PRECISION="tf32")
    types = dict(Q="*bf16", K="*bf16", W="*fp32", OUT="*fp32")
    types.update({a: "i32" for a in K._indexer_heads_kernel.arg_names if a not in types and a not in consts})
    compiles_for_sm90_without_spills(K._indexer_heads_kernel, types, consts, cfg["heads_warps"])
