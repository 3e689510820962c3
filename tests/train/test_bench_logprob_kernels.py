"""``bench.logprob_kernels`` finds the op that moves the engine's log-probabilities: on the CPU, a table of the
reference ops whose ``rms_norm`` is off by 0.2% draws the reference-op engine's tokens with other
log-probabilities, and only the variants that hold that op differ; every other variant matches bit for bit."""

import torch

from core.config import preset


def test_the_op_that_moves_the_log_probabilities_is_the_one_named():
    from bench.logprob_kernels import attribute
    from core.kernel_ops import OP_NAMES, OpTable
    from kernels.reference import backend as reference

    ref = reference.ops()

    def plain(fn):
        return lambda *a, **k: fn(*a, **k)

    def off(fn):
        return lambda x, weight, eps: fn(x, weight, eps) * 1.002

    own = {n: (off if n == "rms_norm" else plain)(getattr(ref, n)) for n in OP_NAMES}
    rows = attribute(OpTable("skewed", own), ref, preset("tiny"), torch.float32, "cpu", samples=2,
                     new_tokens=4, ops=["rms_norm", "apply_rope"])
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["all", "all again (against all)", "all but apply_rope", "all but rms_norm",
                        "apply_rope alone", "rms_norm alone", "none"]
    assert {"rms_norm", "apply_rope"} <= set(by["all"]["ops_ran"])
    assert by["rms_norm alone"]["ops_ran"] == ["rms_norm"] and by["none"]["ops_ran"] == []
    for label in ("all", "all but apply_rope", "rms_norm alone"):
        assert 1e-5 < by[label]["max"] < 0.5 and by[label]["compared"] > by[label]["total"] // 2, by[label]
    for label in ("all again (against all)", "all but rms_norm", "apply_rope alone", "none"):
        assert by[label]["max"] == 0.0 and by[label]["compared"] == by[label]["total"] == 16, by[label]


def test_positions_compare_before_a_differing_token_and_before_a_routing_flip():
    from rollout.reference_engine import Sample
    from rollout.sample_compare import comparable_upto, first_differing_token, logprob_gap, same_routing_upto

    def sample(ids, lps, flip_at=None):          # a 3-token prompt: response token i is scored at position 2 + i
        routed = torch.zeros(3 + len(ids) - 1, 2, 1, dtype=torch.long)
        if flip_at is not None:
            routed[flip_at, 1, 0] = 5
        return Sample([0, 1, 2], list(ids), torch.tensor(lps), routed_experts=routed)

    a = sample([4, 5, 6, 7], [-1.0, -2.0, -3.0, -4.0])
    assert first_differing_token(a, a) is None and comparable_upto(a, a) == 4
    other = sample([4, 5, 9, 7], [-1.1, -2.0, -0.5, -4.0])        # the third token differs
    assert first_differing_token(a, other) == 2 and comparable_upto(a, other) == 2
    flipped = sample([4, 5, 6, 7], [-1.0, -2.0, -3.0, -9.0], flip_at=4)   # position 4 scores token 2 onwards
    assert same_routing_upto(a, flipped) == 2 and comparable_upto(a, flipped) == 2
    early = sample([4, 5, 6, 7], [-1.0, -2.0, -3.0, -4.0], flip_at=0)     # a prompt position flipped: none
    assert same_routing_upto(a, early) == 0
    shorter = sample([4, 5], [-1.0, -2.5])                          # one stopped: differs where it ended
    assert first_differing_token(a, shorter) == 2 and comparable_upto(a, shorter) == 2
    gap = logprob_gap([[a, a], [a]], [[other, flipped], [shorter]])
    assert gap["at"] == [1, 0, 1] and abs(gap["max"] - 0.5) < 1e-6
    assert (gap["compared"], gap["total"], gap["differing"], gap["flipped"]) == (6, 12, 2, 1)
