"""GRPO with pipeline parallelism (``dsv4 train --mode grpo --pp 2``) on the CPU, through the CLI: two gloo ranks,
and four (2 stages x expert parallel 2 for both implementations, 2 stages x tensor parallel 2 for miles;
megatron also with ``--vpp 2``: two chunks per rank, interleaved), with
the KL penalty (the reference model is split into the same stages) and the MTP loss. The rollout engine on stage
0 of each data-parallel rank gets every stage's weights, every expert and every tensor-parallel slice included
(the sync's check passes), its samples reach every stage and tensor-parallel rank, routing replay covers every
layer, and two steps equal the one-rank steps.

SFT, resume across layouts, ``dsv4 logprobs --pp 2`` and the refusals: tests/train/test_pipeline.py (a file of
their own: the two share no run, and each is a Bazel target short enough not to end the suite alone).
"""

import pytest

from ._cli import metrics_rows, train_cli


def _grpo(impl: str) -> tuple:
    return ("--impl", impl, "--mode", "grpo", "--steps", "2", "--lr", "1e-3", "micro_batch_size=3", "kl_coef=0.05",
            "mtp_coef=0.1")


@pytest.fixture(scope="module")
def grpo_one_rank(tmp_path_factory):
    """Two GRPO steps of one rank of an implementation (each run once, when first asked for): their metrics."""
    runs = {}

    def run(impl: str):
        if impl not in runs:
            d = tmp_path_factory.mktemp(f"grpo1-{impl}") / "run"
            train_cli(d, *_grpo(impl))
            runs[impl] = metrics_rows(d)
        return runs[impl]

    return run


FOUR = ("--nproc-per-node", "4")


@pytest.mark.parametrize("impl,layout", [("miles", ("--nproc-per-node", "2")), ("miles", (*FOUR, "--ep", "2")),
                                         ("miles", (*FOUR, "--tp", "2")), ("megatron", (*FOUR, "--ep", "2")),
                                         ("megatron", ("--nproc-per-node", "2", "--vpp", "2"))],
                         ids=["pp2", "pp2-ep2", "pp2-tp2", "megatron-pp2-ep2", "megatron-pp2-vpp2"])
def test_a_grpo_step_with_two_stages_syncs_every_stage_and_equals_one_rank(tmp_path, grpo_one_rank, impl, layout):
    train_cli(tmp_path / "run", *_grpo(impl), "--pp", "2", *layout)
    rows = metrics_rows(tmp_path / "run")
    assert len(rows) == 2 and rows[1]["kl_loss"] != 0.0     # step 2: the policy moved off the reference model
    for got, want in zip(rows, grpo_one_rank(impl)):
        assert got["weight_check_ok"] is True and got["routing_replay_match"] == 1.0
        assert got["reward_mean"] == want["reward_mean"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
        assert got["kl_loss"] == pytest.approx(want["kl_loss"], rel=1e-5, abs=1e-9)
        assert got["mtp_loss"] == pytest.approx(want["mtp_loss"], rel=1e-6)
        # both are fp32 rounding (a few 1e-7 a token): another layout sums in another order, and by how much the
        # two differ depends on the CPU's kernels (1.1e-7 for pp2-ep2 on an AVX-512 machine); a broken sync is 1e-2
        assert got["train_rollout_logprob_abs_diff"] == pytest.approx(want["train_rollout_logprob_abs_diff"],
                                                                      abs=5e-7)
