"""core.thd: packed index sets must equal each sample run alone (offset by its segment start).

The oracles below are brute force over Python ints, written from the rules in architecture.md
§2.2-2.4 (window of W keys incl. the query, a group visible once complete, groups of m tokens from
each sample's start, overlap pools the previous group) and never call the code under test."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from core.thd import (
    WINDOW,
    ThdLayout,
    compressed_cu_seqlens,
    compressed_groups,
    compressed_visible_indices,
    has_overlap,
    indexer_ranges,
    segment_ids,
    validate_cu_seqlens,
    window_indices,
)


# ----------------------------------------------------------------------------- brute-force oracles
def alone_window(p: int, W: int) -> set[int]:
    """Keys of query p of a sample run alone: the W most recent tokens incl. itself."""
    return {k for k in range(0, p + 1) if p - k < W}


def alone_groups(L: int, m: int) -> list[list[int]]:
    """Complete runs of m tokens from the sample start; a tail shorter than m is no group."""
    out, s = [], 0
    while s + m <= L:
        out.append(list(range(s, s + m)))
        s += m
    return out


def alone_visible(p: int, L: int, m: int) -> set[int]:
    """Groups whose every token is <= p."""
    return {c for c, toks in enumerate(alone_groups(L, m)) if max(toks) <= p}


def cu_of(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64)


def probe_positions(L: int, m: int, W: int, exhaustive: bool) -> list[int]:
    if exhaustive:
        return list(range(L))
    cand = {0, 1, 2, L - 1, L - 2, W - 2, W - 1, W, W + 1, 2 * W - 1, 2 * W}
    for k in range(1, L // m + 2):
        cand |= {k * m - 2, k * m - 1, k * m, k * m + 1}
        if k > 3:
            break
    last = (L // m) * m
    cand |= {last - 2, last - 1, last, last + 1}
    return sorted(p for p in cand if 0 <= p < L)


SHAPES = [
    [1],
    [1, 1, 1],
    [3, 2, 1],  # every segment shorter than ratio 4
    [4, 8, 12],  # exact multiples of 4
    [3, 0, 5],  # a zero-length segment
    [128, 256],  # exact multiples of 128
    [5, 131, 7],
    [1, 127, 128, 129],
    [130, 257],  # past the window
    [300, 1, 260],  # long tails for ratio 128
    [513],
    [127, 3, 255, 2, 129, 64],
]


def _check_layout_against_alone(lengths, m: int, W: int) -> None:
    cu = cu_of(lengths)
    lay = ThdLayout(cu)
    T = int(cu[-1])
    exhaustive = T <= 700
    win = window_indices(lay, W)
    vis = compressed_visible_indices(lay, m)
    ks, ke = indexer_ranges(lay, m)
    assert win.shape == (T, W)
    assert vis.shape == (T, max(n // m for n in lengths))
    g_off = 0
    for b, L in enumerate(lengths):
        o = int(cu[b])
        n_groups = len(alone_groups(L, m))
        for p in probe_positions(L, m, W, exhaustive):
            t = o + p
            assert int(lay.segment_ids[t]) == b
            assert int(lay.positions[t]) == p  # RoPE restarts at every segment
            assert int(lay.segment_starts[t]) == o and int(lay.segment_ends[t]) == o + L
            row = win[t].tolist()
            assert {k for k in row if k >= 0} == {o + k for k in alone_window(p, W)}
            for j, k in enumerate(row):  # right-aligned columns
                assert k == -1 or k == t - W + 1 + j
            assert row[-1] == t
            want = {g_off + c for c in alone_visible(p, L, m)}
            vrow = vis[t].tolist()
            assert {c for c in vrow if c >= 0} == want
            for c, v in enumerate(vrow):  # column c = group c of the segment
                assert v == -1 or v == g_off + c
            assert set(range(int(ks[t]), int(ke[t]))) == want
            assert int(ks[t]) == g_off and g_off <= int(ke[t]) <= g_off + n_groups
        g_off += n_groups


@pytest.mark.parametrize("lengths", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("m", [4, 128])
def test_index_sets_equal_samples_alone(lengths, m):
    _check_layout_against_alone(lengths, m, WINDOW)


@pytest.mark.parametrize("lengths", [[1, 9, 3, 16, 7], [8, 8], [2, 30, 1]])
@pytest.mark.parametrize("m,W", [(4, 8), (4, 5), (2, 3), (1, 1), (3, 4)])
def test_index_sets_small_window_and_ratio(lengths, m, W):
    """Small windows/ratios so the window clamp and group edges are hit many times per segment."""
    _check_layout_against_alone(lengths, m, W)


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_against_alone(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 9), rng.randint(100, 400)]) for _ in range(rng.randint(1, 6))]
    for m in (4, 128):
        _check_layout_against_alone(lengths, m, WINDOW)


@pytest.mark.parametrize("lengths", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("m", [4, 128])
def test_compressed_groups_within_segments(lengths, m):
    cu = cu_of(lengths)
    g = compressed_groups(cu, m)
    cu_c = compressed_cu_seqlens(cu, m)
    want_gather, want_rope, want_prev, want_seg, want_overlap = [], [], [], [], []
    want_cu = [0]
    for b, L in enumerate(lengths):
        o = int(cu[b])
        groups = alone_groups(L, m)
        for c, toks in enumerate(groups):
            flat = len(want_gather)
            want_gather.append([o + k for k in toks])
            want_rope.append(toks[0])  # local position of the group's first token
            want_prev.append(flat - 1 if c > 0 else -1)
            want_seg.append(b)
            prev = [o + k for k in groups[c - 1]] if c > 0 else [-1] * m
            want_overlap.append(prev + [o + k for k in toks])
        want_cu.append(want_cu[-1] + len(groups))
    assert cu_c.tolist() == want_cu
    assert g.cu_seqlens_compressed.tolist() == want_cu
    assert g.num_groups == len(want_gather)
    assert g.gather_index().tolist() == want_gather
    assert g.rope_positions.tolist() == want_rope
    assert g.prev_group.tolist() == want_prev
    assert g.segment.tolist() == want_seg
    assert g.last_token.tolist() == [r[-1] for r in want_gather]
    assert g.overlap_gather_index().tolist() == want_overlap
    if has_overlap(m):  # entry i of a sample covers tokens [4i-4, 4i+3]
        for row, c in zip(want_overlap, g.index_in_segment.tolist()):
            toks = [k for k in row if k >= 0]
            assert len(toks) == (8 if c > 0 else 4) and toks == list(range(toks[0], toks[0] + len(toks)))


def test_tails_are_dropped_not_padded():
    cu = cu_of([7, 130, 3])
    assert compressed_cu_seqlens(cu, 4).tolist() == [0, 1, 33, 33]
    assert compressed_cu_seqlens(cu, 128).tolist() == [0, 0, 1, 1]
    lay = ThdLayout(cu)
    # The tail queries of the 130-token segment see its one ratio-128 group, nothing past it.
    ks, ke = indexer_ranges(lay, 128)
    assert ks[7 + 129].item() == 0 and ke[7 + 129].item() == 1
    assert ke[7 + 126].item() == 0 and ke[7 + 127].item() == 1


def test_compressed_visible_fixed_width_and_offset():
    cu = cu_of([9, 5])
    lay = ThdLayout(cu)
    v = compressed_visible_indices(lay, 4, width=6, offset=100)
    assert v.shape == (14, 6)
    assert v[8].tolist() == [100, 101, -1, -1, -1, -1]
    assert v[13].tolist() == [102, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="width"):
        compressed_visible_indices(lay, 4, width=1)
    # a stream with no groups at all
    lay2 = ThdLayout(cu_of([3, 2]))
    assert compressed_visible_indices(lay2, 4).shape == (5, 0)
    assert (compressed_visible_indices(lay2, 4, width=2) == -1).all()


@pytest.mark.parametrize("S", [1, 5, 128, 130, 263])
@pytest.mark.parametrize("m", [4, 128])
def test_single_segment_matches_unpacked_reference(S, m):
    """With one segment the packed builders reduce to the repo's unpacked (BSHD) reference builders."""
    ref = pytest.importorskip("kernels.reference.attention")
    lay = ThdLayout(cu_of([S]))
    w = window_indices(lay, WINDOW)
    ref_w = ref.window_indices(S, WINDOW)
    assert torch.equal(w[:, WINDOW - ref_w.shape[1]:], ref_w)
    assert (w[:, : WINDOW - ref_w.shape[1]] == -1).all()
    assert torch.equal(compressed_visible_indices(lay, m), ref.compressed_visible_indices(S, m))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_rank_layout_is_a_slice_of_the_global_one(cp):
    cu = cu_of([5, 131, 7, 1, 128, 8])  # 280 tokens
    full = ThdLayout(cu)
    L = 280 // cp
    for r in range(cp):
        lay = ThdLayout.for_cp_rank(cu, cp, r)
        sl = slice(r * L, (r + 1) * L)
        assert lay.global_start == r * L and lay.local_len == L
        assert torch.equal(lay.rows, full.rows[sl])
        assert torch.equal(lay.positions, full.positions[sl])
        assert torch.equal(lay.window_indices(), full.window_indices()[sl])
        for m in (4, 128):
            assert torch.equal(lay.compressed_visible_indices(m), full.compressed_visible_indices(m)[sl])
            assert all(torch.equal(a, b[sl]) for a, b in zip(lay.indexer_ranges(m), full.indexer_ranges(m)))


def test_layout_facts_and_segment_ids():
    cu = cu_of([3, 0, 4])
    lay = ThdLayout(cu, global_start=2, local_len=3)
    assert lay.rows.tolist() == [2, 3, 4]
    assert lay.segment_ids.tolist() == [0, 2, 2]
    assert lay.positions.tolist() == [2, 0, 1]
    assert lay.num_segments == 3 and lay.total_tokens == 7 and lay.max_seqlen == 4
    assert lay.seqlens.tolist() == [3, 0, 4]
    assert segment_ids(cu, torch.arange(7)).tolist() == [0, 0, 0, 2, 2, 2, 2]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'global_start'"):
        lay.global_start = 0  # frozen


@pytest.mark.parametrize("bad,err", [
    (torch.tensor([1, 3]), ValueError),
    (torch.tensor([0, 3, 2]), ValueError),
    (torch.tensor([0.0, 3.0]), TypeError),
    (torch.tensor([0]), ValueError),
    (torch.tensor([[0, 3]]), ValueError),
    ([0, 3], TypeError),
])
def test_cu_seqlens_validation(bad, err):
    with pytest.raises(err):
        validate_cu_seqlens(bad)


def test_local_rows_outside_stream_raise():
    with pytest.raises(ValueError, match="outside the packed stream"):
        ThdLayout(cu_of([4, 4]), global_start=4, local_len=5)
    with pytest.raises(ValueError):
        compressed_cu_seqlens(cu_of([4]), 0)
    lay = ThdLayout(cu_of([4, 4]), global_start=8)  # an empty local slice is legal
    assert lay.window_indices().shape == (0, WINDOW)


def test_layout_keeps_what_it_derives_but_not_inside_compiled_code():
    """A reused layout builds its index tensors and host facts once (no host sync on later steps); inside
    torch.compile'd code the tensors are built in the graph and not kept (a compiled / CUDA-graph output
    would be overwritten by the next replay), while host facts are still kept."""
    cu = torch.tensor([0, 5, 12])
    lay = ThdLayout(cu)
    w = lay.window_indices(4)
    assert lay.window_indices(4) is w
    assert lay.compressed_groups(4) is lay.compressed_groups(4)
    assert lay.max_seqlen == 7 and lay.host_cu_seqlens() == [0, 5, 12]

    fresh = ThdLayout(cu)
    compiled = torch.compile(lambda layout: layout.window_indices(4) + layout.total_tokens, backend="eager",
                             fullgraph=False)
    torch.testing.assert_close(compiled(fresh), w + 12)
    assert ("window", 4) not in fresh._derived
    assert fresh._derived["total"] == 12
    torch.testing.assert_close(fresh.window_indices(4), w)  # eager again: built and kept
    assert ("window", 4) in fresh._derived
