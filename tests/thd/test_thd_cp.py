"""core.thd_cp: ownership, boundary width, compaction, rank-major maps, compaction gradients.

Oracles are brute force over Python ints; the end-to-end test simulates the CP pipeline (boundary
exchange, compaction, a toy compressor, all-gather, reorder) on one process and compares with the
same toy compressor run on the whole stream."""

from __future__ import annotations

import random

import pytest
import torch

from core.thd import ThdLayout, compressed_groups, compressed_visible_indices, has_overlap, indexer_ranges
from core.thd_cp import (
    CompactRows,
    CpConfigError,
    check_cp_config,
    compact_compressor_input,
    compact_group_capacity,
    compact_plan,
    compact_rows,
    compressed_rank_layout,
    compressor_boundary_width,
    cp_local_range,
    group_owner,
    seq_major_from_rank_major,
    to_rank_major,
)


def cu_of(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64)


def brute_groups(lengths, m):
    """[(flat id, segment, c, token rows incl. the overlap's previous group or None)] in flat order."""
    out, off = [], 0
    for b, L in enumerate(lengths):
        for c in range(L // m):
            own = list(range(off + c * m, off + c * m + m))
            prev = list(range(off + (c - 1) * m, off + c * m)) if c > 0 else None
            out.append((len(out), b, c, own, prev))
        off += L
    return out


def random_stream(rng: random.Random, m: int, cp: int) -> list[int]:
    """1-6 segments of mixed sizes, padded (as its own segment) so T % cp == 0 and T/cp >= width."""
    width = compressor_boundary_width(m)
    n = rng.randint(1, 6)
    lengths = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.3:
            lengths.append(rng.randint(1, m + 1))
        elif kind < 0.6:
            lengths.append(m * rng.randint(1, 4) + rng.randint(-1, 1))
        else:
            lengths.append(rng.randint(1, 3 * 128 + 40))
    lengths = [max(1, x) for x in lengths]
    T = sum(lengths)
    target = max(-(-T // cp) * cp, cp * width)
    if target > T:
        lengths.append(target - T)
    return lengths


CASES = [(seed, m, cp) for seed in range(24) for m in (4, 128) for cp in (1, 2, 4)]


@pytest.mark.parametrize("seed,m,cp", CASES)
def test_random_cp_maps(seed, m, cp):
    rng = random.Random(1000 * seed + 10 * m + cp)
    lengths = random_stream(rng, m, cp)
    cu = cu_of(lengths)
    T = int(cu[-1])
    L = T // cp
    width = compressor_boundary_width(m)
    overlap = has_overlap(m)
    bg = brute_groups(lengths, m)
    G = len(bg)
    cap = compact_group_capacity(L, m)
    groups = compressed_groups(cu, m)
    owner = group_owner(groups, L)
    rl = compressed_rank_layout(cu, m, L, cp)
    assert rl.capacity == cap and rl.seq_to_rank.shape == (G,) and rl.rank_to_seq.shape == (cp * cap,)

    seen: dict[int, tuple[int, int]] = {}
    for r in range(cp):
        start, length = cp_local_range(T, cp, r)
        assert (start, length) == (r * L, L)
        plan = compact_plan(cu, m, start, L)
        assert plan.capacity == cap and plan.boundary_width == width
        assert plan.gather_index.shape == (cap, 2 * m if overlap else m)
        assert int(plan.gather_index.max()) < width + L
        src = plan.source_global_rows()
        for slot, gid in enumerate(plan.group_ids.tolist()):
            if gid < 0:
                assert (plan.gather_index[slot] == -1).all() and plan.rope_positions[slot] == -1
                continue
            assert gid not in seen, "group in two slots"
            seen[gid] = (r, slot)
            _, b, c, own, prev = bg[gid]
            assert start <= own[-1] < start + L, "owner must hold the group's last token"
            assert int(owner[gid]) == r
            assert int(plan.rope_positions[slot]) == c * m
            want = ((prev if prev is not None else [-1] * m) + own) if overlap else own
            assert src[slot].tolist() == want
            needed = [k for k in want if k >= 0]
            assert all(start - width <= k < start + L for k in needed), "boundary width too small"
            assert int(rl.seq_to_rank[gid]) == r * cap + slot
        # valid slots are a prefix, in sequence order
        ids = [g for g in plan.group_ids.tolist() if g >= 0]
        assert plan.group_ids.tolist()[: len(ids)] == ids and ids == sorted(ids)
    assert sorted(seen) == list(range(G)), "every group in exactly one slot of exactly one rank"

    # rank-major <-> sequence-major are inverse permutations on valid rows
    s2r, r2s = rl.seq_to_rank, rl.rank_to_seq
    assert torch.equal(r2s[s2r], torch.arange(G))
    valid_rows = (r2s >= 0).nonzero().squeeze(1)
    assert valid_rows.numel() == G
    assert torch.equal(s2r[r2s[valid_rows]], valid_rows)
    assert len(set(s2r.tolist())) == G


def toy_compress(rows: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, span, D] -> [N, D]: a position-weighted sum of the valid rows (stands in for the compressor)."""
    return (rows * valid[..., None] * weights[None, :, None]).sum(1)


@pytest.mark.parametrize("seed,m,cp", [(s, m, cp) for s in range(4) for m in (4, 128) for cp in (2, 4)])
def test_simulated_cp_pipeline_matches_whole_stream(seed, m, cp):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cu = cu_of(random_stream(rng, m, cp))
    T = int(cu[-1])
    L = T // cp
    D = 3
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    width = compressor_boundary_width(m)
    span = 2 * m if has_overlap(m) else m
    weights = torch.randn(span, generator=gen, dtype=torch.float64)

    # whole stream, no CP
    groups = compressed_groups(cu, m)
    idx = groups.overlap_gather_index() if has_overlap(m) else groups.gather_index()
    ref = toy_compress(x[idx.clamp(min=0)], idx >= 0, weights)

    # CP: each rank compresses its owned groups into fixed slots; then all-gather (concat)
    slots = []
    for r in range(cp):
        local = x[r * L:(r + 1) * L]
        boundary = x[r * L - width:r * L] if r > 0 else torch.zeros(width, D, dtype=x.dtype)
        plan = compact_plan(cu, m, r * L, L)
        slots.append(toy_compress(compact_compressor_input(local, boundary, plan), plan.valid, weights))
    gathered = torch.cat(slots)
    rl = compressed_rank_layout(cu, m, L, cp)
    assert torch.allclose(seq_major_from_rank_major(gathered, rl.seq_to_rank), ref)

    # the attention's rank-major compressed indices read the same entries as the sequence-major ones
    for r in range(cp):
        lay = ThdLayout.for_cp_rank(cu, cp, r)
        seq = compressed_visible_indices(lay, m)
        rank = compressed_visible_indices(lay, m, seq_to_rank=rl.seq_to_rank)
        assert torch.equal(rank, to_rank_major(seq, rl.seq_to_rank))
        assert torch.equal(seq >= 0, rank >= 0)
        v = seq >= 0
        assert torch.equal(gathered[rank[v]], ref[seq[v]])
        ks, ke = indexer_ranges(lay, m)  # indexer picks in [ks, ke) map to rows holding those groups
        picks = torch.minimum(ks, ke - 1)
        ok = ke > ks
        assert torch.equal(gathered[to_rank_major(picks[ok], rl.seq_to_rank)], ref[picks[ok]])


def test_capacity_is_tight_and_attained():
    # ratio 4, L = 9, cp = 2: the second segment [6, 18) has groups ending at 9, 13, 17 -> rank 1 owns 3.
    cu = cu_of([6, 12])
    assert compact_group_capacity(9, 4) == 3
    plan = compact_plan(cu, 4, 9, 9)
    assert plan.num_groups == 3 == plan.capacity
    assert compact_group_capacity(1, 128) == 1 and compact_group_capacity(256, 128) == 2
    assert compact_group_capacity(257, 128) == 3
    with pytest.raises(CpConfigError, match="capacity"):
        compact_plan(cu, 4, 9, 9, capacity=2)


@pytest.mark.parametrize("L,m", [(L, m) for m in (4, 128) for L in range(m, 3 * m + 3, 1 if m == 4 else 37)])
def test_capacity_upper_bound_over_all_alignments(L, m):
    """Brute force the worst case over every phase of group ends relative to a rank start."""
    cap = compact_group_capacity(L, m)
    for phase in range(m):
        # one long segment starting at `phase`, rank holds [start, start + L) with start = 2*m*... large enough
        seg = 4 * L + 2 * m
        cu = cu_of([phase, seg])
        start = 2 * m + phase
        if start + L > int(cu[-1]):
            continue
        assert compact_plan(cu, m, start, L).num_groups <= cap


def test_boundary_widths():
    assert compressor_boundary_width(4) == 8
    assert compressor_boundary_width(128) == 128
    with pytest.raises(ValueError):
        compressor_boundary_width(0)


def test_parse_time_check():
    check_cp_config(8, 2, [0, 0, 4])
    check_cp_config(1, 1, [4, 128])  # cp == 1 needs no boundary
    check_cp_config(128, 4, [4, 128])
    with pytest.raises(CpConfigError, match=r"increase tokens per rank.*lower --cp") as e:
        check_cp_config(100, 2, [4, 128])
    assert "128" in str(e.value)
    with pytest.raises(CpConfigError, match="lower --cp"):
        check_cp_config(7, 4, [4])
    with pytest.raises(CpConfigError):
        check_cp_config(8, 0, [4])


def test_cp_local_range_errors():
    assert cp_local_range(12, 3, 2) == (8, 4)
    with pytest.raises(CpConfigError, match="pad the stream"):
        cp_local_range(10, 4, 0)
    with pytest.raises(CpConfigError):
        cp_local_range(8, 2, 2)


def test_to_rank_major_keeps_invalid_and_handles_empty_table():
    s2r = torch.tensor([5, 0, 3])
    assert to_rank_major(torch.tensor([[2, -1, 0], [-1, -1, 1]]), s2r).tolist() == [[3, -1, 5], [-1, -1, 0]]
    assert to_rank_major(torch.tensor([-1, -1]), torch.empty(0, dtype=torch.int64)).tolist() == [-1, -1]
    with pytest.raises(IndexError):
        to_rank_major(torch.tensor([3]), s2r)
    # a stream shorter than the ratio has no groups; the rank layout is empty and all indices -1
    cu = cu_of([3, 5])
    rl = compressed_rank_layout(cu, 128, 4, 2)
    assert rl.seq_to_rank.numel() == 0 and (rl.rank_to_seq == -1).all()
    lay = ThdLayout.for_cp_rank(cu, 2, 1)
    assert (compressed_visible_indices(lay, 128, width=1, seq_to_rank=rl.seq_to_rank) == -1).all()


# ------------------------------------------------------------------------------------ gradients
def _plan_case():
    # 32 tokens, cp = 2, L = 16, ratio 4 (overlap), rank 1 = [16, 32): owns the group [14, 17] whose
    # previous group [10, 13] is in the boundary, and the first group [22, 25] of a segment (no previous).
    cu = cu_of([2, 17, 3, 10])
    return cu, compact_plan(cu, 4, 16, 16)


def test_unit_gradient_lands_only_on_source_row():
    cu, plan = _plan_case()
    D = 5
    local = torch.randn(plan.local_len, D, dtype=torch.float64, requires_grad=True)
    boundary = torch.randn(plan.boundary_width, D, dtype=torch.float64, requires_grad=True)
    out = compact_compressor_input(local, boundary, plan)
    assert out.shape == (plan.capacity, plan.span, D)
    n_valid = 0
    for slot in range(plan.capacity):
        for k in range(plan.span):
            g = torch.zeros_like(out)
            g[slot, k] = 1.0
            gb, gl = torch.autograd.grad(out, (boundary, local), g, retain_graph=True)
            src = torch.cat([gb, gl])
            j = int(plan.gather_index[slot, k])
            if j < 0:
                assert (src == 0).all(), "an invalid slot row must not leak gradient (e.g. into row 0)"
                continue
            n_valid += 1
            want = torch.zeros_like(src)
            want[j] = 1.0
            assert torch.equal(src, want)
            assert torch.equal(out[slot, k], torch.cat([boundary, local])[j])
    assert n_valid > plan.span  # the case has several groups, incl. one needing the boundary
    assert int(plan.gather_index[plan.valid].min()) < plan.boundary_width


def test_compaction_gradient_is_the_scatter_add_of_uses():
    cu, plan = _plan_case()
    src = torch.randn(plan.boundary_width + plan.local_len, 2, dtype=torch.float64, requires_grad=True)
    out = compact_rows(src, plan.gather_index)
    w = torch.randn_like(out)
    (gsrc,) = torch.autograd.grad((out * w).sum(), src)
    want = torch.zeros_like(src)
    for slot in range(plan.capacity):
        for k in range(plan.span):
            j = int(plan.gather_index[slot, k])
            if j >= 0:
                want[j] += w[slot, k]  # overlap: a token used by two entries gets both gradients
    assert torch.allclose(gsrc, want)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, -1, 5], [5, 2, -1]])
    assert torch.autograd.gradcheck(lambda t: CompactRows.apply(t, idx), (x,))


def test_compaction_rejects_bad_inputs():
    cu, plan = _plan_case()
    with pytest.raises(ValueError, match="boundary"):
        compact_compressor_input(torch.zeros(16, 2), torch.zeros(3, 2), plan)
    with pytest.raises(TypeError):
        compact_rows(torch.zeros(4, 2), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(IndexError):
        compact_rows(torch.zeros(4, 2), torch.tensor([0, 4]))


@pytest.mark.parametrize("m", [4, 128])
def test_boundary_width_is_needed(m):
    """A group ending on a rank's first row reaches 2m-1 rows back with overlap (m-1 without)."""
    L = 4 * m
    s = L + 1 - 2 * m  # segment 1 starts at s, so its group 1 ends exactly on rank 1's first row L
    cu = cu_of([s, 2 * L - s])
    plan = compact_plan(cu, m, L, L)
    src = plan.source_global_rows()
    reach = L - int(src[src >= 0].min())
    assert reach == (2 * m - 1 if has_overlap(m) else m - 1)
    assert reach <= compressor_boundary_width(m)
