"""The trainer's knobs are range-checked when the config is made (issue #21, item 3)."""

import math

import pytest

from core.config import ConfigError


@pytest.mark.parametrize("key, value, allowed", [
    ("lr", math.nan, r"finite number > 0"),
    ("lr", math.inf, r"finite number > 0"),
    ("lr", -1e-3, r"> 0"),
    ("batch_size", 0, r"1 \.\. 65,536"),
    ("group_size", -1, r"1 \.\."),
    ("temperature", 0.0, "> 0"),
    ("top_p", 1.5, "<= 1"),
    ("top_k", -1, r"0 \.\."),
    ("betas", (0.9, 1.0), "< 1"),
    ("grad_clip", 0.0, "> 0"),
    ("save_every", 0, r"1 \.\."),
    ("kl_coef", -0.1, ">= 0"),
    ("adam_moments_dtype", "fp16", "one of fp32, bf16"),
])
def test_out_of_range_train_config_is_refused(key, value, allowed):
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match=rf"'{key}'.*out of range.*{allowed}"):
        TrainConfig(**{key: value})


def test_run_training_refuses_a_nan_lr_before_creating_anything(tmp_path):
    from core.config import preset
    from orchestration import run_training

    from ._impl_helpers import run_config

    with pytest.raises(ConfigError, match="lr"):
        run_training(run_config("miles", preset("tiny")), preset("tiny"), mode="sft", steps=1, run_dir=tmp_path / "run", lr=math.nan,
                     progress=False)
    assert not (tmp_path / "run").exists()


def test_bf16_adam_moments_are_refused_off_the_gpu_before_creating_anything(tmp_path):
    """Only the Triton AdamW of a GPU target keeps bf16 moments; on the CPU the key is refused, not ignored."""
    from core.config import preset
    from orchestration import run_training

    from ._impl_helpers import run_config

    with pytest.raises(ConfigError, match="adam_moments_dtype.*Fix: --hardware nvidia"):
        run_training(run_config("miles", preset("tiny")), preset("tiny"), mode="sft", steps=1, run_dir=tmp_path / "run",
                     adam_moments_dtype="bf16", progress=False)
    assert not (tmp_path / "run").exists()
