"""bench.grpo: the GRPO benchmark runs the product's command (dsv4 train --mode grpo with the weight-sync mode) and
averages each phase over the steps after the warm-up (the record bench/results/grpo-cpu-tiny-weight-sync.json is
one full run of it)."""

from pathlib import Path

import pytest


def test_the_command_is_dsv4_train_grpo_with_the_mode():
    from bench.grpo import grpo_command

    cmd = grpo_command("shared", impl="megatron", model="tiny", run_dir=Path("/r"), steps=5, hardware="nvidia",
                       prompts=8, group=8, new_tokens=128, options=["colocate=true"])
    assert cmd[1:6] == ["-m", "launchers.dsv4", "train", "--mode", "grpo"]
    for want in (["--impl", "megatron"], ["--kernel-backend", "triton"], ["--steps", "5"], ["--run-dir", "/r"]):
        i = cmd.index(want[0])
        assert cmd[i:i + 2] == want
    assert {"weight_sync=shared", "prompts_per_step=8", "group_size=8", "max_new_tokens=128",
            "save_at_end=false", "colocate=true"} <= set(cmd)


def test_phases_are_averaged_after_the_warmup():
    from bench.grpo import first_step_seconds, summarize

    rows = [dict(step=s, time_step=s, time_update_weights=0.1 * s, time_rollout=2, time_logprobs=2, time_train=3,
                 weight_sync_bytes=100 * s, weight_sync_shared_bytes=0, train_rollout_logprob_abs_diff=0.5,
                 reward_mean=s, response_tokens=64 * s, wall_time=1000.0 + 10 * s) for s in (1, 2, 3)]
    got = summarize(rows, warmup=1)
    assert got["timed_steps"] == 2 and got["step_ms"] == pytest.approx(2500.0)
    assert got["rollout_tokens_per_s"] == pytest.approx(80.0)          # 160 tokens in 2 s
    assert first_step_seconds(rows, started=990.0) == pytest.approx(20.0)
    assert got["update_weights_ms"] == pytest.approx(250.0) and got["train_ms"] == pytest.approx(3000.0)
    assert got["sync_bytes"] == 250 and got["reward_mean"] == pytest.approx(2.5)
    with pytest.raises(RuntimeError, match="none after the 3 warm-up steps"):
        summarize(rows, warmup=3)
