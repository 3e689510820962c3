"""The main job learns: GRPO on the built-in task raises the embedded tiny model's reward in 20 steps.

The run is the main job's (`./bazel run //launchers:dsv4 -- --impl=miles`: launchers.stages.full_train on
the tiny checkpoint with train.data.MAIN_JOB_SETTINGS) on two seeds and on both implementations. The
control: the same run with the surrogate's sign flipped (the advantages negated inside
train.losses.policy_loss, for this test only) must not raise the reward, so a rise is GRPO's doing and not
a property of the task, the sampler or the data order.
"""

import json
import sys

import pytest

from launchers import stages
from train import losses
from train.data import MAIN_JOB_SETTINGS

STEPS = 20
MARGIN = 0.15        # last 5 steps' mean reward over the first 5's; the main job (miles, seed 0) rose by 0.49


def _main_job_rewards(impl: str, seed: int, run_dir):
    """(rewards per step, steps whose every group had equal rewards) of the main job's run, on one intra-op
    thread whatever runs the test: the path depends on the thread count's rounding, and seed 1, the slowest
    learner of seeds 0-4, rose by 0.24 on one thread and 0.11 on two (bench/results/main-job-learning-cpu.json),
    so the margin is held where Bazel holds it (OMP_NUM_THREADS=1)."""
    import torch

    from launchers.cli import resolve

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _host, run = resolve({"impl": impl, "hardware": "cpu"}, job="train")
        stages.full_train(run, mode="grpo", steps=STEPS, run_dir=run_dir, resume=False, progress=False,
                          tracker=("none",), **{**MAIN_JOB_SETTINGS, "seed": seed})
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    flat = sum(1 for r in rows if r["zero_variance_group_frac"] == 1.0)
    return [r["reward_mean"] for r in rows], flat


def _rise(rewards):
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


# miles with seed 0 is the main job itself, which tests/jobs_test.py runs and holds to the same margin
@pytest.mark.parametrize("impl,seed", [("miles", 1), ("megatron", 0)])
def test_grpo_raises_the_reward(tmp_path, impl, seed):
    rewards, _flat = _main_job_rewards(impl, seed, tmp_path / "run")
    assert _rise(rewards) > MARGIN, rewards
    # (at most 2 of 20 steps without a learning signal is asked of the main job itself, seed 0: jobs_test.py.
    # Seed 1 had 5 such steps in a run that rose, 4 of them its last 4: a policy that answers alike ties a group.)


@pytest.fixture
def flipped_surrogate(monkeypatch):
    """GRPO's clipped surrogate with the advantages negated: gradient ascent on the wrong objective."""
    import train.grpo  # noqa: F401  (the GRPO step is loaded, so a by-name import of the function is patched too)

    original = losses.policy_loss

    def flipped(logp, old_logp, adv, mask, **kw):
        return original(logp, old_logp, -adv, mask, **kw)

    # every module of the trainer that imported the function by name calls the flipped one
    for name, module in list(sys.modules.items()):
        if (name == "train" or name.startswith("train.")) and getattr(module, "policy_loss", None) is original:
            monkeypatch.setattr(module, "policy_loss", flipped)
    return flipped


def test_the_flipped_surrogate_does_not_raise_it(tmp_path, flipped_surrogate):
    rewards, _flat = _main_job_rewards("miles", 0, tmp_path / "run")
    assert _rise(rewards) < 0.05, rewards
