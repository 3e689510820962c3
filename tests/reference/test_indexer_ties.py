"""Length independence of the Lightning Indexer's picks on the ``tiny`` preset (4 indexer heads).

With 4 heads an entry's score is exactly 0 whenever all four ReLUs are off, so past 32 tokens (more than
``index_topk`` = 8 entries visible) exact ties at the top-k boundary are common. The stable top-k
(``kernels.reference.topk``) must give every position of a sequence the same picks in the full forward
and in the forward of every prefix that holds the position: the tokens that follow a query never change
what it attends to. The guard test shows the check has teeth: ``torch.topk``, which breaks ties
differently for rows of different lengths, fails it on the same model and tokens.
"""

from __future__ import annotations

import pytest
import torch

from core.config import preset
from kernels.reference import indexer as indexer_mod
from kernels.reference.indexer import indexer_hook
from kernels.reference.model import DeepseekV4Model, init_weights

S = 96
PREFIXES = range(33, S)


class _Picks:
    """Indexer-seam recorder: the picks ``[S, k]`` of each CSA layer, in call order."""

    def __init__(self):
        self.picks = []

    def __call__(self, module, picks):
        self.picks.append(picks[0].clone())
        return picks


@pytest.fixture(scope="module")
def model():
    m = DeepseekV4Model(preset("tiny")).eval()
    assert m.config.index_n_heads == 4
    init_weights(m, 0, std=0.05)
    return m


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(2, 1024, (S,), generator=torch.Generator().manual_seed(7))


def _picks(model, ids):
    rec = _Picks()
    with torch.no_grad(), indexer_hook(rec):
        model(ids[None])
    return rec.picks


def _valid(row):
    return [j for j in row.tolist() if j >= 0]


def _mismatches(model, tokens):
    """``(prefix length, layer, position)`` where a prefix's picks differ from the full forward's."""
    full = _picks(model, tokens)
    bad = []
    for n in PREFIXES:
        for layer, (f, p) in enumerate(zip(full, _picks(model, tokens[:n]))):
            bad += [(n, layer, t) for t in range(n) if sorted(_valid(f[t])) != sorted(_valid(p[t]))]
    return full, bad


def test_ties_occur_at_the_top_k_boundary(model, tokens, monkeypatch):
    """The setting is the hard one: rows whose k-th and (k+1)-th best visible scores tie exactly."""
    seen = []
    real = indexer_mod.stable_topk

    def spy(scores, k):
        seen.append((scores.detach().clone(), k))
        return real(scores, k)

    monkeypatch.setattr(indexer_mod, "stable_topk", spy)
    with torch.no_grad():
        model(tokens[None])
    assert seen, "the tiny preset has CSA layers"
    ties = 0
    for s, k in seen:
        top = s.topk(k + 1, dim=-1).values
        ties += int(((top[..., k - 1] == top[..., k]) & torch.isfinite(top[..., k])).sum())
    assert ties > 0


def test_prefix_picks_equal_the_full_forwards(model, tokens):
    full, bad = _mismatches(model, tokens)
    assert not bad, f"{len(bad)} (prefix, layer, position) picks differ, first {bad[:5]}"
    for f in full:                                    # canonical order: ascending ids, -1 padding last
        valid = f >= 0
        assert torch.equal(valid, valid.cummin(dim=-1).values)
        assert bool((f[:, 1:] > f[:, :-1])[valid[:, 1:]].all())


def test_plain_torch_topk_fails_the_check(model, tokens, monkeypatch):
    """Guard: the check above catches the ``torch.topk`` tie problem on this model and these tokens."""

    def plain(scores, k):
        vals, idx = scores.topk(min(k, scores.shape[-1]), dim=-1)
        return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)

    monkeypatch.setattr(indexer_mod, "stable_topk", plain)
    _, bad = _mismatches(model, tokens)
    assert bad, "torch.topk gave length-independent picks here: the tie check has no teeth"
