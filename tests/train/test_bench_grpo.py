"""bench.grpo: the GRPO benchmark runs the product's command (dsv4 train --mode grpo with the weight-sync mode) and
averages each phase over the steps after the warm-up (the record bench/results/grpo-cpu-tiny-weight-sync.json is
one full run of it)."""

from pathlib import Path

import pytest
import torch


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


def test_sft_first_trains_the_model_on_the_task_and_exports_it():
    """``--sft-steps N``: the SFT run is the product's command too (built-in task, no checkpoint, an export the
    GRPO rows start from; bench/results/grpo-cpu-tiny-sft-first.json is one full run)."""
    from bench.grpo import sft_command

    cmd = sft_command(impl="miles", model="tiny", run_dir=Path("/s"), steps=20, hardware="cpu")
    assert cmd[1:6] == ["-m", "launchers.dsv4", "train", "--mode", "sft"]
    for want in (["--kernel-backend", "none"], ["--steps", "20"], ["--run-dir", "/s"], ["--model", "tiny"]):
        i = cmd.index(want[0])
        assert cmd[i:i + 2] == want
    assert {"export_at_end=true", "save_at_end=false"} <= set(cmd) and "--data" not in cmd


def test_phases_are_averaged_after_the_warmup():
    from bench.grpo import first_step_seconds, summarize

    rows = [dict(step=s, time_step=s, time_update_weights=0.1 * s, time_rollout=2, time_rollout_wait=1.5 + s,
                 time_logprobs=2, time_train=3,
                 weight_sync_bytes=100 * s, weight_sync_shared_bytes=0, train_rollout_logprob_abs_diff=0.5,
                 reward_mean=s, response_tokens=64 * s, wall_time=1000.0 + 10 * s) for s in (1, 2, 3)]
    got = summarize(rows, warmup=1)
    assert got["timed_steps"] == 2 and got["step_ms"] == pytest.approx(2500.0)
    assert got["rollout_tokens_per_s"] == pytest.approx(80.0)          # 160 tokens in 2 s
    assert first_step_seconds(rows, started=990.0) == pytest.approx(20.0)
    assert got["update_weights_ms"] == pytest.approx(250.0) and got["train_ms"] == pytest.approx(3000.0)
    assert got["sync_bytes"] == 250 and got["reward_mean"] == pytest.approx(2.5)
    assert [(p["step"], p["step_ms"], p["train_ms"]) for p in got["per_step"]] == [(1, 1e3, 3e3), (2, 2e3, 3e3),
                                                                                    (3, 3e3, 3e3)]
    assert got["generate_ms"] == pytest.approx(4000.0)                  # the engine's generate call, steps 2, 3
    assert "decode_ms" not in got                                       # no engine phases in these rows
    assert [p["generate_ms"] for p in got["per_step"]] == [2500.0, 3500.0, 4500.0]
    with pytest.raises(RuntimeError, match="none after the 3 warm-up steps"):
        summarize(rows, warmup=3)
    assert "train_peak_gib" not in got                                  # a CPU run has no device memory
    for r in rows:
        r.update(train_peak_memory_gib=50.0 + r["step"], cuda_alloc_retries=2 * r["step"])
    got = summarize(rows, warmup=1)
    assert got["train_peak_gib"] == 53.0 and got["alloc_retries"] == 6
    for r in rows:                                                      # the built-in engine's phases
        r.update(time_rollout_setup=0.0, time_rollout_prefill=0.1 * r["step"], time_rollout_decode=r["step"],
                 rollout_decode_steps=7, rollout_decode_rows=7 * 64)
    got = summarize(rows, warmup=1)
    assert got["decode_ms"] == pytest.approx(2500.0) and got["prefill_ms"] == pytest.approx(250.0)
    assert got["decode_steps"] == 7 and got["decode_rows"] == 448
    assert "decode_kv_bytes" not in got                                 # an engine that does not count them
    for r in rows:
        r["rollout_decode_kv_bytes"] = 1e6 * r["step"]
    assert summarize(rows, warmup=1)["decode_kv_bytes"] == pytest.approx(2.5e6)
    assert [p["decode_ms"] for p in got["per_step"]] == [1000.0, 2000.0, 3000.0]



def test_the_decode_roofline_counts_the_weights_a_batch_touches():
    """bench.grpo's bound of a decode step (from the weight contract's native names and shapes) equals, at batch 1,
    bench.rollout's count from a bf16 engine model's own tensors; a larger batch touches more routed experts, up
    to all of them; the rollout's share and the train phase's dense MFU follow from a row."""
    from bench.flops import H200_BF16_DENSE_TFLOPS, active_params
    from bench.grpo import H200_HBM_BYTES_PER_S, decode_weight_bytes, hardware_shares
    from bench.rollout import weight_bytes_per_token
    from core.config import preset
    from rollout.reference_engine import ReferenceEngine

    c = preset("tiny")
    assert decode_weight_bytes(c, 1) == weight_bytes_per_token(ReferenceEngine(c, dtype=torch.bfloat16).model)
    experts = c.n_layers * c.n_routed_experts * 3 * c.dim * c.moe_inter_dim * 2      # every routed expert, bf16
    share = c.n_activated_experts / c.n_routed_experts
    assert decode_weight_bytes(c, 8) - decode_weight_bytes(c, 1) > 0.9 * experts * ((1 - (1 - share) ** 8) - share)
    # 10,000 rows touch every expert and (past the 1,024-id vocabulary) every row of the embedding and hash tables
    assert decode_weight_bytes(c, 10 ** 4) - decode_weight_bytes(c, 1) == pytest.approx(
        experts * (1 - share) + (c.vocab_size - 1) * (c.dim * 2 + c.n_hash_layers * c.n_activated_experts * 8),
        rel=1e-9)

    row = dict(rollout_ms=1000.0, generate_ms=800.0, train_ms=500.0, train_tokens=4096.0)
    got = hardware_shares(row, c, batch=4, new_tokens=16)
    assert got["rollout_roofline_ms"] == pytest.approx(1e3 * 16 * decode_weight_bytes(c, 4) / H200_HBM_BYTES_PER_S)
    assert got["rollout_roofline_share"] == pytest.approx(got["rollout_roofline_ms"] / 1000.0)
    assert got["generate_roofline_share"] == pytest.approx(got["rollout_roofline_ms"] / 800.0)
    assert got["train_mfu_dense"] == pytest.approx(6 * active_params(c) * 4096 / 0.5 / (H200_BF16_DENSE_TFLOPS * 1e12))
    assert "decode_roofline_share" not in got                # an engine that does not time its phases
    # the engine's decode steps alone: 15 steps of 4 rows (60 rows fed) in 300 ms, each bound by batch 4's weights
    row.update(decode_ms=300.0, decode_steps=15.0, decode_rows=60.0)
    got = hardware_shares(row, c, batch=4, new_tokens=16)
    bound_ms = 1e3 * 15 * decode_weight_bytes(c, 4) / H200_HBM_BYTES_PER_S
    assert got["decode_roofline_ms"] == pytest.approx(bound_ms) and got["decode_step_ms"] == pytest.approx(20.0)
    assert got["decode_roofline_share"] == pytest.approx(bound_ms / 300.0)
    assert "decode_roofline_share_with_kv" not in got         # no cache bytes counted
    # with the cache bytes the engine counted (issue #32's measure): 96 MB more in the bound
    row["decode_kv_bytes"] = 96e6
    got = hardware_shares(row, c, batch=4, new_tokens=16)
    with_kv_ms = bound_ms + 1e3 * 96e6 / H200_HBM_BYTES_PER_S
    assert got["decode_roofline_ms_with_kv"] == pytest.approx(with_kv_ms)
    assert got["decode_roofline_share_with_kv"] == pytest.approx(with_kv_ms / 300.0)
    assert got["decode_roofline_share"] == pytest.approx(bound_ms / 300.0)


def test_a_failed_row_prints_its_error_whole_under_the_table(capsys):
    """A row that failed (the H100's out-of-memory line, bench/results/grpo-h100-flash-shaped-oom-256.json) says
    so in the table and prints its message on one line below it, not wrapped into a column of words."""
    import json
    from pathlib import Path

    from bench.grpo import print_table

    record = Path(__file__).parents[2] / "bench/results/grpo-h100-flash-shaped-oom-256.json"
    row = json.loads(record.read_text())["rows"][0]
    print_table([row], "t")
    out = capsys.readouterr().out
    assert "failed" in out
    assert f"shared: {row['error']}" in out.splitlines()          # whole, on a line of its own
