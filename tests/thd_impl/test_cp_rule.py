"""The parse-time context-parallel rule (core/combinations.py `context-parallel-tokens`) and the
THD / CP capabilities both implementations now declare."""

from __future__ import annotations

import dataclasses

import pytest

from core.combinations import InvalidCombination
from core.config import preset
from core.run_config import Choices, normalize

TINY = preset("tiny")


def _host():
    from launchers.builtin_plugins import make_host

    return make_host(third_party=False)


def test_cp_rule_rejects_ranks_shorter_than_the_boundary_width():
    with pytest.raises(InvalidCombination) as exc:
        normalize(Choices(impl="miles", cp=2, qkv_format="thd", max_tokens_per_rank=64, model=TINY), _host())
    assert str(exc.value) == (
        "--cp 2 with --max-tokens-per-rank 64 gives each context-parallel rank fewer tokens than the compressor "
        "boundary width 128 of compress ratio 128 (each rank takes that many rows from the previous rank). "
        "Fix: use --max-tokens-per-rank 128 or more, or --cp 1."
    )


def test_cp_rule_uses_the_models_ratios():
    window_only = dataclasses.replace(TINY, compress_ratios=(0, 4, 4, 4, 0))
    with pytest.raises(InvalidCombination) as exc:
        normalize(Choices(impl="megatron", cp=4, max_tokens_per_rank=7, model=window_only), _host())
    assert "boundary width 8 of compress ratio 4" in str(exc.value)
    normalize(Choices(impl="megatron", cp=4, max_tokens_per_rank=8, model=window_only), _host())


@pytest.mark.parametrize("impl,fmt", [("miles", "thd"), ("miles", "bshd"), ("megatron", "thd")])
def test_cp_and_thd_are_accepted(impl, fmt):
    run = normalize(Choices(impl=impl, cp=4, qkv_format=fmt, max_tokens_per_rank=128, model=TINY), _host())
    assert (run.cp, run.qkv_format) == (4, fmt)
    # without a packing budget the rule has nothing to check
    normalize(Choices(impl=impl, cp=2, qkv_format=fmt, model=TINY), _host())
