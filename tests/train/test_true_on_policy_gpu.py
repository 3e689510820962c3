"""``true_on_policy`` on one NVIDIA GPU in bf16 (skipped without CUDA; tagged ``gpu`` in Bazel).

    python -m pytest -q tests/train/test_true_on_policy_gpu.py

* ``--hardware nvidia --dtype bf16``, ``train_impl=reference``: the reference training model computes on the GPU
  (where the engine computes), and a 3-step GRPO run (2 prompts x 4 samples, 8 new tokens) has
  ``train_rollout_logprob_abs_diff == 0.0`` and ``train_rollout_kl == 0.0`` at every step: the lockstep engine
  (one forward of each group's ``[n, prompt + max_new_tokens]`` batch per token, every routed expert over every row)
  and the trainer's no-grad log-prob pass (one forward per group, the same shape and rows) run the same kernels on
  the same shapes with the same weights (the lossless sync keeps the trainer's fp32 RMSNorm weights), and the
  engine samples from exactly those log-probs;
* ``train_impl=miles`` and ``megatron`` (``--impl`` the same): the engine draws from the trainer's own module
  (``rollout.reference_engine.TrainModuleEngine``, the lockstep loop through ``next_token_logprobs``) on the GPU, the same
  3-step run with the same exact zeros and no weight sync; with the reference kernel ops and with triton's
  (``--kernel-backend triton``: the module's forward kernels, asserted to have run);
* the control: the same run without ``true_on_policy`` (the KV-cached bf16 engine, eager) has a difference above 0,
  so the exact run is not exact by accident of the measure.
"""

from __future__ import annotations

import pytest
import torch

from core.config import preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = preset("tiny")
RUN = dict(mode="grpo", max_new_tokens=8, prompts_per_step=2, group_size=4, progress=False, train_impl="reference",
           save_every=100, export_at_end=False)


def _nvidia_bf16_run(impl="miles", kernel_backend="none"):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    impl = "miles" if impl == "reference" else impl
    return normalize(Choices(impl=impl, hardware="nvidia", dtype="bf16", rollout_engine="reference", model=CFG,
                             kernel_backend=kernel_backend), make_host(third_party=False), model_name="tiny")


def _rows(run_dir):
    from reporting.metrics import read_metrics

    return read_metrics(run_dir)


def test_the_reference_training_model_computes_on_the_runs_gpu():
    from train.model import build_train_model

    m = build_train_model(CFG, _nvidia_bf16_run(), impl="reference", dtype=torch.bfloat16)
    assert m.model.head.weight.device.type == "cuda" and m.model.head.weight.dtype == torch.bfloat16
    assert m.model.norm.weight.dtype == torch.float32                   # RMSNorm weights stay fp32
    lp = m.logprobs(torch.tensor([[0, 5, 6, 7]]))
    assert lp.device.type == "cpu" and lp.shape == (1, 3)               # back next to the ids


@pytest.mark.parametrize("train_impl,kernel_backend", [("reference", "none"), ("miles", "none"), ("megatron", "none"),
                                                       ("miles", "triton"), ("megatron", "triton")])
def test_grpo_diff_exactly_zero_in_bf16_on_the_gpu(tmp_path, train_impl, kernel_backend):
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from orchestration import run_training

    run = _nvidia_bf16_run(train_impl, kernel_backend)
    assert run.torch_dtype == torch.bfloat16
    reset_kernels_ran()
    run_training(run, CFG, steps=3, run_dir=tmp_path / "exact", true_on_policy=True, **{**RUN, "train_impl": train_impl})
    if kernel_backend == "triton":      # the engine drew from, and the trainer scored with, triton's kernels
        ran = kernels_ran()
        for op in ("sparse_attention_with_sink", "indexer_scores", "apply_rope", "rms_norm", "weighted_swiglu"):
            assert ran.get(f"triton.{op}", 0) > 0 and not ran.get(f"none.{op}"), (op, ran)
    rows = _rows(tmp_path / "exact")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        if train_impl == "reference":
            assert r["weight_check_ok"] is True, r          # the lossless sync into the engine's model
        else:
            assert r["weight_sync_bytes"] == 0, r           # the engine draws from the trainer's own module
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["train_rollout_kl"] == 0.0, r
        assert r["routing_replay_match"] == 1.0, r


def test_without_true_on_policy_the_difference_is_not_zero(tmp_path):
    from orchestration import run_training

    run_training(_nvidia_bf16_run(), CFG, steps=2, run_dir=tmp_path / "control", rollout_cuda_graphs=False, **RUN)
    rows = _rows(tmp_path / "control")
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["train_rollout_logprob_abs_diff"] > 0.0 for r in rows), rows
    assert all(r["train_rollout_logprob_abs_diff"] < 0.1 for r in rows), rows      # bf16 rounding, not a bug
