"""The triton ``linear_group`` (``kernels/triton/linear_group.py``): one decode-step input projected by up to eight
weights in one launch, against the torch contract (``kernels.reference.linear_group.linear_group``): the fp32
outputs to fp32 summation order, the half-precision ones within one rounding of their dtype, at one token and a
few, weights of row counts that are not whole blocks, widths below one ``BK`` step. More tokens than the launch
settings' ``max_tokens`` run the contract itself (no launch: counted). What it cannot take is refused with the
reason. With no GPU, ``TRITON_INTERPRET=1`` runs it (fp16); otherwise it skips; the compile test needs triton only
(sm_90, no spills)."""

import pytest
import torch

from ._backends import CountedLaunches, compiles_for_sm90_without_spills, triton_device

pytestmark = pytest.mark.gpu


@pytest.fixture
def launches(monkeypatch):
    from kernels.triton import linear_group as K

    return CountedLaunches.installed(monkeypatch, K, "_linear_group_kernel")


def _case(M, K, rows, seed, dt, dev, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dt)
    ws = [(torch.randn(n, K, generator=g) * K ** -0.5).to(dt) for n in rows]
    return x, ws, x.to(dev), [w.to(dev) for w in ws]


@pytest.mark.parametrize("M,K,rows", [(1, 256, (40, 64, 7, 100, 33, 32, 1)), (3, 64, (16, 5)), (16, 48, (70,)),
                                      (2, 512, (1, 2, 3, 4, 5, 6, 7, 8))])
def test_the_outputs_are_the_torch_contract(launches, M, K, rows):
    from kernels.reference.linear_group import linear_group as ref
    from kernels.triton.linear_group import linear_group

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    x, ws, xd, wd = _case(M, K, rows, M * K, dt, dev, lead=(1,))      # [M, 1, K]: a decode step's shape
    x, xd = x.transpose(0, 1), xd.transpose(0, 1)
    fp32 = [i % 2 == 1 for i in range(len(rows))]
    got = [y.cpu() for y in linear_group(xd, wd, fp32)]
    want = ref(x, ws, fp32)
    assert launches.calls == 1
    for y, z, f in zip(got, want, fp32, strict=True):
        assert y.dtype == z.dtype == (torch.float32 if f else dt) and y.shape == z.shape == (M, 1, z.shape[-1])
        err = (y.float() - z.float()).abs().max().item()
        bound = (1e-5 if f else torch.finfo(dt).eps) * max(1.0, z.float().abs().max().item())
        assert err <= bound, (err, bound)


@pytest.mark.parametrize("split", [2, 4, 3])
def test_shares_of_k_sum_to_the_torch_contract(launches, split):
    """``SPLIT``: each row block's ``K`` in shares, their fp32 partials summed in order by the block's last program
    (3 shares of 8 steps: 2 taken, the largest count that divides them); the counters are back at 0 after the
    launch and a second launch gives the same bits."""
    from kernels.reference.linear_group import linear_group as ref
    from kernels.triton import linear_group as K
    from kernels.triton.tickets import counters

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    x, ws, xd, wd = _case(2, 512, (40, 64, 7), 5, dt, dev)
    fp32 = [False, True, False]
    cfg = dict(BK=64, SPLIT=split)
    got = K.linear_group(xd, wd, fp32, cfg)
    assert launches.calls == 1
    for y, z, f in zip(got, ref(x, ws, fp32), fp32, strict=True):
        err = (y.cpu().float() - z.float()).abs().max().item()
        bound = (1e-5 if f else torch.finfo(dt).eps) * max(1.0, z.float().abs().max().item())
        assert err <= bound, (err, bound)
    assert not counters(torch.device(dev), 1).any()
    assert all(torch.equal(a, b) for a, b in zip(got, K.linear_group(xd, wd, fp32, cfg)))


def test_groups_of_few_row_blocks_split_k_by_default():
    """The launch settings' ``SPLIT`` (None): a group of fewer than ``FEW_BLOCKS`` row blocks (a Flash window layer's
    ``wq_a`` and ``wkv``: 48 blocks of 32 rows) takes ``FEW_BLOCKS_SPLIT`` shares of ``K``, a CSA layer's group
    (130 blocks), the query's projections and the head one; a ``SPLIT`` given is taken as it is."""
    from kernels.triton.linear_group import FEW_BLOCKS, FEW_BLOCKS_SPLIT, LINEAR_GROUP_CONFIG, shares

    assert LINEAR_GROUP_CONFIG["SPLIT"] is None and FEW_BLOCKS_SPLIT == 2 and LINEAR_GROUP_CONFIG["BN"] == 32
    window, csa = (1024 + 512) // 32, (1024 + 512 + 1024 + 1024 + 256 + 256 + 64) // 32
    assert [shares(b) for b in (window, FEW_BLOCKS - 1, FEW_BLOCKS, csa, 1280, 4040)] == [2, 2, 1, 1, 1, 1]
    assert shares(window, dict(SPLIT=1)) == 1 and shares(csa, dict(SPLIT=4)) == 4


def test_weights_read_in_place_with_their_row_stride(launches):
    """A weight whose rows lie apart (columns of a wider tensor) is read where it lies, not copied."""
    from kernels.reference.linear_group import linear_group as ref
    from kernels.triton.linear_group import linear_group

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    x, (w,), xd, (wd,) = _case(2, 128, (48,), 7, dt, dev)
    wide, wide_d = torch.cat((w, w), dim=1), torch.cat((wd, wd), dim=1)       # [48, 256]: rows of stride 256
    part, part_d = wide[:, 128:], wide_d[:, 128:]
    assert part_d.stride() == (256, 1)
    got = linear_group(xd, [part_d], [True])[0].cpu()
    torch.testing.assert_close(got, ref(x, [part], [True])[0], rtol=1e-5, atol=1e-5)
    assert launches.calls == 1


def _most_tokens() -> int:
    """The most rows the kernels take (``kernels.triton.linear_group.token_settings``)."""
    from kernels.triton.linear_group import LINEAR_GROUP_CONFIG, MANY_TOKENS_CONFIG

    return max(LINEAR_GROUP_CONFIG["max_tokens"], MANY_TOKENS_CONFIG["max_tokens"])


def test_more_tokens_than_the_settings_take_run_the_contract(launches):
    from kernels.reference.linear_group import linear_group as ref
    from kernels.triton.linear_group import linear_group

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    M = _most_tokens() + 1
    x, ws, xd, wd = _case(M, 64, (32, 16), 1, dt, dev)
    got = linear_group(xd, wd, [False, True])
    assert launches.calls == 0
    for y, z in zip(got, ref(x, ws, [False, True])):
        torch.testing.assert_close(y.cpu(), z, rtol=1e-3, atol=1e-3)


def test_rows_above_max_tokens_take_the_many_token_settings(monkeypatch, launches, grouped_launches):
    """Above ``LINEAR_GROUP_CONFIG``'s ``max_tokens``, up to ``MANY_TOKENS_CONFIG``'s (64, pinned here so that a
    retune keeps the case): one launch of each kernel with those settings (a GRPO step's rows), the outputs within
    one rounding of the contract; above it the contract (``kernels.triton.linear_group.token_settings``)."""
    from kernels.reference.layers import grouped_projection as bmm
    from kernels.reference.linear_group import linear_group as ref
    from kernels.triton import linear_group as K

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    monkeypatch.setitem(K.MANY_TOKENS_CONFIG, "max_tokens", 64)
    for M, calls in ((40, 1), (64, 2), (65, 2)):
        x, ws, xd, wd = _case(M, 256, (100, 33), M, dt, dev)
        for y, z, f in zip(K.linear_group(xd, wd, [False, True]), ref(x, ws, [False, True]), (False, True)):
            bound = (1e-5 if f else torch.finfo(dt).eps) * max(1.0, z.float().abs().max().item())
            assert (y.cpu().float() - z.float()).abs().max().item() <= bound
        o, w, od, wd = _grouped_case(M, 3, 40, 256, M, dt, dev)
        _within_a_rounding(K.grouped_projection(od, wd).cpu(), bmm(o, w), dt)
        assert launches.calls == grouped_launches.calls == calls
    assert K.token_settings(40)["BK"] == K.MANY_TOKENS_CONFIG["BK"] and K.token_settings(65) is None


def test_what_it_cannot_take_is_refused():
    from kernels.triton.linear_group import linear_group

    dev = triton_device()
    x = torch.zeros(2, 64, dtype=torch.float16, device=dev)
    w = torch.zeros(8, 64, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match="1 to 8 weights"):
        linear_group(x, [w] * 9, [False] * 9)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        linear_group(x.float(), [w.float()], [False])
    with pytest.raises(ValueError, match="multiple of 16"):
        linear_group(x[:, :40], [w[:, :40]], [False])
    with pytest.raises(ValueError, match="input's dtype"):
        linear_group(x, [w.float()], [True])
    with pytest.raises(ValueError, match="no backward"):
        linear_group(x.clone().requires_grad_(), [w], [False])


def test_the_kernel_compiles_for_sm90_without_spills():
    """Seven weights (a CSA layer's group), bf16 and fp32 outputs, one to 16 tokens, and 64 at the many-token
    settings (``MANY_TOKENS_CONFIG``, whose 4 warps spilled here): PTX for sm_90 with triton alone, and ptxas reports
    no spilled registers."""
    from kernels.triton import linear_group as K

    ends = dict(E0=32, E1=48, E2=80, E3=112, E4=116, E5=120, E6=122, E7=122)
    for split, bm in ((1, 16), (4, 16), (1, 64)):              # one program a block, shares of K, 64 tokens
        c = {**K.LINEAR_GROUP_CONFIG, **(K.MANY_TOKENS_CONFIG if bm > 16 else {})}
        consts = dict(**ends, G=7, SPLIT=split, BM=bm, BN=c["BN"], BK=c["BK"], STAGES=c["stages"],
                      LINES=c["prefetch_lines"])
        types = {}
        for a in K._linear_group_kernel.arg_names:
            if a == "X" or a.startswith("W"):
                types[a] = "*bf16"
            elif a.startswith("Y"):
                types[a] = "*fp32" if a in ("Y2", "Y3", "Y4", "Y5") else "*bf16"
            elif a == "PART":
                types[a] = "*fp32"
            elif a == "TICKETS":
                types[a] = "*i32"
            else:
                types[a] = "i32"
        compiles_for_sm90_without_spills(K._linear_group_kernel, types, consts, c["warps"])


@pytest.fixture
def grouped_launches(monkeypatch):
    from kernels.triton import linear_group as K

    return CountedLaunches.installed(monkeypatch, K, "_grouped_kernel")


def _grouped_case(M, G, R, d, seed, dt, dev):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(M, 1, G, d, generator=g).to(dt)                # a decode step's [B, 1, G, d]
    w = (torch.randn(G, R, d, generator=g) * d ** -0.5).to(dt)
    return o, w, o.to(dev), w.to(dev)


def _within_a_rounding(got, want, dt):
    err = (got.float() - want.float()).abs().max().item()
    bound = torch.finfo(dt).eps * max(1.0, want.float().abs().max().item())
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("M,G,R,d,split", [(1, 8, 96, 256, None), (3, 3, 40, 128, None), (16, 2, 33, 64, None),
                                           (2, 16, 32, 512, None), (1, 4, 64, 512, 2), (2, 3, 40, 256, 3)])
def test_grouped_projection_is_the_torch_contract(grouped_launches, M, G, R, d, split):
    """``grouped_projection``: every group's rows in one launch (more groups than ``linear_group``'s eight, rows
    that are not whole blocks, shares of ``K``) within one rounding of the output dtype of the contract
    (``kernels.reference.layers.grouped_projection``), the counters back at 0 and a second launch the same bits."""
    from kernels.reference.layers import grouped_projection as ref
    from kernels.triton.linear_group import grouped_projection
    from kernels.triton.tickets import counters

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    o, w, od, wd = _grouped_case(M, G, R, d, M * G + R, dt, dev)
    cfg = None if split is None else dict(BK=64, SPLIT=split)
    got = grouped_projection(od, wd, cfg)
    assert grouped_launches.calls == 1
    want = ref(o, w)
    assert got.dtype == dt and got.shape == want.shape == (M, 1, G, R)
    _within_a_rounding(got.cpu(), want, dt)
    assert not counters(torch.device(dev), 1).any()
    assert torch.equal(got, grouped_projection(od, wd, cfg))


def test_grouped_projection_of_more_tokens_runs_the_contract(grouped_launches):
    from kernels.reference.layers import grouped_projection as ref
    from kernels.triton.linear_group import grouped_projection

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    o, w, od, wd = _grouped_case(_most_tokens() + 1, 2, 32, 64, 3, dt, dev)
    got = grouped_projection(od, wd)
    assert grouped_launches.calls == 0
    torch.testing.assert_close(got.cpu(), ref(o, w), rtol=1e-3, atol=1e-3)


def test_what_grouped_projection_cannot_take_is_refused():
    from kernels.triton.linear_group import grouped_projection

    dev = triton_device()
    o = torch.zeros(1, 4, 64, dtype=torch.float16, device=dev)
    w = torch.zeros(4, 8, 64, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match=r"o \[\.\.\., G, d\] and w \[G, R, d\]"):
        grouped_projection(o, w[:3])
    with pytest.raises(ValueError, match=r"o \[\.\.\., G, d\] and w \[G, R, d\]"):
        grouped_projection(o, w.float())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        grouped_projection(o.float(), w.float())
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_projection(o[..., :40], w[..., :40])
    with pytest.raises(ValueError, match="no backward"):
        grouped_projection(o, w.clone().requires_grad_())


def test_the_grouped_kernel_compiles_for_sm90_without_spills():
    """One token of eight groups (a Flash layer's ``wo_a``), one program a block and shares of ``K``: PTX for sm_90
    with triton alone, and ptxas reports no spilled registers; 64 tokens at the many-token settings."""
    from kernels.triton import linear_group as K

    types = {a: ("*bf16" if a in ("X", "W", "Y") else "*fp32" if a == "PART" else "*i32" if a == "TICKETS" else "i32")
             for a in K._grouped_kernel.arg_names}
    for split, bm in ((1, 16), (4, 16), (1, 64)):
        c = {**K.LINEAR_GROUP_CONFIG, **(K.MANY_TOKENS_CONFIG if bm > 16 else {})}
        consts = dict(SPLIT=split, BM=bm, BN=c["BN"], BK=c["BK"], STAGES=c["stages"], LINES=c["prefetch_lines"])
        compiles_for_sm90_without_spills(K._grouped_kernel, types, consts, c["warps"])
