"""core.packing: order-stable dynamic batching that never splits a sample and respects the budget."""

from __future__ import annotations

import math
import random

import pytest
import torch

from core.packing import (
    SampleTooLongError,
    pack_micro_batches,
    required_min_tokens_per_rank,
    required_pad_multiple,
)
from core.thd import ThdLayout
from core.thd_cp import check_cp_config, compact_plan, compressed_rank_layout


def _check(lengths, res, max_tokens_per_rank, cp, mult, min_total):
    budget = max_tokens_per_rank * cp
    order = [i for mb in res.micro_batches for i in mb.sample_indices]
    assert order == list(range(len(lengths))), "every sample exactly once, in order"
    real_all = padded_all = 0
    for k, mb in enumerate(res.micro_batches):
        assert list(mb.lengths) == [lengths[i] for i in mb.sample_indices], "samples are never split"
        real = sum(lengths[i] for i in mb.sample_indices)
        assert mb.num_real_tokens == real
        assert mb.num_tokens <= budget
        assert mb.num_tokens % mult == 0 and mb.num_tokens % cp == 0
        assert mb.num_tokens >= max(real, min_total)
        assert mb.num_tokens - max(real, min_total) < mult, "no more padding than needed"
        assert mb.efficiency == pytest.approx(real / mb.num_tokens)
        cu = mb.cu_seqlens.tolist()
        want_cu = [0]
        for n in mb.lengths:
            want_cu.append(want_cu[-1] + n)
        if mb.num_tokens > real:
            want_cu.append(mb.num_tokens)  # the pad is a segment of its own
        assert cu == want_cu and mb.has_pad_segment == (mb.num_tokens > real)
        assert mb.loss_mask().sum().item() == real and mb.loss_mask()[:real].all()
        # greedy: the next sample did not fit this micro-batch
        if k + 1 < len(res.micro_batches):
            nxt = res.micro_batches[k + 1].sample_indices[0]
            assert math.ceil((real + lengths[nxt]) / mult) * mult > budget
        real_all += real
        padded_all += mb.num_tokens
    assert res.num_real_tokens == real_all == sum(lengths)
    assert res.num_tokens == padded_all
    assert res.efficiency == pytest.approx(real_all / padded_all)


@pytest.mark.parametrize("seed", range(20))
def test_random_packing(seed):
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 4])
    ratios = rng.choice([(), (4,), (4, 128), (0, 0, 4, 128)])
    mult = required_pad_multiple(cp, ratios, tp=rng.choice([1, 2]))
    min_rank = required_min_tokens_per_rank(cp, ratios)
    max_tokens_per_rank = rng.choice([256, 512, 1000, 4096])
    budget_cap = (max_tokens_per_rank * cp // mult) * mult
    lengths = [rng.randint(1, min(budget_cap, rng.choice([10, 300, 2000]))) for _ in range(rng.randint(0, 40))]
    res = pack_micro_batches(lengths, max_tokens_per_rank, cp=cp, pad_multiple=mult, min_tokens_per_rank=min_rank)
    _check(lengths, res, max_tokens_per_rank, cp, math.lcm(mult, cp), min_rank * cp)
    # every packed micro-batch is a valid CP stream for the THD/CP builders
    check_cp_config(max_tokens_per_rank, cp, ratios)
    for mb in res.micro_batches[:2]:
        L = mb.num_tokens // cp
        for m in [r for r in ratios if r > 0]:
            compressed_rank_layout(mb.cu_seqlens, m, L, cp)
            for r in range(cp):
                ThdLayout.for_cp_rank(mb.cu_seqlens, cp, r)
                compact_plan(mb.cu_seqlens, m, r * L, L)


def test_known_packing_and_efficiency():
    res = pack_micro_batches([3, 4, 5, 6, 1], 8)  # cp 1, no padding
    assert [mb.sample_indices for mb in res.micro_batches] == [(0, 1), (2,), (3, 4)]
    assert res.efficiency == 1.0
    res = pack_micro_batches([3, 4, 5, 6, 1], 8, cp=2, pad_multiple=4)  # budget 16, multiple 4
    assert [mb.sample_indices for mb in res.micro_batches] == [(0, 1, 2), (3, 4)]
    assert [mb.num_tokens for mb in res.micro_batches] == [12, 8]
    assert res.micro_batches[0].cu_seqlens.tolist() == [0, 3, 7, 12]
    assert res.micro_batches[1].cu_seqlens.tolist() == [0, 6, 7, 8]
    assert res.efficiency == pytest.approx(19 / 20)
    assert res.micro_batches[1].efficiency == pytest.approx(7 / 8)
    # a minimum per-rank length pads a tiny stream up (CP boundary width)
    res = pack_micro_batches([3], 64, cp=2, pad_multiple=2, min_tokens_per_rank=8)
    assert res.micro_batches[0].num_tokens == 16 and res.efficiency == pytest.approx(3 / 16)
    assert pack_micro_batches([], 8).micro_batches == () and pack_micro_batches([], 8).efficiency == 1.0


def test_budget_rounds_down_to_the_pad_multiple():
    # budget 2 * 100 = 200, multiple 2 * 128 = 256 -> nothing fits -> config error
    with pytest.raises(ValueError, match="max-tokens-per-rank"):
        pack_micro_batches([5], 100, cp=2, pad_multiple=256)
    # budget 300 with multiple 128: padded micro-batches hold at most 256
    res = pack_micro_batches([200, 56, 1], 300, pad_multiple=128)
    assert [mb.sample_indices for mb in res.micro_batches] == [(0, 1), (2,)]
    with pytest.raises(SampleTooLongError):
        pack_micro_batches([257], 300, pad_multiple=128)


def test_oversize_sample_error_names_sample_and_fix():
    with pytest.raises(SampleTooLongError) as e:
        pack_micro_batches([10, 20, 5000, 3], 1024, cp=2, pad_multiple=256)
    msg = str(e.value)
    assert "sample 2" in msg and "5000" in msg and "2048" in msg
    assert "--max-tokens-per-rank" in msg and "--cp" in msg and "truncate" in msg
    assert "at least 2560" in msg  # 5000 -> 5120 padded, / cp=2
    # the suggested value indeed works
    pack_micro_batches([10, 20, 5000, 3], 2560, cp=2, pad_multiple=256)


@pytest.mark.parametrize("bad", [[0], [3, -1]])
def test_bad_sample_lengths(bad):
    with pytest.raises(ValueError, match="sample"):
        pack_micro_batches(bad, 16)


def test_required_multiples():
    assert required_pad_multiple(1, ()) == 1
    assert required_pad_multiple(2, (0, 4, 128)) == 256
    assert required_pad_multiple(4, (4,), tp=8) == 32
    assert required_pad_multiple(2, (4, 128), tp=3) == 768
    assert required_min_tokens_per_rank(1, (4, 128)) == 0
    assert required_min_tokens_per_rank(2, (4,)) == 8
    assert required_min_tokens_per_rank(2, (0, 4, 128)) == 128
    assert isinstance(pack_micro_batches([1], 4).micro_batches[0].cu_seqlens, torch.Tensor)
