"""The triton backend's grouped GEMM of the decode step's routed experts (``kernels/triton/experts.py``) against
the product it replaces, ``x_rows @ w[e]^T`` per expert.

Oracle: each expert's rows times its weight in fp64 from the same bf16 inputs. Bound: one bf16 rounding of the
output (two under the interpreter, which truncates) at the magnitude of the row's terms (sum of |x||w|), the
rounding of ``torch._grouped_mm``'s bf16 output too. Groups: experts without rows (first, middle, last), an
expert with more rows than one program's ``BM`` (so a program loops over its rows and reads its weights again),
output and reduction sizes that are not multiples of the tiles. On a GPU also the Flash-shaped decode step
(64 sequences x 6 experts over 32, hidden 4096, expert width 2048: both GEMMs) against ``torch._grouped_mm``.
Refusals name the fix. With no GPU, ``TRITON_INTERPRET=1`` runs the small cases; otherwise they skip.
"""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


def _case(counts, N, K, dev, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    R = sum(counts)
    x = torch.randn(R, K, generator=g).to(dtype)
    w = (torch.randn(len(counts), N, K, generator=g) * K ** -0.5).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x.to(dev), w.to(dev), offs.to(dev)


def _exact(x, w, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end].double() @ w[e].double().t())
        start = end
    return torch.cat(out), torch.cat([x[s:t].double().abs() @ w[e].double().abs().t()
                                      for e, (s, t) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])


@pytest.mark.parametrize("counts,N,K", [
    pytest.param([0, 3, 0, 1, 20, 0], 72, 200, id="empty-and-looping-experts"),
    pytest.param([5, 7], 64, 128, id="whole-tiles"),
    pytest.param([1, 0, 0, 0], 33, 17, id="one-row"),
    pytest.param([130, 0, 66, 40], 40, 48, id="wide-row-steps"),    # WIDE_CONFIG: experts of several steps
])
def test_experts_grouped_mm_matches_each_experts_product(counts, N, K):
    from kernels.triton.experts import experts_grouped_mm

    dev = triton_device()
    x, w, offs = _case(counts, N, K, dev)
    got = experts_grouped_mm(x, w, offs)
    exact, scale = _exact(x.cpu(), w.cpu(), offs.cpu())
    assert got.dtype == x.dtype and got.shape == (sum(counts), N)
    steps = 4 if dev == "cpu" else 2
    err = (got.cpu().double() - exact).abs()
    assert (err <= steps * 2.0 ** -8 * scale + 1e-30).all(), err.max().item()


def test_launch_settings_widen_the_row_step_for_many_rows_an_expert():
    """The narrow settings up to WIDE_FROM rows an expert (a Flash-shaped step of 1 sequence: 6 pairs over 32
    experts), the wide ones above (64 and 256 sequences: 12 and 48 rows an expert)."""
    from kernels.triton.experts import EXPERTS_CONFIG, FEW_ROWS, FEW_ROWS_SPLIT, WIDE_CONFIG, WIDE_FROM, launch_settings

    assert WIDE_FROM == 8 and WIDE_CONFIG["BM"] > EXPERTS_CONFIG["BM"] and FEW_ROWS == 16
    few = dict(EXPERTS_CONFIG, SPLIT=FEW_ROWS_SPLIT)      # one or two sequences: the reduction split in shares
    assert [launch_settings(r, 32) for r in (0, 7, 16, 17, 256, 257, 384, 1536)] == \
        [few] * 3 + [EXPERTS_CONFIG] * 2 + [WIDE_CONFIG] * 3
    assert launch_settings(5, 0) == few and launch_settings(236, 4) == WIDE_CONFIG
    assert EXPERTS_CONFIG["TIGHT_GRID"] and WIDE_CONFIG["TIGHT_GRID"]      # the grid's bounded routed blocks


@pytest.mark.parametrize("seqs", [64, 256])
def test_the_flash_shaped_decode_step_equals_torchs_grouped_gemm(seqs):
    if not torch.cuda.is_available():
        pytest.skip("Flash shape: GPU only")
    from kernels.triton.experts import experts_grouped_mm

    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(32, generator=g)[:6] for _ in range(seqs)]).flatten()
    counts = torch.bincount(idx, minlength=32).tolist()
    for N, K in ((2 * 2048, 4096), (4096, 2048)):          # gate and up in one, then down
        x, w, offs = _case(counts, N, K, "cuda", seed=N)
        got = experts_grouped_mm(x, w, offs)
        want = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        exact, scale = _exact(x.cpu(), w.cpu(), offs.cpu())
        for name, y, fn in (("triton", got, lambda: experts_grouped_mm(x, w, offs)),
                            ("torch", want, lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))):
            err = (y.cpu().double() - exact).abs() / scale.clamp(min=1e-30)
            us = _time_us(fn)
            print(f"{name} {seqs} sequences N={N} K={K}: max error / |terms| {err.max().item():.2e}, {us:.1f} us, "
                  f"{w.numel() * 2 / us / 1e6:.0f} GB/s of weights")
        assert ((got.cpu().double() - exact).abs() <= 2 * 2.0 ** -8 * scale + 1e-30).all()


def _time_us(fn, reps: int = 50) -> float:
    """Mean microseconds of ``fn`` on the GPU (printed beside the check; not asserted)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def test_refusals_name_the_fix():
    from kernels.triton.experts import experts_grouped_mm

    dev = triton_device()
    x, w, offs = _case([2, 1], 16, 32, dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        experts_grouped_mm(x.float(), w, offs)
    with pytest.raises(ValueError, match="needs x \\[R, K\\] and w \\[E, N, K\\]"):
        experts_grouped_mm(x, w[:, :, :16], offs)
    with pytest.raises(ValueError, match="int32 end rows"):
        experts_grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match="no backward"):
        experts_grouped_mm(x.requires_grad_(), w, offs)


EXPERTS_TYPES = {"X": "*bf16", "W": "*bf16", "OFFS": "*i32", "Y": "*bf16", "ORDER": "*i64", "WS": "*bf16", "N": "i32",
                 "K": "i32", "TOPK": "i32", "NE": "i32", "RR": "i32", "SH": "i32", "RB": "i32", "PART": "*fp32",
                 "TICKETS": "*i32", "RW": "*fp32", "limit": "fp32"}


@pytest.mark.parametrize("rows", [6, 1536])
def test_the_kernel_compiles_for_sm90(rows):
    """The kernel at both launch settings (few rows an expert, the reduction split in shares; many rows, one program
    a block) compiles to PTX for sm_90 (H100/H200) with triton alone, no GPU (the interpreter runs code the compiler rejects)."""
    import importlib.util
    import itertools
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import experts as K

    c = K.launch_settings(rows, 32)
    splits = (1, 4) if rows <= K.FEW_ROWS else (c["SPLIT"],)           # one program a block, and shares of K
    for split, gather, scatter, shared, swiglu in itertools.product(splits, *[(False, True)] * 4):
        if gather and scatter or swiglu and not scatter:    # plain; through the order; shared; the activation
            continue
        consts = dict(BM=c["BM"], BN=c["BN"], BK=c["BK"], STAGES=c["STAGES"], F32=False, GATHER=gather,
                      SCATTER=scatter, SHARED=shared, SPLIT=split, SWIGLU=swiglu, HAS_LIMIT=swiglu, EP=32)
        sig = {**EXPERTS_TYPES, **{k: "constexpr" for k in consts}}
        compiled = compile(ASTSource(K._experts_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=c["WARPS"]))
        assert ".entry" in compiled.asm["ptx"]


def test_the_decode_steps_grouped_experts_run_the_kernel_of_the_op_table(monkeypatch):
    """A bf16 MoE layer of the tiny model in the decode step's grouped path: with the triton op table on its
    modules (as the rollout engine sets it, ``kernels.reference.model.ops_in_use``) the experts run
    the triton GEMMs that read the tokens and write the pairs through the expert order (``triton.experts_gather_mm``,
    ``triton.experts_swiglu_scatter_mm`` with the activation in its operand load; the order
    ``triton.expert_order``'s, routed by ``triton.route_experts``), summed with the shared expert by
    ``triton.moe_combine``, and give torch's grouped GEMM's output within bf16 rounding; without a table, torch's
    (no kernel counted). Both GEMMs launch the grid of the launch settings' bounded routed blocks
    (``routed_blocks``) and the shared expert's."""
    from core.config import preset
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from kernels.reference.model import DeepseekV4Model, init_weights, ops_in_use
    from kernels.reference.slots import moe_decode, stack_expert_weights
    from kernels.triton import experts as KE
    from kernels.triton.backend import ops

    dev = triton_device()
    c = preset("tiny")
    model = DeepseekV4Model(c)
    init_weights(model, 0)
    model = model.to(torch.bfloat16).to(dev)
    stack_expert_weights(model)
    layer = next(l for l in model.layers if not l.ffn.gate.hash)          # learned routing: the rows spread
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 1, c.dim, generator=g).bfloat16().to(dev)
    ids = torch.randint(0, c.vocab_size, (16, 1), generator=g).to(dev)
    with torch.no_grad():
        want, want_idx = moe_decode(layer.ffn, x, ids, "grouped")
        reset_kernels_ran()
        spy = _Grids(KE._experts_kernel)
        monkeypatch.setattr(KE, "_experts_kernel", spy)
        with ops_in_use(model, ops()):
            got, got_idx = moe_decode(layer.ffn, x, ids, "grouped")
    T, E = x.shape[0], c.n_routed_experts
    R = T * c.n_activated_experts
    cfg = KE.launch_settings(R + T, E + 1)
    groups = KE.routed_blocks(R, E, cfg) + -(-T // cfg["BM"])
    assert [grid[0] for grid in spy.grids] == [groups] * 2, (spy.grids, groups)
    ran = kernels_ran()                  # gate and up reading the tokens, down writing the pairs, through the order
    assert ran.get("triton.experts_gather_mm") == ran.get("triton.experts_swiglu_scatter_mm") == 1
    assert ran.get("triton.moe_combine") == 1 and "triton.experts_grouped_mm" not in ran     # the pairs' sum
    # the shared expert is one expert more, and the activation of all rows is the second GEMM's operand load
    assert "triton.weighted_swiglu" not in ran and "triton.experts_scatter_mm" not in ran, ran
    assert kernels_ran().get("triton.expert_order") == 1                 # the pairs in expert order, one launch
    assert kernels_ran().get("triton.route_experts") == 1                # the router, one launch
    assert torch.equal(got_idx, want_idx)
    err = (got.float() - want.float()).abs().max().item()
    steps = 8 if dev == "cpu" else 4       # the interpreter truncates each bf16 cast: the shared expert's too now
    assert err <= steps * 2.0 ** -8 * want.float().abs().max().item(), err


@pytest.mark.parametrize("R,E", [(0, 4), (1, 32), (6, 32), (384, 32), (200, 7), (1536, 256), (130, 3)])
def test_expert_order_is_the_stable_sort_by_expert(R, E):
    """The one-launch order of the (token, expert) pairs equals the stable sort by expert id and the reference's
    counting (``kernels.reference.slots.expert_order``), integers equal: every expert's pairs in their own order,
    its end row; decode shapes of 1, 64 and 256 Flash-shaped sequences (V4-Flash's 256 experts at 256), empty
    experts, sizes off the kernel's 1,024-pair step (1,536: two steps carrying the running count)."""
    from kernels.reference.slots import expert_order as counted
    from kernels.triton.experts import expert_order

    dev = triton_device()
    flat = torch.randint(0, E, (R,), generator=torch.Generator().manual_seed(R + E)).to(dev)
    order, ends = expert_order(flat, E)
    want_order, want_ends = counted(flat, E)
    assert order.dtype == torch.long and ends.dtype == torch.int32
    assert torch.equal(order.cpu(), flat.cpu().argsort(stable=True)) and torch.equal(order, want_order)
    assert torch.equal(ends, want_ends)
    # with the pairs' weights: those weights in the same order, then the shared expert's rows' ones
    weights = torch.rand(R, generator=torch.Generator().manual_seed(R)).to(dev)
    tail = R // 6 + 1
    got = expert_order(flat, E, weights, tail)
    want = counted(flat, E, weights, tail)
    assert torch.equal(got[0], order) and torch.equal(got[1], ends)
    assert torch.equal(got[2].cpu(), want[2].cpu()) and got[2].shape == (R + tail,)
    assert torch.equal(want[2][:R].cpu(), weights.cpu()[flat.cpu().argsort(stable=True)])
    assert bool((want[2][R:] == 1).all())


def test_expert_order_refuses_what_it_cannot_serve():
    from kernels.triton.experts import MAX_ORDER_EXPERTS, expert_order

    dev = triton_device()
    flat = torch.tensor([1, 0, 1], device=dev)
    with pytest.raises(ValueError, match="needs int64 ids"):
        expert_order(flat.int(), 2)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        expert_order(flat, MAX_ORDER_EXPERTS + 1)
    with pytest.raises(ValueError, match="fp32 weights"):
        expert_order(flat, 2, torch.ones(3, dtype=torch.float16, device=dev), 1)


@pytest.mark.parametrize("counts,topk", [([0, 3, 0, 1, 20, 0], 2), ([130, 0, 66, 40], 4)])
def test_the_pair_gemms_and_the_sum_are_their_torch_contracts(counts, topk):
    """``experts_gather_mm`` (rows read from the tokens through the order), ``experts_scatter_mm`` (rows written
    to the pairs' own rows) and ``moe_combine`` (a token's pairs and shared expert summed) against their torch
    contracts in ``kernels.reference.slots``: the GEMMs within the bound of the plain kernel, at the same rows,
    the sum within one rounding of its dtype. Narrow and wide row steps."""
    from kernels.reference.slots import combine_pairs, expert_order
    from kernels.triton.experts import experts_gather_mm, experts_scatter_mm, moe_combine

    dev = triton_device()
    R, E, K, N = sum(counts), len(counts), 48, 40
    assert R % topk == 0
    g = torch.Generator().manual_seed(R)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])[torch.randperm(R, generator=g)]
    order, offs = expert_order(ids, E)
    tokens = torch.randn(R // topk, K, generator=g).bfloat16()
    _, w, _ = _case(counts, N, K, "cpu", seed=7)
    got = experts_gather_mm(tokens.to(dev), w.to(dev), offs.to(dev), order.to(dev), topk).cpu()
    exact, scale = _exact(tokens.index_select(0, order // topk), w, offs)
    steps = 4 if dev == "cpu" else 2
    assert ((got.double() - exact).abs() <= steps * 2.0 ** -8 * scale + 1e-30).all()
    rows = torch.randn(R, K, generator=g).bfloat16()
    got = experts_scatter_mm(rows.to(dev), w.to(dev), offs.to(dev), order.to(dev)).cpu()
    exact, scale = _exact(rows, w, offs)
    placed = torch.empty_like(exact).index_copy_(0, order, exact)
    bound = torch.empty_like(scale).index_copy_(0, order, scale)
    assert ((got.double() - placed).abs() <= steps * 2.0 ** -8 * bound + 1e-30).all()
    pairs, shared = torch.randn(R, N, generator=g).bfloat16(), torch.randn(R // topk, N, generator=g).bfloat16()
    got = moe_combine(pairs.to(dev), shared.to(dev), topk).cpu()
    want = combine_pairs(pairs, shared, topk)
    assert got.dtype == shared.dtype
    assert (got.float() - want.float()).abs().max() <= steps * 2.0 ** -8 * want.float().abs().max()
    # the shared expert as one expert more: the tokens' rows after the pairs', in both GEMMs
    ws = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    got = experts_gather_mm(tokens.to(dev), w.to(dev), offs.to(dev), order.to(dev), topk, ws.to(dev)).cpu()
    exact, scale = _exact(tokens.index_select(0, order // topk), w, offs)
    exact = torch.cat((exact, tokens.double() @ ws.double().t()))
    scale = torch.cat((scale, tokens.double().abs() @ ws.double().abs().t()))
    assert got.shape == (R + R // topk, N)
    assert ((got.double() - exact).abs() <= steps * 2.0 ** -8 * scale + 1e-30).all()
    more = torch.randn(R // topk, K, generator=g).bfloat16()
    got = experts_scatter_mm(torch.cat((rows, more)).to(dev), w.to(dev), offs.to(dev), order.to(dev),
                             ws.to(dev)).cpu()
    want = torch.cat((placed, more.double() @ ws.double().t()))
    bound = torch.cat((bound, more.double().abs() @ ws.double().abs().t()))
    assert ((got.double() - want).abs() <= steps * 2.0 ** -8 * bound + 1e-30).all()
    with pytest.raises(ValueError, match="shared expert"):
        experts_gather_mm(tokens.to(dev), w.to(dev), offs.to(dev), order.to(dev), topk, ws[:, :8].to(dev))
    with pytest.raises(ValueError, match="int64 order"):
        experts_gather_mm(tokens.to(dev), w.to(dev), offs.to(dev), order.to(dev).int(), topk)
    with pytest.raises(ValueError, match="needs pairs"):
        moe_combine(pairs.to(dev), shared.to(dev), topk + 1)


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("counts,topk", [([0, 3, 0, 1, 20, 0], 2), ([130, 0, 66, 40], 4), ([1, 0, 1, 1], 3)])
def test_a_split_reduction_gives_the_same_products(counts, topk, split):
    """``SPLIT`` shares of ``K`` (the few-rows settings, one or two sequences), each share's partial summed in order
    by the block's last program: the plain GEMM, the gather with the shared expert and the scatter with it within
    the plain kernel's bound of the exact products, the same bits on a second call, and every ticket counter back
    at 0. Experts of several row steps (20 and 130 rows), experts without rows, a share past ``K`` (4 shares of 3
    steps of 16)."""
    from kernels.reference.slots import expert_order
    from kernels.triton import tickets
    from kernels.triton.experts import experts_grouped_mm_launch, launch_settings

    dev = triton_device()
    R, E, K, N = sum(counts), len(counts), 48, 40
    g = torch.Generator().manual_seed(R + split)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])[torch.randperm(R, generator=g)]
    order, offs = expert_order(ids, E)
    tokens = torch.randn(R // topk, K, generator=g).bfloat16()
    rows = torch.randn(R + R // topk, K, generator=g).bfloat16()
    _, w, _ = _case(counts, N, K, "cpu", seed=7)
    ws = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    steps = 4 if dev == "cpu" else 2

    def run(**kw):
        c = dict(launch_settings(R + R // topk, E + 1), BK=16, SPLIT=split)
        x = kw.pop("x")
        args = [t.to(dev) for t in (x, w, offs)]
        got = experts_grouped_mm_launch(*args, config=c, **{k: v.to(dev) if torch.is_tensor(v) else v
                                                            for k, v in kw.items()})
        again = experts_grouped_mm_launch(*args, config=c, **{k: v.to(dev) if torch.is_tensor(v) else v
                                                              for k, v in kw.items()})
        assert torch.equal(got, again)
        return got.cpu().double()

    exact, scale = _exact(rows[:R], w, offs)
    assert ((run(x=rows[:R]) - exact).abs() <= steps * 2.0 ** -8 * scale + 1e-30).all()
    exact, scale = _exact(tokens.index_select(0, order // topk), w, offs)
    exact = torch.cat((exact, tokens.double() @ ws.double().t()))
    scale = torch.cat((scale, tokens.double().abs() @ ws.double().abs().t()))
    got = run(x=tokens, order=order, topk=topk, shared=ws)
    assert ((got - exact).abs() <= steps * 2.0 ** -8 * scale + 1e-30).all()
    exact, scale = _exact(rows[:R], w, offs)
    want = torch.cat((torch.empty_like(exact).index_copy_(0, order, exact), rows[R:].double() @ ws.double().t()))
    bound = torch.cat((torch.empty_like(scale).index_copy_(0, order, scale),
                       rows[R:].double().abs() @ ws.double().abs().t()))
    got = run(x=rows, order=order, scatter=True, shared=ws)
    assert ((got - want).abs() <= steps * 2.0 ** -8 * bound + 1e-30).all()
    for buffer in tickets._COUNTERS.values():
        assert int(buffer.count_nonzero()) == 0


class _Grids:
    """Records each launch's grid of ``kernels.triton.experts._experts_kernel`` and launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


# more tokens than one program's row step: 20 at the narrow settings' 16 (two blocks), 192 at the wide ones' 64
# (three; a decode step of 256 Flash-shaped sequences has four)
SHARED_BLOCK_CASES = [pytest.param([3, 2, 0, 4, 2, 3, 1, 2, 5, 0, 3, 2, 4, 1, 3, 5], 2, 16, 2, id="narrow"),
                      pytest.param([70, 0, 60, 62], 1, 64, 3, id="wide")]


@pytest.mark.parametrize("split,tight", [(1, True), (2, True), (1, False)])
@pytest.mark.parametrize("counts,topk,bm,blocks", SHARED_BLOCK_CASES)
def test_the_shared_experts_rows_are_a_program_a_row_block(monkeypatch, counts, topk, bm, blocks, split, tight):
    """The shared expert takes every token, so its rows are ``cdiv(T, BM)`` programs of a column block (the grid's
    first dimension ``routed_blocks(R, E) + blocks``: the routed row blocks', then these), where one program looped
    over all of them and finished last. The gather, the scatter and the activation's GEMM with the shared expert
    against the exact products (fp64): the routed rows and the shared expert's, at one and two shares of ``K``,
    and with the looser grid (``TIGHT_GRID`` off: ``E + cdiv(R, BM)`` routed blocks); every ticket counter back at
    0."""
    from kernels.reference.moe import weighted_swiglu as reference
    from kernels.reference.slots import expert_order
    from kernels.triton import experts as KE, tickets

    dev = triton_device()
    R, E, K, N = sum(counts), len(counts), 48, 40
    T = R // topk
    assert KE.launch_settings(R + T, E + 1)["BM"] == bm and -(-T // bm) == blocks
    g = torch.Generator().manual_seed(R + split)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])[torch.randperm(R, generator=g)]
    order, offs, weights = expert_order(ids, E, torch.rand(R, generator=g), T)
    tokens = torch.randn(T, K, generator=g).bfloat16()
    rows = torch.randn(R + T, K, generator=g).bfloat16()
    h = (torch.randn(R + T, 2 * K, generator=g) * 8).bfloat16()
    _, w, _ = _case(counts, N, K, "cpu", seed=11)
    ws = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    spy = _Grids(KE._experts_kernel)
    monkeypatch.setattr(KE, "_experts_kernel", spy)
    steps = 4 if dev == "cpu" else 2
    a = reference(h.double(), weights.double(), 10.0).bfloat16()         # the activation, rounded as the kernel does
    for x, kw, routed in ((tokens, dict(topk=topk), tokens.index_select(0, order // topk)),
                          (rows, dict(scatter=True), rows[:R]),
                          (h, dict(scatter=True, weights=weights, limit=10.0), a[:R])):
        got = KE.experts_grouped_mm_launch(x.to(dev), w.to(dev), offs.to(dev),
                                           config=dict(SPLIT=split, TIGHT_GRID=tight),
                                           order=order.to(dev), shared=ws.to(dev),
                                           **{k: v.to(dev) if torch.is_tensor(v) else v for k, v in kw.items()})
        exact, scale = _exact(routed, w, offs)
        if kw.get("scatter"):
            exact = torch.empty_like(exact).index_copy_(0, order, exact)
            scale = torch.empty_like(scale).index_copy_(0, order, scale)
        own = tokens if "topk" in kw else (rows if "weights" not in kw else a)[R:]
        exact = torch.cat((exact, own.double() @ ws.double().t()))
        scale = torch.cat((scale, own.double().abs() @ ws.double().abs().t()))
        err = (got.cpu().double() - exact).abs()
        assert (err <= 2 * steps * 2.0 ** -8 * scale + 1e-30).all(), err.max().item()
    assert [grid[0] for grid in spy.grids] == [KE.routed_blocks(R, E, dict(BM=bm, TIGHT_GRID=tight)) + blocks] * 3, \
        spy.grids
    for buffer in tickets._COUNTERS.values():
        assert int(buffer.count_nonzero()) == 0


@pytest.mark.parametrize("counts,bm,bound", [
    pytest.param([0, 3, 0, 1, 20, 0], 16, 7, id="narrow-hot-expert"),   # 20 rows: two blocks of 16
    pytest.param([130, 0, 66, 40, 0], 64, 8, id="wide-hot-experts"),    # three blocks, then two, then one
    pytest.param([0, 0, 0], 16, 0, id="no-rows"),
    pytest.param([5] * 33, 16, 41, id="more-experts-than-a-power-of-two"),
    pytest.param([1] * 6 + [0] * 26, 16, 6, id="one-flash-sequence"),   # the bound reached: a block each
    pytest.param([17, 17], 16, 4, id="two-blocks-each"),
    pytest.param([16, 1], 16, 2, id="a-whole-block-and-a-row"),
])
def test_a_hot_experts_rows_are_a_program_a_row_block(counts, bm, bound):
    """Every row block of ``BM`` rows is a program of its own (``_row_block``): program ``g`` of the grid's
    routed blocks (``routed_blocks``: ``m + (R - m) // BM``, ``m = min(E, R)``, here counted by hand) takes the
    ``g``-th block in expert order, and the programs past the last block none, where one program an expert looped
    over a hot expert's row steps one after another. Against the blocks counted in Python: each program's expert
    and rows, every row in exactly one block, and the grid holds them all where the bound is reached."""
    from kernels.triton.experts import routed_blocks

    from ._experts_probe import row_blocks

    dev = triton_device()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    want, start = [], 0
    for e, end in enumerate(offs.tolist()):
        want += [(e, r, min(r + bm, end)) for r in range(start, end, bm)]
        start = end
    R, E = sum(counts), len(counts)
    grid = routed_blocks(R, E, dict(BM=bm))
    assert grid == bound
    got = row_blocks(offs.to(dev), bm, grid).cpu().tolist() if grid else []
    assert len(got) >= len(want) and [tuple(b) for b in got[:len(want)]] == want
    assert all(b[1] == b[2] for b in got[len(want):])                  # the rest: no rows
    g = torch.Generator().manual_seed(len(counts))
    for _ in range(200):                                                # the bound over random loads
        c = (torch.rand(E, generator=g) < 0.5) * torch.randint(0, 3 * bm, (E,), generator=g)
        assert sum(-(-int(n) // bm) for n in c) <= routed_blocks(int(c.sum()), E, dict(BM=bm))


def test_the_order_kernel_compiles_for_sm90():
    """One program an expert: the kernel does not depend on the number of experts."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import experts as K

    for weights in (False, True):           # with the pairs' weights in the same order (and the tail of ones)
        consts = dict(BR=K.ORDER_ROWS, WEIGHTS=weights)
        sig = {"FLAT": "*i64", "ORDER": "*i64", "ENDS": "*i32", "WIN": "*fp32", "WOUT": "*fp32", "R": "i32",
               "TAIL": "i32", **{k: "constexpr" for k in consts}}
        compiled = compile(ASTSource(K._order_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4))
        assert ".entry" in compiled.asm["ptx"]


def _activation_case(counts, topk, K, N, shared, dev, seed=0):
    """The second expert GEMM's inputs as the eager step makes them: ``h = [gate | up]`` ``[R (+ T), 2K]`` (drawn
    wide, so that the clamp at 10 cuts a share of both halves), the pairs' fp32 routing weights in expert order
    with the shared expert's ones after them (``expert_order``'s), the order, the ends, ``w2 [E, N, K]`` and the
    shared expert's ``[N, K]`` or None."""
    from kernels.reference.slots import expert_order

    R, E, T = sum(counts), len(counts), sum(counts) // topk
    g = torch.Generator().manual_seed(seed + R)
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])[torch.randperm(R, generator=g)]
    order, offs, weights = expert_order(ids, E, torch.rand(R, generator=g), T if shared else 0)
    h = (torch.randn(R + (T if shared else 0), 2 * K, generator=g) * 8).bfloat16()
    w2 = (torch.randn(E, N, K, generator=g) * K ** -0.5).bfloat16()
    ws = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16() if shared else None
    return [None if t is None else t.to(dev) for t in (h, weights, order, offs, w2, ws)]


# experts without rows (first, middle, last) and one of more rows than the narrow settings' 16-row step; the wide
# settings (48 rows an expert on average) with experts of more rows than their 64-row step
ACTIVATION_CASES = [pytest.param([0, 3, 0, 1, 20, 0], 2, id="narrow"), pytest.param([130, 0, 66, 40], 4, id="wide")]


@pytest.mark.parametrize("limit", [10.0, 0.0, -1.0], ids=["clamped", "no-clamp", "negative-limit"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "routed-only"])
@pytest.mark.parametrize("counts,topk", ACTIVATION_CASES)
def test_the_swiglu_scatter_gemm_is_its_torch_contract(counts, topk, shared, limit):
    """``experts_swiglu_scatter_mm`` against ``kernels.reference.slots.swiglu_scatter_grouped_mm`` (the activation,
    cast to bf16, then the scatter GEMM): within two of the plain kernel's bounds at the magnitude of the row's
    terms (each side rounds the activation and the output once; the interpreter truncates), rows written to the
    pairs' own rows and the shared expert's after them."""
    from kernels.reference.moe import weighted_swiglu as reference
    from kernels.reference.slots import swiglu_scatter_grouped_mm
    from kernels.triton.experts import experts_swiglu_scatter_mm, launch_settings

    dev = triton_device()
    K, N = 48, 40
    h, weights, order, offs, w2, ws = _activation_case(counts, topk, K, N, shared, dev)
    R, T = order.shape[0], h.shape[0] - order.shape[0]
    assert launch_settings(R + T, len(counts) + shared)["BM"] == (16 if len(counts) == 6 else 64)
    got = experts_swiglu_scatter_mm(h, weights, limit, w2, offs, order, ws).cpu()
    cpu = [None if t is None else t.cpu() for t in (h, weights, order, offs, w2, ws)]
    want = swiglu_scatter_grouped_mm(cpu[0], cpu[1], limit, cpu[4], cpu[3], cpu[2], cpu[5])
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (R + T, N)
    a = reference(cpu[0].double(), cpu[1].double(), limit).abs()                 # the activation's magnitudes
    _, scale = _exact(a[:R], cpu[4].double().abs(), cpu[3])
    scale = torch.empty_like(scale).index_copy_(0, cpu[2], scale)
    if shared:
        scale = torch.cat((scale, a[R:] @ cpu[5].double().abs().t()))
    steps = 4 if dev == "cpu" else 2
    err = (got.double() - want.double()).abs()
    assert (err <= 2 * steps * 2.0 ** -8 * scale + 1e-30).all(), err.max().item()


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("limit", [10.0, 0.0], ids=["clamped", "no-clamp"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "routed-only"])
@pytest.mark.parametrize("counts,topk", ACTIVATION_CASES)
def test_the_swiglu_scatter_gemm_keeps_the_bits_of_the_activation_then_the_scatter(counts, topk, shared, limit,
                                                                                   split):
    """The fused GEMM and the two launches it replaces (the triton ``weighted_swiglu`` to bf16, then the triton
    scatter GEMM) give the same bits: through the ops at the launch settings, and at ``SPLIT`` shares of ``K``
    (2; 4 of three 16-column steps: a share past ``K``), the shares summed in order by the block's last program,
    every ticket counter back at 0."""
    from kernels.triton import tickets
    from kernels.triton.experts import (experts_grouped_mm_launch, experts_scatter_mm, experts_swiglu_scatter_mm,
                                        launch_settings)
    from kernels.triton.swiglu import weighted_swiglu

    dev = triton_device()
    h, weights, order, offs, w2, ws = _activation_case(counts, topk, 48, 40, shared, dev, seed=split)
    a = weighted_swiglu(h, weights, limit, torch.bfloat16)
    if split == 1:
        fused = experts_swiglu_scatter_mm(h, weights, limit, w2, offs, order, ws)
        assert torch.equal(fused, experts_scatter_mm(a, w2, offs, order, ws))
    c = dict(launch_settings(h.shape[0], len(counts) + shared), BK=16, SPLIT=split)
    fused = experts_grouped_mm_launch(h, w2, offs, config=c, order=order, scatter=True, shared=ws, weights=weights,
                                      limit=limit)
    two = experts_grouped_mm_launch(a, w2, offs, config=c, order=order, scatter=True, shared=ws)
    assert torch.equal(fused, two)
    for buffer in tickets._COUNTERS.values():
        assert int(buffer.count_nonzero()) == 0


@pytest.mark.parametrize("counts,topk", ACTIVATION_CASES)
def test_the_activation_is_in_the_gemm_at_the_few_rows_settings_and_its_own_kernel_above(monkeypatch, counts, topk):
    """At the few-rows settings one launch computes the activation in its operand load; at the wide ones (many rows
    an expert: the column blocks' repeated activation cost more than its kernel on an H100) the activation's own
    kernel runs first and the GEMM reads its output: both the bits of the activation then the scatter."""
    from kernels.triton import experts as KE
    from kernels.triton.swiglu import weighted_swiglu

    dev = triton_device()
    h, weights, order, offs, w2, ws = _activation_case(counts, topk, 48, 40, True, dev, seed=5)
    fused = KE.fuses_activation(h.shape[0], len(counts) + 1)
    assert fused is (len(counts) == 6)                  # the narrow case's settings, the wide case's
    launches = []
    real_act, real_mm = KE.weighted_swiglu_launch, KE.experts_grouped_mm_launch
    monkeypatch.setattr(KE, "weighted_swiglu_launch", lambda *a, **k: launches.append("act") or real_act(*a, **k))
    monkeypatch.setattr(KE, "experts_grouped_mm_launch",
                        lambda *a, **k: launches.append("gemm+act" if k.get("weights") is not None else "gemm")
                        or real_mm(*a, **k))
    got = KE.experts_swiglu_scatter_mm(h, weights, 10.0, w2, offs, order, ws)
    assert launches == (["gemm+act"] if fused else ["act", "gemm"]), launches
    a = weighted_swiglu(h, weights, 10.0, torch.bfloat16)
    assert torch.equal(got, KE.experts_scatter_mm(a, w2, offs, order, ws))


def test_the_swiglu_scatter_gemm_refuses_what_it_cannot_serve():
    """Each refusal is one line that names what the kernel needs."""
    from kernels.triton.experts import experts_swiglu_scatter_mm

    dev = triton_device()
    h, weights, order, offs, w2, ws = _activation_case([2, 0, 2], 2, 16, 8, True, dev)
    R = order.shape[0]
    cases = [((h[:, :16], weights, 10.0, w2, offs, order, ws), "needs x \\[rows, 2K\\]"),
             ((h.float(), weights, 10.0, w2, offs, order, ws), "--kernel-backend none"),
             ((h, weights.bfloat16(), 10.0, w2, offs, order, ws), "weights is torch.bfloat16"),
             ((h, weights[:R], 10.0, w2, offs, order, ws), "needs fp32 \\[6\\], one a row of h"),
             ((h[:R - 1], weights[:R - 1], 10.0, w2, offs, order, ws), "the pairs' rows, then the tokens'"),
             ((h, weights, 10.0, w2, offs, order, ws[:, :8]), "shared expert"),
             ((h, weights, 10.0, w2, offs.long(), order, ws), "int32 end rows"),
             ((h, weights.clone().requires_grad_(), 10.0, w2, offs, order, ws), "no gradient: decode only"),
             ((h.clone().requires_grad_(), weights, 10.0, w2, offs, order, ws), "no backward")]
    for args, reason in cases:
        with pytest.raises(ValueError, match=reason) as refused:
            experts_swiglu_scatter_mm(*args)
        assert "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("rows", [6, 1536])
def test_the_swiglu_scatter_gemm_compiles_for_sm90_without_spills_as_the_step_launches_it(rows):
    """The fused GEMM at the launch settings of one sequence (narrow, 4 warps; also at 4 shares of ``K``, the
    sweep's) and of 256 (wide, 8 warps), compiled as the runtime specializes the decode step's inputs (16-byte
    aligned tensors, ``N`` and ``K`` multiples of 16): ptxas reports no spilled registers (180 and 166 registers
    with the clamp, where the scatter GEMM alone takes 110 and 108; triton 3.6)."""
    from kernels.triton import experts as K

    from ._backends import compiles_for_sm90_without_spills

    c = K.launch_settings(rows, 32)
    aligned = ("X", "W", "OFFS", "Y", "ORDER", "WS", "PART", "TICKETS", "RW", "N", "K")
    for split in (1, 4) if rows <= K.FEW_ROWS else (1,):
        consts = dict(BM=c["BM"], BN=c["BN"], BK=c["BK"], STAGES=c["STAGES"], F32=False, GATHER=False,
                      SCATTER=True, SHARED=True, SPLIT=split, SWIGLU=True, HAS_LIMIT=True, EP=32)
        compiles_for_sm90_without_spills(K._experts_kernel, EXPERTS_TYPES, consts, c["WARPS"], aligned)
