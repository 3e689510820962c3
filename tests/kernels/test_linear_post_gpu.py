"""The triton ``linear_post`` (``kernels/triton/linear_group.py``): the attention's ``wo_b`` with the site's mHC
post in the epilogue, one launch where the eager decode step ran ``linear_group`` and ``hc_post``. Bit for bit
against this backend's ``linear_group`` then its ``hc_post`` (the same row blocks and shares of ``K``, the same post
expression, ``kernels.triton.mhc.post_tile``), at one token, a few and the settings' ``max_tokens``, output widths
that are not whole blocks, one program a block and shares of ``K``; more tokens run the two ops (no launch of the
fused kernel: counted); within the roundings of the streams' dtype of the torch contract
(``kernels.reference.slots.linear_post``). What it cannot take is refused with the reason. With no GPU,
``TRITON_INTERPRET=1`` runs it (fp16); the compile test needs triton only (sm_90, no spills)."""

import pytest
import torch

from ._backends import CountedLaunches, compiles_for_sm90_without_spills, triton_device

pytestmark = pytest.mark.gpu


@pytest.fixture
def launches(monkeypatch):
    from kernels.triton import linear_group as K

    return CountedLaunches.installed(monkeypatch, K, "_linear_post_kernel")


def _case(T, K, n, d, seed, dev):
    """A decode step's ``u [T, 1, K]``, ``wo_b [d, K]``, streams ``x [T, 1, n, d]`` and the site's ``post``,
    ``comb``; fp16 under the interpreter (it multiplies bf16 tiles wrongly), else bf16."""
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(T, 1, K, generator=g).to(dt)
    w = (torch.randn(d, K, generator=g) * K ** -0.5).to(dt)
    x = torch.randn(T, 1, n, d, generator=g).to(dt)
    post = 2 * torch.rand(T, 1, n, generator=g)
    comb = torch.rand(T, 1, n, n, generator=g)
    return [t.to(dev) for t in (u, w, x, post, comb)]


def _two_ops(u, w, x, post, comb, config=None):
    """This backend's ``linear_group`` (``wo_b``, as ``kernels.reference.decode.eager_linear`` calls it), then its
    ``hc_post``: the eager step's two launches."""
    from kernels.triton import mhc
    from kernels.triton.linear_group import linear_group

    return mhc.hc_post(linear_group(u, [w], [False], config)[0], x, post, comb)


@pytest.mark.parametrize("T,K,n,d,config", [(1, 256, 4, 256, None), (3, 128, 4, 300, None), (16, 64, 4, 96, None),
                                            (2, 256, 2, 64, dict(SPLIT=2)), (1, 512, 4, 128, dict(SPLIT=4))])
def test_it_is_linear_group_then_hc_post_bit_for_bit(launches, T, K, n, d, config):
    from kernels.reference.slots import linear_post as contract
    from kernels.triton.linear_group import linear_post

    dev = triton_device()
    u, w, x, post, comb = _case(T, K, n, d, T * K + d, dev)
    got = linear_post(u, w, x, post, comb, config)
    assert launches.calls == 1 and got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, _two_ops(u, w, x, post, comb, config))
    want = contract(*(t.cpu().float() for t in (u, w, x)), post.cpu(), comb.cpu())
    # the projection is rounded to the streams' dtype, then the post's sum is rounded again
    err = (got.cpu().float() - want).abs().max().item()
    assert err <= 4 * torch.finfo(x.dtype).eps * max(1.0, want.abs().max().item()), err


def test_more_tokens_than_the_settings_take_run_the_two_ops(launches):
    from kernels.triton.linear_group import LINEAR_GROUP_CONFIG, MANY_TOKENS_CONFIG, linear_post

    dev = triton_device()
    T = max(LINEAR_GROUP_CONFIG["max_tokens"], MANY_TOKENS_CONFIG["max_tokens"]) + 1
    u, w, x, post, comb = _case(T, 64, 4, 128, 7, dev)
    got = linear_post(u, w, x, post, comb)
    assert launches.calls == 0
    assert torch.equal(got, _two_ops(u, w, x, post, comb))


def test_rows_above_max_tokens_take_the_many_token_settings(monkeypatch, launches):
    """Above ``max_tokens``, up to ``MANY_TOKENS_CONFIG``'s (64, pinned here so that a retune keeps the case): one
    launch with those settings, the bits of ``linear_group`` (at the same settings) then ``hc_post``."""
    from kernels.triton import linear_group as K

    dev = triton_device()
    monkeypatch.setitem(K.MANY_TOKENS_CONFIG, "max_tokens", 64)
    u, w, x, post, comb = _case(40, 256, 4, 96, 5, dev)
    got = K.linear_post(u, w, x, post, comb)
    assert launches.calls == 1 and torch.equal(got, _two_ops(u, w, x, post, comb))


def test_the_block_tickets_are_back_at_zero():
    """Shares of ``K``: a second launch on the same counters gives the same bits (the last program of each block
    set its ticket back)."""
    from kernels.triton.linear_group import linear_post

    dev = triton_device()
    u, w, x, post, comb = _case(2, 256, 4, 96, 3, dev)
    first = linear_post(u, w, x, post, comb, dict(SPLIT=2))
    assert torch.equal(linear_post(u, w, x, post, comb, dict(SPLIT=2)), first)


def test_what_it_cannot_take_is_refused():
    from kernels.triton.linear_group import linear_post

    dev = triton_device()
    u, w, x, post, comb = _case(2, 64, 4, 64, 0, dev)
    with pytest.raises(ValueError, match="linear_post: u .*needs u"):
        linear_post(u, w[:32], x, post, comb)                         # wo_b's rows are not the streams' width
    with pytest.raises(ValueError, match="needs u"):
        linear_post(u[:1], w, x, post, comb)                          # another token count
    with pytest.raises(ValueError, match="needs u"):
        linear_post(u.float(), w.float(), x, post, comb)              # u not in the streams' dtype
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_post(u[..., :40], w[:, :40], x, post, comb)
    with pytest.raises(ValueError, match="hc_post"):
        linear_post(u, w, x, post.double(), comb)
    with pytest.raises(ValueError, match="no backward"):
        linear_post(u, w, x.clone().requires_grad_(), post, comb)
    with pytest.raises(ValueError, match="no backward"):
        linear_post(u.clone().requires_grad_(), w, x, post, comb)


def test_the_kernel_compiles_for_sm90_without_spills():
    """V4-Flash's ``wo_b`` (8 groups of 1,024 in, four streams of 4,096 out) at one program a block and in shares of
    ``K``, one to 16 tokens, and 64: PTX for sm_90 with triton alone, and ptxas reports no spilled registers."""
    from kernels.triton import linear_group as K

    types = {a: "i32" for a in K._linear_post_kernel.arg_names}
    types.update(U="*bf16", W="*bf16", X="*bf16", POST="*fp32", COMB="*fp32", OUT="*bf16", PART="*fp32",
                 TICKETS="*i32")
    for split, bm in ((1, 16), (2, 16), (1, 64)):              # and 64 tokens at the many-token settings
        c = {**K.LINEAR_GROUP_CONFIG, **(K.MANY_TOKENS_CONFIG if bm > 16 else {})}
        consts = dict(SPLIT=split, BM=bm, BN=c["BN"], BK=c["BK"], STAGES=c["stages"], NP=4, NS=4,
                      LINES=c["prefetch_lines"])
        compiles_for_sm90_without_spills(K._linear_post_kernel, types, consts, c["warps"])
