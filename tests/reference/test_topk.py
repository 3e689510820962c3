"""``kernels.reference.topk.stable_topk`` against a brute-force oracle: Python's ``sorted`` by
``(-score, index)``, the first ``k`` finite entries, listed in ascending index order and padded with -1.

Rows are drawn from a few distinct values so most rows have ties at the k-th place, with ``-inf``
masks (none, some, all, a causal prefix), every ``k`` from 1 to past the row length, and row counts
that cross the chunk boundary. The oracle knows nothing of thresholds or cumulative counts."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import topk as topk_mod
from kernels.reference.topk import stable_topk


def _oracle(row: list, k: int) -> list:
    """The rule, written out: sort by (-score, index), keep the first k finite, list ascending, pad -1."""
    k = min(k, len(row))
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    picked = sorted(j for j in order[:k] if row[j] != -math.inf)
    return picked + [-1] * (k - len(picked))


def _rows(n_rows: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Scores from 4 distinct values (ties everywhere) with a random share of -inf, plus rows that are
    all -inf, all one value, and a causal-prefix mask."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 4, (n_rows, n), generator=g).to(dtype) * 0.5 - 0.5
    s = s.masked_fill(torch.rand(n_rows, n, generator=g) < 0.2, float("-inf"))
    if n_rows >= 3:
        s[0] = float("-inf")
        s[1] = 0.0
        s[2, n // 2:] = float("-inf")
    return s


@pytest.mark.parametrize("n", [1, 5, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matches_brute_force(n, dtype):
    s = _rows(40, n, seed=n, dtype=dtype)
    for k in sorted({1, 2, 3, n // 2, n - 1, n, n + 3} - {0, -1}):
        got = stable_topk(s, k)
        assert got.dtype == torch.long and got.shape == (40, min(k, n))
        want = [_oracle(r, k) for r in s.float().tolist()]
        assert got.tolist() == want, (n, k)


def test_leading_dims_and_chunks(monkeypatch):
    s = _rows(2 * 3 * 7, 23, seed=7).view(2, 3, 7, 23)
    want = [_oracle(r, 6) for r in s.reshape(-1, 23).tolist()]
    full = stable_topk(s, 6)
    monkeypatch.setattr(topk_mod, "CHUNK_ELEMENTS", 23 * 4)   # 4 rows per chunk, a ragged last chunk
    chunked = stable_topk(s, 6)
    assert full.shape == (2, 3, 7, 6)
    assert full.reshape(-1, 6).tolist() == want
    assert torch.equal(chunked, full)


def test_random_continuous_scores_agree_with_torch_topk_as_a_set():
    s = torch.randn(50, 97, generator=torch.Generator().manual_seed(3))
    got = stable_topk(s, 12)
    want = s.topk(12, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(got, want)


def test_appending_entries_keeps_the_picks():
    """Length independence: appending -inf (invisible) or lower-scoring entries changes nothing."""
    s = _rows(30, 40, seed=11)
    for extra in (1, 9, 60):
        pad = torch.full((30, extra), float("-inf"))
        assert torch.equal(stable_topk(torch.cat((s, pad), 1), 8), stable_topk(s, 8))


def test_empty_shapes():
    assert stable_topk(torch.zeros(3, 0), 4).shape == (3, 0)
    assert stable_topk(torch.zeros(0, 9), 4).shape == (0, 4)
    assert stable_topk(torch.zeros(2, 5), 0).shape == (2, 0)


def test_the_window_rows_are_the_steps_rows():
    """The contract's window rows are the decode step's ring rows (``kernels.reference.decode._window``) and its
    picks the plain call's offset past the ring."""
    from kernels.reference.decode import _window
    from kernels.reference.topk import decode_topk

    g = torch.Generator().manual_seed(0)
    scores, pos = torch.randn(5, 30, generator=g), torch.tensor([0, 3, 7, 8, 119])
    got, plain = decode_topk(scores, pos, 4, 6, 8), decode_topk(scores, pos, 4, 6)
    assert torch.equal(got[:, :8], _window(8, pos))
    assert torch.equal(got[:, 8:], torch.where(plain >= 0, plain + 8, plain))
