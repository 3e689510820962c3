"""What each `dsv4` subcommand does, kept apart from the click wiring.

Heavy imports (torch, the reference model, checkpoint I/O) happen inside the
functions, so `dsv4 --help`, `dsv4 plugins` and `dsv4 validate` stay fast.
Human-readable output goes to stdout through rich; logs and progress go to
stderr, so commands that print JSON keep stdout clean.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from core.errors import UserInputError
from core.records import AXES, AXIS_OPTION

# Pipes and CI logs get a wide console instead of rich's 80-column default.
out = Console(width=None if sys.stdout.isatty() else 150)
log = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


@dataclass(frozen=True)
class Stage:
    name: str
    does: str
    built: bool
    tracking: str = ""


# The launcher's stages and whether each exists yet: the main job prints this,
# and docs/cli.md lists them.
STAGES = (
    Stage("plugins", "list the backends of every axis", True),
    Stage("validate", "resolve choices against the combination table", True),
    Stage("prepare", "write a deterministic official-format checkpoint, or download one from the Hub", True),
    Stage("inspect", "parameter counts by component", True),
    Stage("logprobs", "score token sequences with the chosen implementation", True),
    Stage("convert", "HF -> native checkpoint through the weight contract", True),
    Stage("prepare-fp8", "MXFP4 routed experts -> FP8, lossless (checked per tile)", True),
    Stage("dequantize", "FP8 (e8m0 or fp32 scales) / MXFP4 checkpoint -> BF16, streaming", True),
    Stage("train", "SFT / GRPO training with a rollout engine, replay, checkpoints", True),
    Stage("full-train", "prepare -> prepare-fp8 -> convert -> train, skipping completed stages", True),
    Stage("export", "a run's last checkpoint -> HF checkpoint", True),
    Stage("plot", "PNG curves of a run's metrics", True),
)

DEFAULT_MODEL = "tiny"


@dataclass(frozen=True)
class ModelSource:
    """What `--model` named: a preset, or an HF checkpoint directory."""

    name: str
    config: object  # core.config.ModelConfig
    checkpoint: Optional[Path]


def model_config(spec: str) -> ModelSource:
    """Resolve `--model`: an existing directory is a checkpoint, else a preset name."""
    from core.config import PRESETS, ConfigError, preset

    path = user_path(spec)
    if path.is_dir():
        return ModelSource(spec, checkpoint_config(path), path)
    if spec in PRESETS:
        return ModelSource(spec, preset(spec), None)
    raise ConfigError(
        f"--model {spec!r} is neither a checkpoint directory nor a preset; presets: {', '.join(sorted(PRESETS))}"
    )


def checkpoint_config(path: Path):
    """The ModelConfig of an HF checkpoint (config.json), a native one (its metadata) or a megatron-core
    torch_dist one (the config.json `dsv4 convert --format torch_dist` writes beside it)."""
    from converters.torch_dist import is_torch_dist_checkpoint, torch_dist_model_config
    from core.config import ModelConfig
    from core.native_checkpoint import is_native_checkpoint, native_model_config

    if is_native_checkpoint(path):
        return native_model_config(path)  # held to the tensor sizes on disk before anything is allocated
    if is_torch_dist_checkpoint(path):
        return torch_dist_model_config(path)
    return ModelConfig.from_json(path / "config.json")


def check_checkpoint(checkpoint: Path, config) -> None:
    """Validate a checkpoint against the run's model before anything is built or spawned: an HF one's
    names, shapes and shards, a torch_dist one's tensors from its metadata (a native one is checked as it
    loads)."""
    from converters.torch_dist import check_torch_dist, is_torch_dist_checkpoint
    from core.checkpoint import open_checkpoint
    from core.native_checkpoint import is_native_checkpoint

    if is_native_checkpoint(checkpoint):
        return
    if is_torch_dist_checkpoint(checkpoint):
        check_torch_dist(checkpoint, config)
        return
    open_checkpoint(checkpoint)


# A few token sequences the main job scores on the embedded tiny model.
SAMPLE_TEXTS = ("DeepSeek-V4 on a CPU.", "2 + 3 = 5")


def user_path(path: str) -> Path:
    """Resolve a user-given path against the directory the user ran from.

    Under `bazel run` the process starts inside the runfiles tree; Bazel passes
    the user's directory as BUILD_WORKING_DIRECTORY.
    """
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return Path(base) / p


def cache_dir() -> Path:
    """Where the embedded default checkpoint is materialized (DSV4_CACHE overrides)."""
    root = os.environ.get("DSV4_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsv4")
    return Path(root)


# -- printing ------------------------------------------------------------


def print_plugins(data: dict) -> None:
    """One table per axis: name, providing distribution, usable here, description."""
    for axis in AXES:
        table = Table(title=f"{axis} ({AXIS_OPTION[axis]})", title_justify="left", expand=False)
        for column in ("name", "distribution", "usable here", "description"):
            table.add_column(column, overflow="fold")
        for entry in data[axis]:
            if not entry["runnable"]:
                usable = f"no (declared, not runnable): {entry['not_runnable_reason']}"
            elif "available" in entry:
                usable = "yes" if entry["available"] else f"no: {entry['unavailable_reason']}"
            else:
                usable = "not probed"
            table.add_row(entry["name"], entry["distribution"], usable, entry["description"])
        out.print(table)


def print_run_config(run) -> None:
    table = Table(title="run configuration", show_header=False)
    table.add_column("field")
    table.add_column("value")
    for key, value in run.as_dict().items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    out.print(table)


def print_stages() -> None:
    table = Table(title="stages")
    for column in ("stage", "what it does", "status"):
        table.add_column(column)
    for stage in STAGES:
        status = "built" if stage.built else f"not built yet ({stage.tracking})"
        table.add_row(stage.name, stage.does, status)
    out.print(table)


# -- stages ----------------------------------------------------------------


def prepare(preset: str, out: Path, dtype: str, seed: int, overwrite: bool = False) -> Path:
    """Materialize a preset as an official-format checkpoint, as a safe stage.

    Concurrent runs for the same destination build it once (file lock); a
    rerun with the same inputs is skipped (completion sentinel); an
    interrupted run leaves nothing half-written (temp dir, then rename).
    """
    from core.checkpoint.official_tensors import official_tensor_specs, total_bytes
    from core.checkpoint.tiny import prepare_checkpoint
    from core.config import preset as get_preset
    from converters.staging import run_stage

    config = get_preset(preset)
    inputs = {"preset": preset, "dtype": dtype, "seed": seed}
    result = run_stage(             # a StageConflict (a user error) names its fix
        out,
        lambda tmp: prepare_checkpoint(tmp, config, dtype=dtype, seed=seed, overwrite=True),
        name="prepare",
        input_paths=(),                     # a preset: no input files
        inputs=inputs,
        required_bytes=total_bytes(official_tensor_specs(config, dtype)),
        overwrite=overwrite,
        verbose=False,
    )
    what = "wrote" if result.built else "already prepared:"
    log.print(f"{what} {preset} checkpoint ({dtype}, seed {seed}) at {out}")
    return out


def prepare_hub(repo: str, out: Optional[Path], *, revision: Optional[str], endpoint: Optional[str],
                overwrite: bool = False) -> Path:
    """Download an official-format checkpoint from the Hugging Face Hub into the prepare cache (``out``,
    default ``<DSV4_CACHE>/hf/ORG--NAME--REVISION``), as a safe stage (``launchers.hub``)."""
    from launchers.hub import default_out, prepare_from_hub

    out = out if out is not None else default_out(cache_dir(), repo, revision or "main")
    built = prepare_from_hub(repo, out, revision=revision, endpoint=endpoint, overwrite=overwrite)
    log.print(f"{'downloaded' if built else 'already prepared:'} {repo} (revision {revision or 'main'}) at {out}")
    return out


def prepare_fp8(in_dir: Path, out: Path, overwrite: bool = False) -> Path:
    """MXFP4 routed experts -> FP8 128x128 blocks, losslessly, as a safe stage."""
    from converters.mxfp4_to_fp8 import convert_mxfp4_to_fp8

    return convert_mxfp4_to_fp8(in_dir, out, overwrite=overwrite)


def dequantize(in_dir: Path, out: Path, overwrite: bool = False) -> Path:
    """FP8 / MXFP4 checkpoint -> BF16, one shard at a time, as a safe stage."""
    from converters.fp8_to_bf16 import convert_fp8_to_bf16

    return convert_fp8_to_bf16(in_dir, out, overwrite=overwrite)     # a StageConflict names its fix


def inspect(preset: Optional[str], checkpoint: Optional[Path], as_json: bool, *, layout: Optional[dict] = None) -> None:
    """Parameter counts by component, and the per-GPU memory of training under ``layout`` (``core.memory``:
    ``tp``, ``cp``, ``ep``, ``pp``, ``world``, ``dtype``, ``seq``, ``micro_batch``)."""
    from core.config import preset as get_preset
    from core.memory import estimate_memory
    from kernels.reference.params import count_parameters

    if (preset is None) == (checkpoint is None):
        raise UserInputError("give exactly one of --preset or --checkpoint")
    config = get_preset(preset) if preset else checkpoint_config(Path(checkpoint))
    counts = count_parameters(config)
    memory = estimate_memory(config, **(layout or {}))
    if as_json:
        print(json.dumps({**counts, "memory_per_gpu": memory.as_dict()}, indent=2))
        return
    table = Table(title=f"parameters of {preset or checkpoint}")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    for name, value in counts.items():
        table.add_row(name, f"{value:,}")
    out.print(table)
    print_memory(memory)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def print_memory(m) -> None:
    """The per-GPU memory estimate as a table (formulas: docs/training.md, "Memory per GPU")."""
    master = "fp32 master copy + " if m.dtype != "fp32" else ""
    stage = f", stage {m.stage} of {m.pp} (the largest: {m.layers} decoder layers)" if m.pp > 1 else ""
    table = Table(title=(f"memory per GPU (estimate): tp {m.tp}, cp {m.cp}, ep {m.ep}, pp {m.pp} on {m.world} GPU(s) "
                         f"(data parallel {m.dp}), {m.dtype}, {m.seq} tokens x {m.micro_batch}{stage}"),
                  title_justify="left")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("how")
    table.add_row("weights", _gib(m.weights), f"{m.parameters:,} elements on this GPU; fp32-kept tensors in fp32")
    table.add_row("gradients", _gib(m.gradients), "fp32 main gradients of every trainable weight held")
    table.add_row("optimizer", _gib(m.optimizer),
                  f"{master}Adam m, v ({m.moments}), sharded over {m.dense_shards} (dense) / {m.expert_shards} (experts) GPUs")
    n = m.pp - m.stage
    flight = f"; {n} micro-batch{'es' if n > 1 else ''} in flight (1F1B)" if m.pp > 1 else ""
    table.add_row("activations", _gib(m.activations), "lower bound, full recomputation: block inputs + fp32 logits "
                  f"of {m.tokens_per_rank:,} tokens{flight}")
    table.add_row("total", _gib(m.total), "plus the recomputed block's intermediates, buffers, allocator slack")
    out.print(table)


def _load_tokens(path: Path, vocab_size: int) -> list[list[int]]:
    from core.bounded_io import JSON_LIMIT, load_json

    try:
        data = load_json(path, what="token file", limit=JSON_LIMIT)
    except (OSError, json.JSONDecodeError) as exc:
        raise UserInputError(f"cannot read token file {path}: {exc}") from exc
    if not isinstance(data, list) or not all(
        isinstance(seq, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in seq) for seq in data
    ):
        raise UserInputError(f"token file {path} must hold a JSON list of lists of integer token ids")
    for i, seq in enumerate(data):
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise UserInputError(f"token file {path}: sequence {i} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return data


def build_impl_model(run, checkpoint: Path):
    """The run's implementation, assembled from the run (``core.assembly``: its hardware target, kernel ops
    and dtype), loaded from ``checkpoint``.

    ``checkpoint`` is an HF checkpoint (official names; any weight format) or a native one (recognized by
    its metadata; refused if written under pre-contract names). One process: parallel scoring
    (``dsv4 logprobs --tp/--cp/--ep``) runs several processes through ``launchers.scoring``.
    """
    from core.assembly import assemble
    from engine.loading import load_weights

    parts = assemble(run)
    target = parts.setup_process()
    model = parts.build_model(initialize=False)              # the checkpoint fills every weight (checked)
    load_weights(model, checkpoint, run.model)
    return model.to(target.device()).eval()


def sequence_logprobs(model, qkv_format: str, seq: list[int], device) -> list[float]:
    """log P(token_t | tokens before t), t = 1..n-1, in the layout the run uses."""
    import torch

    ids = torch.tensor(seq, dtype=torch.long, device=device)
    if qkv_format == "thd":
        cu = torch.tensor([0, len(seq)], dtype=torch.int32, device=device)
        return model.logprobs(ids, cu)[:-1].float().tolist()
    return model.logprobs(ids[None])[0].float().tolist()


def score(run, checkpoint: Path, sequences: list[list[int]]) -> list[list[float]]:
    """Per-token log-probabilities of each sequence under the run's implementation."""
    import torch

    check_checkpoint(checkpoint, run.model)
    model = build_impl_model(run, checkpoint)
    log.print(f"scoring {len(sequences)} sequence(s) with --impl {run.impl} ({run.qkv_format}) from {checkpoint}")
    device = next(model.parameters()).device
    with torch.no_grad():
        return [sequence_logprobs(model, run.qkv_format, seq, device) if len(seq) > 1 else [] for seq in sequences]


def logprobs(run, checkpoint: Path, tokens: Path) -> None:
    """Print the per-token log-probabilities of each sequence as JSON (stdout carries nothing else); the
    kernels that ran go to the log."""
    from core.finite import finite_json
    from core.kernel_ops import kernels_ran, reset_kernels_ran

    from core.sequence_limits import check_sequences

    sequences = _load_tokens(tokens, run.model.vocab_size)
    check_sequences([len(s) for s in sequences], run.model, source=f"token file {tokens}",
                    device="cuda" if run.selection.hardware.gpu else "cpu")   # before the model is built
    reset_kernels_ran()
    if run.pp > 1:
        from launchers.scoring import score_pipelined

        check_checkpoint(checkpoint, run.model)  # validate before spawning anything
        log.print(f"scoring {len(sequences)} sequence(s) on {run.pp} pipeline stages, --impl {run.impl} "
                  f"({run.qkv_format}, a row each)")
        result = score_pipelined(checkpoint, sequences, run)
    elif run.qkv_format == "thd" or run.tp * run.cp * run.ep > 1:
        from launchers.scoring import score_packed

        check_checkpoint(checkpoint, run.model)  # validate before spawning anything
        how = (f"each of {run.ep} expert-parallel ranks packing its share into one THD stream" if run.ep > 1
               else "packed into one THD stream")
        log.print(f"scoring {len(sequences)} sequence(s) {how}, --impl {run.impl} --tp {run.tp} --cp {run.cp} "
                  f"--ep {run.ep}")
        result = score_packed(checkpoint, sequences, run)
    else:
        result = score(run, checkpoint, sequences)
    ran = kernels_ran()
    if ran:  # several-process runs count in their workers; this process saw none of those calls
        log.print("kernels ran: " + ", ".join(f"{k} x{v}" for k, v in sorted(ran.items())))
    print(finite_json(result, what="log-probabilities"))


CONVERT_FORMATS = ("native", "torch_dist")


def convert(run, hf_dir: Path, out: Path, overwrite: bool = False, fmt: str = "native") -> Path:
    """HF checkpoint -> native checkpoint (``fmt="native"``) or megatron-core torch_dist checkpoint under
    upstream names (``fmt="torch_dist"``) through the weight contract, as a safe stage (launchers.outputs)."""
    from core.checkpoint import open_checkpoint
    from launchers.outputs import native_bytes, real, staged_output

    if fmt not in CONVERT_FORMATS:
        raise UserInputError(f"unknown --format {fmt!r}; valid choices: {', '.join(CONVERT_FORMATS)}")
    reader = open_checkpoint(hf_dir)
    inputs = {"hf": real(hf_dir), "impl": run.impl}
    if fmt != "native":  # a native output's sentinel keeps its earlier inputs: its reruns stay skipped
        inputs["format"] = fmt
    built = staged_output(out, lambda tmp: convert_into(run, hf_dir, tmp, fmt=fmt), name="convert",
                          inputs=inputs, input_paths=[hf_dir], required_bytes=native_bytes(reader.config),
                          overwrite=overwrite)
    what = ("megatron-core torch_dist checkpoint (upstream names)" if fmt == "torch_dist"
            else f"native checkpoint (written by --impl {run.impl})")
    log.print(f"{'wrote' if built else 'already converted:'} {what} at {out}")
    return out


def convert_into(run, hf_dir: Path, out: Path, fmt: str = "native") -> Path:
    """The conversion itself: write the checkpoint into the (empty) folder ``out``."""
    import shutil

    import torch

    from core.checkpoint import open_checkpoint
    from core.checkpoint.tokenizer import TOKENIZER_FILE
    from core.weight_contract import hf_to_native

    reader = open_checkpoint(hf_dir)
    state = dict(hf_to_native(reader.iter_tensors(dequantize=True, dtype=torch.bfloat16), reader.config))
    if fmt == "torch_dist":
        from converters.torch_dist import save_torch_dist
        from core.assembly import assemble

        assemble(run).setup_process()  # megatron-core's writer needs a process group (one rank here)
        save_torch_dist(out, state, reader.config, overwrite=True)
    else:
        from core.native_checkpoint import save_native

        save_native(out, state, impl=run.impl, config=reader.config, overwrite=True)
    if (Path(hf_dir) / TOKENIZER_FILE).is_file():  # the training data's tokenizer travels with the weights
        shutil.copy2(Path(hf_dir) / TOKENIZER_FILE, Path(out) / TOKENIZER_FILE)
    return out


def train(run, model_dir: Path, *, mode: str, steps: int, run_dir: Path, resume: bool, **overrides) -> dict:
    """SFT or GRPO on the run's implementation, from an HF or native checkpoint."""
    from core.path_safety import refuse_overlap
    from orchestration import run_training

    refuse_overlap(run_dir, [model_dir, overrides.get("data")], out_option="--run-dir")
    result = run_training(
        run,
        model_dir,
        mode=mode,
        steps=steps,
        run_dir=run_dir,
        resume=resume,
        **overrides,
    )
    if int(os.environ.get("RANK", "0")) != 0:     # one line per run, not per torchrun rank
        return result
    last = result.get("last") or {}
    done = "".join(f"  {k} {last[k]:.4g}" for k in ("loss", "reward_mean") if isinstance(last.get(k), float))
    # the final result: shown with -q too
    print(f"run folder: {run_dir}" + (f" (step {last['step']}/{steps}{done})" if last else ""), file=sys.stderr)
    return result


def default_run_dir(run, mode: str) -> Path:
    import time

    return user_path(os.path.join("dsv4-runs", f"{run.impl}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"))


def model_checkpoint(run, cache: Optional[Path] = None) -> Path:
    """The HF checkpoint a job starts from: --model DIR, or the embedded tiny checkpoint."""
    source = model_config(run.model_name)
    if source.checkpoint is not None:
        return source.checkpoint
    if run.model_name != DEFAULT_MODEL:
        raise UserInputError(
            f"--model {run.model_name}: only the embedded tiny model is materialized automatically; "
            f"pass --model CHECKPOINT_DIR for this preset"
        )
    return prepare("tiny", (cache or cache_dir()) / "tiny-bf16-seed0", "bf16", 0)


def full_train(run, *, mode: str, steps: int, run_dir: Path, resume: bool, **overrides) -> dict:
    """prepare -> (prepare-fp8) -> convert -> train; every stage skips finished work.

    prepare, prepare-fp8 and convert are safe stages (temp dir + rename,
    completion sentinel, file lock on the destination), so reruns and
    concurrent runs reuse their results.
    """
    from converters.staging import run_stage

    hf = model_checkpoint(run)
    if run.selection.quant.prepare_stage == "prepare-fp8":  # MXFP4 experts -> FP8 before anything loads them
        fp4 = prepare("tiny", cache_dir() / "tiny-mxfp4-seed0", "mxfp4-experts", 0) if hf.name == "tiny-bf16-seed0" else hf
        hf = prepare_fp8(fp4, fp4.parent / f"{fp4.name}-fp8")
    from core.weight_contract import CONTRACT_VERSION

    # one folder per contract version: a checkpoint converted under older names is never picked up again
    native = hf.parent / f"{hf.name}-native-v{CONTRACT_VERSION}-{run.impl}"
    run_stage(native, lambda tmp: convert_into(run, hf, tmp), name="convert", input_paths=[hf],
              inputs={"hf": str(hf), "impl": run.impl, "contract_version": CONTRACT_VERSION}, verbose=False)
    return train(run, native, mode=mode, steps=steps, run_dir=run_dir, resume=resume, **overrides)


def reward_trend(metrics_path: Path, n: int = 5):
    """(mean reward of the first ``n`` steps, of the last ``n``) of a GRPO run's metrics.jsonl; None
    for a run of fewer than 2n steps."""
    rewards = [json.loads(line)["reward_mean"] for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if len(rewards) < 2 * n:
        return None
    return sum(rewards[:n]) / n, sum(rewards[-n:]) / n


def main_job(run, steps: int = 20) -> None:
    """The default job: full-train GRPO on the embedded tiny model (the built-in task, with its settings
    ``train.data.MAIN_JOB_SETTINGS``), then plots."""
    from launchers.plot import plot_run
    from train.data import MAIN_JOB_SETTINGS

    print_run_config(run)
    run_dir = default_run_dir(run, "grpo")
    settings = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in MAIN_JOB_SETTINGS.items())
    log.print(f"main job: `dsv4 train --steps {steps} {settings}` on the built-in task (docs/training.md)")
    result = full_train(run, mode="grpo", steps=steps, run_dir=run_dir, resume=False, **MAIN_JOB_SETTINGS)
    plots = plot_run(run_dir)
    title = f"GRPO on the embedded tiny model with --impl {run.impl} ({steps} steps)"
    table = Table(title=title, min_width=len(title) + 4)  # the title on one line, whatever the values' widths
    for column in ("metric", "last step"):
        table.add_column(column)
    last = result.get("last") or {}
    for key in ("step", "reward_mean", "loss", "grad_norm", "train_rollout_logprob_abs_diff", "train_rollout_kl", "tokens_per_s"):
        if key in last:
            value = last[key]
            table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
    out.print(table)
    rewards = reward_trend(run_dir / "metrics.jsonl")
    if rewards:
        out.print(f"reward_mean: first 5 steps {rewards[0]:.3f}, last 5 steps {rewards[1]:.3f}")
    print_stages()
    out.print(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {', '.join(str(p) for p in plots)}")
