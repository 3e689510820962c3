"""Ranges of the trainer's knobs (:class:`train.trainer.TrainConfig`), checked when the config is made.

Why: an out-of-range value used to be accepted and fail much later, or not at
all: ``--lr nan`` / ``--lr inf`` trained NaN weights and exited 0, a zero
batch was a tensor-shape error deep inside a step, a negative temperature
sampled garbage. :func:`validate` refuses each before any work starts, with
one message naming the key (and its command-line option where there is one)
and the accepted range. The errors are :class:`core.config.ConfigError`, which
the launcher prints as one line.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from core.config import ConfigError

__all__ = ["validate"]

_OPTION = {"tracker": "--tracker", "lr": "--lr", "seed": "--seed", "save_every": "--save-every", "data": "--data",
           "max_tokens_per_rank": "--max-tokens-per-rank"}
_BIG = 1 << 20


def _name(key: str) -> str:
    return f"{key!r} ({_OPTION[key]})" if key in _OPTION else repr(key)


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"training option {_name(key)} = {value!r} is out of range: {allowed}")


def _number(key: str, v: Any, *, lo: float, lo_open: bool, hi: float = math.inf, hi_open: bool = False) -> None:
    lo_s = f"> {lo:g}" if lo_open else f">= {lo:g}"
    hi_s = "" if hi == math.inf else (f" and < {hi:g}" if hi_open else f" and <= {hi:g}")
    allowed = f"must be a finite number {lo_s}{hi_s}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(key, v, allowed)
    if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        _fail(key, v, allowed)


def _int(key: str, v: Any, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        _fail(key, v, f"must be an integer in {lo:,} .. {hi:,}")


def _trackers(names: Any) -> None:
    from .trackers import TRACKERS

    allowed = f"a list of {', '.join(TRACKERS)} (each at most once; none alone)"
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names:
        _fail("tracker", names, allowed)
    if any(n not in TRACKERS for n in names) or len(set(names)) != len(names) or (
            "none" in names and len(names) > 1):
        _fail("tracker", names, allowed)


def validate(cfg) -> None:
    """Raise ConfigError for the first knob of ``cfg`` (a TrainConfig) outside its range."""
    _int("seed", cfg.seed, 0, 2 ** 63 - 1)
    _number("lr", cfg.lr, lo=0, lo_open=True)
    _number("weight_decay", cfg.weight_decay, lo=0, lo_open=False)
    betas = tuple(cfg.betas) if isinstance(cfg.betas, (list, tuple)) else None
    if betas is None or len(betas) != 2:
        _fail("betas", cfg.betas, "must be two numbers in [0, 1)")
    for b in betas:
        _number("betas", b, lo=0, lo_open=False, hi=1, hi_open=True)
    _number("grad_clip", cfg.grad_clip, lo=0, lo_open=True)
    for key in ("batch_size", "prompts_per_step", "group_size"):
        _int(key, getattr(cfg, key), 1, 1 << 16)
    _int("max_new_tokens", cfg.max_new_tokens, 1, _BIG)
    _number("temperature", cfg.temperature, lo=0, lo_open=True)
    _number("top_p", cfg.top_p, lo=0, lo_open=True, hi=1)
    _int("top_k", cfg.top_k, 0, _BIG)
    _int("max_bucket_bytes", cfg.max_bucket_bytes, 1, 1 << 40)
    for key in ("clip_low", "clip_high", "kl_coef", "mtp_coef"):
        _number(key, getattr(cfg, key), lo=0, lo_open=False)
    if cfg.dsa_indexer_loss_coeff is not None:
        _number("dsa_indexer_loss_coeff", cfg.dsa_indexer_loss_coeff, lo=0, lo_open=False)
    if cfg.max_tokens_per_rank is not None:
        _int("max_tokens_per_rank", cfg.max_tokens_per_rank, 1, 1 << 30)
    if cfg.micro_batch_size is not None:
        _int("micro_batch_size", cfg.micro_batch_size, 1, 1 << 16)
        if cfg.max_tokens_per_rank is not None:
            raise ConfigError("training options 'micro_batch_size' and 'max_tokens_per_rank' both size micro-batches "
                              "(by samples, by tokens): give one of them")
    from engine.recompute import MODES

    if cfg.recompute not in MODES:
        _fail("recompute", cfg.recompute, f"must be one of {', '.join(MODES)}")
    if cfg.sglang_weight_sync not in ("tensors", "disk"):
        _fail("sglang_weight_sync", cfg.sglang_weight_sync, "must be one of tensors, disk")
    _int("sglang_tp_size", cfg.sglang_tp_size, 1, 1 << 10)
    _int("sglang_port", cfg.sglang_port, 0, 65535)
    _number("sglang_startup_timeout_s", cfg.sglang_startup_timeout_s, lo=0, lo_open=True)
    try:
        shlex.split(cfg.sglang_server_args)
    except (ValueError, AttributeError):
        _fail("sglang_server_args", cfg.sglang_server_args, "must be launch_server arguments as one shell-quoted "
              "string (e.g. '--mem-fraction-static 0.7')")
    _trackers(cfg.tracker)
    _int("save_every", cfg.save_every, 1, 1 << 30)
    _int("keep_last", cfg.keep_last, 1, 1 << 20)
