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

__all__ = ["validate", "check_mode", "check_static_shapes", "check_train_options", "check_true_on_policy"]

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
    from reporting.trackers import TRACKERS

    allowed = f"a list of {', '.join(TRACKERS)} (each at most once; none alone)"
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not names:
        _fail("tracker", names, allowed)
    if any(n not in TRACKERS for n in names) or len(set(names)) != len(names) or (
            "none" in names and len(names) > 1):
        _fail("tracker", names, allowed)


def _cuda_graphs(cfg) -> None:
    """``cuda_graphs`` and ``pad_to_length`` against the other knobs (the layout is the combination table's:
    :mod:`train.rules`, rule ``train-cuda-graphs``)."""
    if cfg.pad_to_length is not None:
        _int("pad_to_length", cfg.pad_to_length, 2, _BIG)
        if cfg.max_tokens_per_rank is not None:
            raise ConfigError("training option 'pad_to_length' pads rows to one length, and 'max_tokens_per_rank' "
                              "packs them into micro-batches of changing layout: give one of them")
        if cfg.dsa_indexer_loss_coeff is not None:
            raise ConfigError("training option 'pad_to_length' with 'dsa_indexer_loss_coeff': megatron's indexer KL "
                              "loss averages over every token, padding included, so padding would change it. Fix: "
                              "drop pad_to_length, or dsa_indexer_loss_coeff=none")
    if not cfg.cuda_graphs:
        return
    if not cfg.compile_blocks:
        raise ConfigError("training option 'cuda_graphs' replays the compiled blocks as CUDA graphs. "
                          "Fix: add --compile, or drop --cuda-graphs")
    if cfg.pad_to_length is None:
        raise ConfigError("training option 'cuda_graphs' needs one shape for every micro-batch. Fix: set "
                          "pad_to_length=N (at least the longest prompt + response of the data), or drop --cuda-graphs")
    if cfg.dsa_indexer_loss_coeff is not None:
        raise ConfigError("training option 'cuda_graphs' with 'dsa_indexer_loss_coeff': with megatron's indexer KL "
                          "loss on, CUDA-graph trees record the step again at every step (the indexer's saved "
                          "tensors live for another span in replay; measured on an H200: 0.76-1.14 s per step against 52 ms). Fix: drop "
                          "--cuda-graphs, or dsa_indexer_loss_coeff=none")


def check_mode(mode: str, cfg) -> None:
    """The knobs that apply to one mode only (SFT: ``pad_to_length``, ``cuda_graphs``; GRPO:
    ``async_rollout``, ``micro_batch_tokens``)."""
    if mode == "sft":
        if cfg.async_rollout:
            raise ConfigError("training option 'async_rollout' overlaps GRPO's rollout with its training, and --mode "
                              "sft has no rollout. Fix: drop async_rollout, or use --mode grpo")
        if cfg.micro_batch_tokens is not None:
            raise ConfigError("training option 'micro_batch_tokens' sizes GRPO's micro-batches of padded rows, and "
                              "--mode sft does not read it (not built). Fix: micro_batch_size=N rows, or "
                              "max_tokens_per_rank=N (packed), or use --mode grpo")
        return
    for key in ("cuda_graphs", "pad_to_length"):
        if getattr(cfg, key) not in (None, False):
            raise ConfigError(f"training option {_name(key)} applies to --mode sft: GRPO's forwards keep the routing "
                              f"they record and replay across forwards, and its rows are not padded to one length "
                              f"(not built). Fix: drop {key}, or use --mode sft")


def check_static_shapes(cfg, *, packed: bool, rows: int) -> None:
    """One shape per micro-batch for ``cuda_graphs``: rows padded to ``pad_to_length`` (not packed), and
    micro-batches of equal row counts (``rows``: the rank's sequences per step); ``micro_batch_tokens`` sizes
    padded rows, not packed streams."""
    if cfg.pad_to_length is not None and packed:
        raise ConfigError("training option 'pad_to_length' pads rows, and this run packs them into THD micro-batches "
                          "(--cp > 1 or --max-tokens-per-rank). Fix: drop pad_to_length, or use --cp 1 without a "
                          "packing budget")
    if cfg.micro_batch_tokens is not None and packed:
        raise ConfigError("training option 'micro_batch_tokens' sizes micro-batches of padded rows, and this run "
                          "packs its samples into THD micro-batches (--cp > 1 or --max-tokens-per-rank), which "
                          "max_tokens_per_rank sizes. Fix: drop micro_batch_tokens, or give that budget as "
                          "--max-tokens-per-rank N")
    mbs = cfg.micro_batch_size
    if cfg.cuda_graphs and mbs is not None and rows % mbs:
        raise ConfigError(f"training option 'cuda_graphs' needs micro-batches of one shape, and micro_batch_size="
                          f"{mbs} leaves a last micro-batch of {rows % mbs} of this rank's {rows} sequences. Fix: "
                          f"use a micro_batch_size that divides {rows}")


# true_on_policy: the training models it is exact with (docs/rollout.md#true-on-policy). reference: the built-in
# engine runs the reference model on the trainer's shapes; miles, megatron: the engine draws from the trainer's own
# module (rollout.reference_engine.TrainModuleEngine), whose experts (engine.moe.DSv4MoE, shared by both) honour
# row_invariant_experts; tested on the CPU in fp32 and bf16 and on one NVIDIA GPU in bf16 (reference ops; triton's:
# docs/rollout.md#true-on-policy). Another implementation's MoE may not honour it.
ON_POLICY_IMPLS = ("reference", "miles", "megatron")


def _true_on_policy_refusal(what: str, fix: str) -> ConfigError:
    return ConfigError(f"training option 'true_on_policy' is exact only with train_impl=reference (the built-in "
                       f"engine) or train_impl=miles or megatron (the engine draws from the trainer's module), on the "
                       f"CPU in fp32 or bf16 or one NVIDIA GPU in bf16, on one rank, and {what}. "
                       f"Fix: {fix}, or drop true_on_policy")


def _check_true_on_policy_options(cfg) -> None:
    """The TrainConfig knobs that ``true_on_policy`` refuses (docs/rollout.md#true-on-policy); ``train_impl`` None
    (the run's implementation) is checked against the built model (:func:`check_true_on_policy`)."""
    if cfg.train_impl is not None and cfg.train_impl not in ON_POLICY_IMPLS:
        raise _true_on_policy_refusal(f"train_impl={cfg.train_impl!r} is not built for it (its experts may not "
                                      f"honour row_invariant_experts)",
                                      f"set train_impl={' or '.join(ON_POLICY_IMPLS)}")
    for key, bad, why in (
            ("micro_batch_size", cfg.micro_batch_size is not None, "splits a group's rows into other shapes"),
            ("max_tokens_per_rank", cfg.max_tokens_per_rank is not None, "packs samples into other shapes"),
            ("micro_batch_tokens", cfg.micro_batch_tokens is not None, "regroups the samples into other shapes"),
            ("async_rollout", cfg.async_rollout, "trains on samples of the previous weights"),
            ("colocate", cfg.colocate, "is not tested with it"),
            ("rollout_cuda_graphs", bool(cfg.rollout_cuda_graphs), "replays the cached decode step"),
            ("rollout_compile", bool(cfg.rollout_compile), "compiles the cached decode step")):
        if bad:
            raise _true_on_policy_refusal(f"{key} {why}", f"drop {key}")


def check_true_on_policy(run_config, cfg, model=None, dist=None) -> None:
    """``true_on_policy`` with the run's choices: the reference training model (the CPU in fp32 or bf16 or one
    NVIDIA GPU in bf16, the reference engine and kernel ops, the lossless ``bf16`` publish format: weights sent
    as they are) or the miles / megatron one (the CPU in fp32 or bf16 or one NVIDIA GPU in bf16; the engine draws
    from it, no weights are sent), one rank, the local orchestrator."""
    if not cfg.true_on_policy:
        return
    _check_true_on_policy_options(cfg)
    impl = getattr(model, "impl", None) if model is not None else None
    if model is not None and impl not in ON_POLICY_IMPLS:
        raise _true_on_policy_refusal(f"the training model is {impl!r} (its experts may not honour "
                                      f"row_invariant_experts)", f"set train_impl={' or '.join(ON_POLICY_IMPLS)}")
    if model is not None and impl != "reference":
        dtypes = {str(p.dtype) for p in model.parameters() if p.is_floating_point()}
        where = getattr(model.device, "type", str(model.device))
        built = {"cpu": {"torch.float32", "torch.bfloat16"}, "cuda": {"torch.float32", "torch.bfloat16"}}
        # on a GPU: bf16 weights (the fp32-kept tensors, RMSNorm weights and sinks, stay fp32 beside them)
        if where not in built or dtypes - built[where] or (where == "cuda" and "torch.bfloat16" not in dtypes):
            raise _true_on_policy_refusal(f"the {impl} model is on {where} with {sorted(dtypes)} weights (tested on "
                                          "the CPU in fp32 and bf16 and on one NVIDIA GPU in bf16)",
                                          "use --hardware cpu, or --hardware nvidia --dtype bf16")
    if dist is not None and getattr(dist, "world", 1) != 1:
        raise _true_on_policy_refusal(f"the run has {dist.world} ranks", "train on one rank")
    if run_config is not None:                   # the run's choices: rule ``true-on-policy`` (train.rules)
        import dataclasses

        from core.combinations import InvalidCombination, train_option_problems

        problems = train_option_problems(dataclasses.replace(run_config.selection, true_on_policy=True),
                                         run_config.rules)
        if problems:
            raise InvalidCombination("\n".join(problems))
        kernels = run_config.selection.kernel.name
        if kernels != "none" and "reference" in (cfg.train_impl, impl):   # its engine's model runs the reference ops
            raise _true_on_policy_refusal(f"--kernel-backend {kernels} with train_impl=reference",
                                          "use --kernel-backend none, or drop train_impl (the trainer's module draws)")


def _check_pipeline_options(run_config, cfg) -> None:
    """What ``--pp`` > 1 is built for (engine.pipeline.run_items): the last stage computes the policy / SFT loss of one model."""
    pp = getattr(run_config, "pp", 1)
    for key, bad, why in (("compile_blocks", cfg.compile_blocks, "compiled blocks are not cut into stages"),
                          ("train_impl", cfg.train_impl is not None, "the reference training model is one process"),
                          ("dsa_indexer_loss_coeff", cfg.dsa_indexer_loss_coeff is not None,
                           "megatron's indexer KL loss of a stage's layers is not carried to the last stage's loss")):
        if pp > 1 and bad:
            raise ConfigError(f"training option {key!r} = {getattr(cfg, key)!r} with --pp {pp}: not built ({why}). "
                              f"Fix: drop {key}, or use --pp 1")


def _indexer_replay_refusal(what: str, fix: str) -> ConfigError:
    return ConfigError(f"training option 'indexer_replay' is not built with {what}. Fix: {fix}, or drop indexer_replay")


def _check_indexer_replay_options(cfg) -> None:
    """The TrainConfig knobs indexer replay is not built with (docs/training.md#one-step)."""
    if cfg.true_on_policy:
        raise _indexer_replay_refusal("true_on_policy (its engine draws from the trainer's own forward, whose "
                                      "picks need no replay)", "drop true_on_policy")


def _check_indexer_replay_run(run_config, cfg) -> None:
    """Indexer replay with the run's choices: the built-in engine records the picks; the reference, miles (BSHD or
    THD) and megatron models replay them (rows or packed micro-batches); tensor parallel (every rank of the
    group replays the leader's picks: its samples, picks included, are broadcast); one rank of context and
    pipeline parallelism; the local orchestrator."""
    sel = run_config.selection
    for bad, what, fix in (
            (sel.rollout is not None and sel.rollout.name != "reference",
             f"--rollout-engine {getattr(sel.rollout, 'name', None)} (it returns no indexer picks)",
             "use --rollout-engine reference"),
            (getattr(run_config, "pp", 1) > 1, f"--pp {getattr(run_config, 'pp', 1)} (the pipeline's micro-batch "
             "driver does not carry the picks)", "use --pp 1"),
            (sel.cp > 1, f"--cp {sel.cp} (megatron's context-parallel indexer does not read the replay seam; "
             "not tested)", "use --cp 1"),
            (sel.orchestrator != "local", f"--orchestrator {sel.orchestrator} (not tested)",
             "use --orchestrator local")):
        if bad:
            raise _indexer_replay_refusal(what, fix)


def check_train_options(run_config, cfg, host=None) -> None:
    """The trainer's options that the combination table checks with the run's layout (the run's rules that read
    them: ``train-cuda-graphs``, ``true-on-policy`` in :mod:`train.rules`, ``async-rollout`` in
    :mod:`rollout.rules`, ``ray-colocate`` in :mod:`orchestration.rules`); raises the table's InvalidCombination."""
    import dataclasses

    from core.combinations import InvalidCombination, train_option_problems

    if cfg.true_on_policy:
        _check_true_on_policy_options(cfg)
    _check_pipeline_options(run_config, cfg)
    if cfg.adam_moments_dtype == "bf16" and not run_config.selection.hardware.gpu:
        raise ConfigError("training option 'adam_moments_dtype' = bf16 needs the Triton AdamW of a GPU target. "
                          "Fix: --hardware nvidia, or adam_moments_dtype=fp32")
    from engine.wgrad_fusion import resolve       # wgrad_fusion=on where it cannot apply: refused, naming why

    resolve(cfg.wgrad_fusion, run_config.selection.hardware.gpu, run_config.torch_dtype, bool(cfg.compile_blocks))
    if cfg.indexer_replay:
        _check_indexer_replay_run(run_config, cfg)
    if cfg.weight_sync == "shared":
        from rollout.shared_weights import refusal_message, run_refusal

        why = run_refusal(run_config, cfg)
        if why:
            raise ConfigError(refusal_message(why))
    problems = train_option_problems(dataclasses.replace(run_config.selection, cuda_graphs=bool(cfg.cuda_graphs),
                                                         colocate=bool(cfg.colocate),
                                                         async_rollout=bool(cfg.async_rollout),
                                                         true_on_policy=bool(cfg.true_on_policy)),
                                     run_config.rules, host)
    if problems:
        raise InvalidCombination("\n".join(problems))
    sel = run_config.selection
    if sel.orchestrator == "ray" and sel.rollout is not None and sel.rollout.server and run_config.rollout_url is None \
            and int(getattr(cfg, "sglang_tp_size", 1)) > 1:
        raise ConfigError(f"training option 'sglang_tp_size' = {cfg.sglang_tp_size}: under --orchestrator ray each "
                          f"engine actor starts its server on the one GPU of its bundle. Fix: sglang_tp_size=1, or "
                          f"start the servers yourself and pass one --rollout-url per engine actor")
    if cfg.rollout_cuda_graphs and not run_config.selection.hardware.gpu:
        raise ConfigError(f"training option 'rollout_cuda_graphs' replays the rollout engine's decode step from CUDA "
                          f"graphs, and --hardware {run_config.selection.hardware.name} has no CUDA device. Fix: drop "
                          f"rollout_cuda_graphs (none: on for a CUDA device), or rollout_cuda_graphs=false")


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
    _int("profile_steps", cfg.profile_steps, 0, 1 << 16)
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
    if cfg.micro_batch_tokens is not None:
        _int("micro_batch_tokens", cfg.micro_batch_tokens, 1, 1 << 30)
        for other, how in (("micro_batch_size", "by samples"), ("max_tokens_per_rank", "packed, by tokens")):
            if getattr(cfg, other) is not None:
                raise ConfigError(f"training options 'micro_batch_tokens' and {other!r} both size GRPO's "
                                  f"micro-batches (padded rows by tokens; {how}): give one of them")
    if cfg.true_on_policy:
        _check_true_on_policy_options(cfg)
    if cfg.indexer_replay:
        _check_indexer_replay_options(cfg)
    from engine.recompute import MODES

    if cfg.recompute not in MODES:
        _fail("recompute", cfg.recompute, f"must be one of {', '.join(MODES)}")
    if cfg.sglang_weight_sync not in ("tensors", "disk"):
        _fail("sglang_weight_sync", cfg.sglang_weight_sync, "must be one of tensors, disk")
    _int("sglang_tp_size", cfg.sglang_tp_size, 1, 1 << 10)
    _int("sglang_port", cfg.sglang_port, 0, 65535)
    _number("sglang_startup_timeout_s", cfg.sglang_startup_timeout_s, lo=0, lo_open=True)
    _number("rendezvous_timeout_s", cfg.rendezvous_timeout_s, lo=0, lo_open=True, hi=86400)
    try:
        shlex.split(cfg.sglang_server_args)
    except (ValueError, AttributeError):
        _fail("sglang_server_args", cfg.sglang_server_args, "must be launch_server arguments as one shell-quoted "
              "string (e.g. '--mem-fraction-static 0.7')")
    if cfg.rollout_max_slots is not None:
        _int("rollout_max_slots", cfg.rollout_max_slots, 1, _BIG)
    if cfg.rollout_cuda_graphs not in (None, True, False):
        _fail("rollout_cuda_graphs", cfg.rollout_cuda_graphs, "must be true, false or none (on for a CUDA device)")
    if cfg.rollout_compile not in (True, False):
        _fail("rollout_compile", cfg.rollout_compile, "must be true or false")
    _trackers(cfg.tracker)
    _cuda_graphs(cfg)
    if cfg.adam_moments_dtype not in ("fp32", "bf16"):
        _fail("adam_moments_dtype", cfg.adam_moments_dtype, "must be one of fp32, bf16")
    if cfg.wgrad_fusion not in ("auto", "on", "off"):
        _fail("wgrad_fusion", cfg.wgrad_fusion, "must be one of auto, on, off")
    if cfg.weight_sync not in ("auto", "shared", "copy"):
        _fail("weight_sync", cfg.weight_sync, "must be one of auto, shared, copy")
    if cfg.weight_sync == "shared" and cfg.async_rollout:
        raise ConfigError("training option 'weight_sync' = shared lets the engine compute with the trainer's weights "
                          "in place, and 'async_rollout' generates while the trainer updates them. Fix: "
                          "weight_sync=auto (copies with async_rollout) or drop async_rollout")
    if cfg.async_rollout and cfg.colocate:
        raise ConfigError("training option 'async_rollout' generates the next step's samples while the trainer "
                          "trains, and 'colocate' frees the engine's memory for the trainer during that time. Fix: "
                          "drop one of them")
    _int("save_every", cfg.save_every, 1, 1 << 30)
    _int("keep_last", cfg.keep_last, 1, 1 << 20)
