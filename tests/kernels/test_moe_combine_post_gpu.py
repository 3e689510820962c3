"""The triton ``moe_combine_post`` (``kernels/triton/mhc_decode.py``, ``kernels.triton.mhc.combine_post_fwd``): the
MoE's pairs and shared expert summed inside the site's mHC post, one launch where the eager decode step ran
``moe_combine`` and ``hc_post``. Against the torch contract (``kernels.reference.slots.combine_post``) within the
roundings of the streams' dtype, and bit for bit against this backend's ``moe_combine`` then ``hc_post``, at one
token, a few and more than a program's rows, top-k 1 to 6, streams of widths that are not whole blocks; what it
cannot take is refused with the reason. With no GPU, ``TRITON_INTERPRET=1`` runs it; the compile test needs triton
only (sm_90, no spills; the training forward's kernel compiles as before)."""

import pytest
import torch

from ._backends import CountedLaunches, compiles_for_sm90_without_spills, triton_device

pytestmark = pytest.mark.gpu


def _case(T, k, n, d, seed, dev):
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randn(T * k, d, generator=g).bfloat16()
    shared = torch.randn(T, d, generator=g).bfloat16()
    x = torch.randn(T, 1, n, d, generator=g).bfloat16()
    post = 2 * torch.rand(T, 1, n, generator=g)
    comb = torch.rand(T, 1, n, n, generator=g)
    return [t.to(dev) for t in (pairs, shared, x, post, comb)]


@pytest.mark.parametrize("T,k,n,d", [(1, 6, 4, 256), (3, 2, 4, 300), (9, 1, 4, 130), (2, 6, 2, 64)])
def test_it_is_moe_combine_then_hc_post_bit_for_bit(monkeypatch, T, k, n, d):
    from kernels.reference.slots import combine_post
    from kernels.triton import mhc
    from kernels.triton.experts import moe_combine
    from kernels.triton.mhc_decode import moe_combine_post

    dev = triton_device()
    pairs, shared, x, post, comb = _case(T, k, n, d, T * k + d, dev)
    spy = CountedLaunches(mhc._post_fwd_kernel)
    monkeypatch.setattr(mhc, "_post_fwd_kernel", spy)
    got = moe_combine_post(pairs, shared, k, x, post, comb)
    assert spy.calls == 1 and got.shape == x.shape and got.dtype == x.dtype
    two = mhc.hc_post(moe_combine(pairs, shared, k).view(T, 1, d), x, post, comb)
    assert torch.equal(got, two)
    want = combine_post(*(t.cpu() for t in (pairs, shared)), k, *(t.cpu() for t in (x, post, comb)))
    # the sum is rounded to bf16 once in both; the post's fp32 sums in another order, then rounded again
    err = (got.cpu().float() - want.float()).abs().max().item()
    assert err <= 2 * torch.finfo(torch.bfloat16).eps * max(1.0, want.float().abs().max().item()), err


def test_what_it_cannot_take_is_refused():
    from kernels.triton.mhc_decode import moe_combine_post

    dev = triton_device()
    pairs, shared, x, post, comb = _case(2, 3, 4, 64, 0, dev)
    with pytest.raises(ValueError, match="needs pairs"):
        moe_combine_post(pairs[:5], shared, 3, x, post, comb)
    with pytest.raises(ValueError, match="needs pairs"):
        moe_combine_post(pairs, shared.half(), 3, x, post, comb)
    with pytest.raises(ValueError, match="needs pairs"):
        moe_combine_post(pairs, shared, 0, x, post, comb)
    with pytest.raises(ValueError, match="hc_post"):
        moe_combine_post(pairs, shared, 3, x, post.double(), comb)
    with pytest.raises(ValueError, match="no backward"):
        moe_combine_post(pairs, shared, 3, x.clone().requires_grad_(), post, comb)


def test_the_kernel_compiles_for_sm90_without_spills():
    """The post with the pairs' sum (V4-Flash's top 6, four streams; a decode step's launch) and without it (the
    training forward's, as before): PTX for sm_90 with triton alone, no spilled registers."""
    from kernels.triton import mhc

    c = mhc.MHC_CONFIG
    types = dict(F="*bf16", X="*bf16", POST="*fp32", COMB="*fp32", OUT="*bf16", SHARED="*bf16", T="i32", n="i32",
                 d="i32")
    base = dict(BT=c["post_BT"], NP=4, BD=c["post_BD"], N=4)
    compiles_for_sm90_without_spills(mhc._post_fwd_kernel, types, dict(base, TOPK=6), c["post_warps"])
    compiles_for_sm90_without_spills(mhc._post_fwd_kernel, types, dict(base, SHARED=None, TOPK=0, PDL=False),
                                     c["post_warps"])
