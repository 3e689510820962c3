"""`dsv4`: the command-line launcher (click).

`bazel run //launchers:dsv4 -- ARGS` and the installed `dsv4` console script
run this same program. Every subcommand shares one option set (implementation,
kernel backend, quantization, hardware, parallel sizes, qkv format), accepted
before or after the subcommand name. Choices are normalized by core.run_config
before any work starts; an invalid combination exits with status 2 and a
message naming the fix. A stage that is not built yet says so and exits 3.

Exit codes: 0 success, 1 runtime failure, 2 invalid choices, 3 stage not built.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from typing import Optional

import click

from core.combinations import ORCHESTRATORS, WEIGHT_TRANSPORTS, InvalidCombination, supported_combinations
from core.config import ConfigError
from core.errors import UserInputError
from core.not_built import NotBuiltError
from core.plugins import PluginError, UnknownBackendError
from core.records import DTYPES, QKV_FORMATS
from core.run_config import Choices, availability_problems, normalize
from launchers import stages
from launchers.builtin_plugins import make_host

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_NOT_BUILT = 3

# option name -> (click declaration kwargs); default None means "not given here".
_RUN_OPTIONS = (
    ("--impl", dict(help="Attention implementation: miles (the plugin path) or megatron (the Megatron-native design); `dsv4 plugins` shows what each supports. Default: miles.")),
    ("--kernel-backend", dict(help="Kernel backend: none (PyTorch reference), triton, tilelang, cuda, cudnn; `dsv4 plugins` shows which run here.")),
    ("--quant", dict(help="Quantization scheme: bf16, fp8, mxfp4-fp8, nvfp4, qat.")),
    ("--hardware", dict(help="Hardware target: cpu, nvidia, rocm. Default: train and full-train detect it (nvidia when torch sees a CUDA device, else cpu) and say so; other commands: cpu.")),
    ("--tp", dict(type=click.IntRange(min=1), help="Tensor-parallel size.")),
    ("--pp", dict(type=click.IntRange(min=1), help="Pipeline-parallel size: dsv4 train / full-train splits the decoder layers into N stages, one per rank "
                                                    "(megatron-core's 1F1B schedule; tensor parallel (miles) within a stage, data and expert parallel over the rest of the ranks, no cp); "
                                                    "dsv4 logprobs scores on N stages (no tp, cp or ep); dsv4 inspect estimates the largest stage's GPU; --vpp (train) interleaves them.")),
    ("--cp", dict(type=click.IntRange(min=1), help="Context-parallel size.")),
    ("--ep", dict(type=click.IntRange(min=1), help="Expert-parallel size.")),
    ("--dtype", dict(type=click.Choice(DTYPES), help="Compute and parameter dtype: fp32 or bf16. Default: bf16 on a GPU --hardware, fp32 on the CPU. A kernel backend that does not compute in it is refused.")),
    ("--rollout-engine", dict(help="Rollout engine plugin (reference, sglang); `dsv4 plugins` lists them. Default: reference.")),
    ("--rollout-url", dict(help="http://HOST:PORT of a running rollout server (--rollout-engine sglang) to connect to instead of starting one; it runs elsewhere, so any --hardware may use it. Under --orchestrator ray a comma-separated list, one server per engine actor. Default: the trainer starts the server (GPU --hardware).")),
    ("--model", dict(help="Model: a preset (tiny, tiny-wide-heads, flash-4layer, flash-shaped, flash, pro) or an HF checkpoint directory. Default: tiny (the embedded model).")),
    ("--max-tokens-per-rank", dict(type=click.IntRange(min=1), help="Packing budget per context-parallel rank (THD dynamic batching).")),
    ("--qkv-format", dict(type=click.Choice(QKV_FORMATS), help="Activation layout; defaults to the implementation's first format (miles: bshd, megatron: thd).")),
    ("--strict-plugins", dict(is_flag=True, default=None, help="Fail when a third-party plugin cannot be loaded (default: warn and skip it).")),
    ("--no-third-party-plugins", dict(is_flag=True, default=None, help="Load built-in plugins only.")),
)
_DEFAULTS = Choices()
RUN_KEYS = frozenset(decl.lstrip("-").replace("-", "_") for decl, _ in _RUN_OPTIONS)
# the run choices that only `train` / `full-train` take (how their ranks and engines are placed)
TRAIN_RUN_KEYS = frozenset({"vpp", "orchestrator", "rollout_num_gpus", "rollout_num_nodes", "weight_transport"})
_OUTPUT = {"quiet": False, "verbose": False}


_DEBUG_HELP = "Show the full traceback of a failure (default: one line `error: ...`)."


def output_options(func):
    """--debug / -q / -v, accepted before or after the subcommand name."""
    func = click.option("--debug", is_flag=True, help=_DEBUG_HELP)(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Also show debug lines (every metric of every step) and the known library warnings that are hidden by default.")(func)
    return click.option("-q", "--quiet", is_flag=True, help="Print only errors and the final result.")(func)


def _configure_output(quiet: bool, verbose: bool) -> None:
    """What reaches stderr (launchers.console)."""
    from launchers.console import configure

    if quiet and verbose:
        _fail("-q/--quiet and -v/--verbose both given. Fix: give at most one of them", EXIT_INVALID)
    _OUTPUT.update(quiet=quiet, verbose=verbose)
    configure(quiet=quiet, verbose=verbose)
    stages.log.quiet = quiet


def run_options(func):
    """Attach the shared option set to a command (group or subcommand)."""
    for decl, kwargs in reversed(_RUN_OPTIONS):
        kwargs = dict(kwargs)
        kwargs.setdefault("default", None)
        func = click.option(decl, **kwargs)(func)
    return func


def _merged(ctx: click.Context, local: dict) -> dict:
    """Options given after the subcommand win over those given before it."""
    merged = dict(ctx.obj or {}) if ctx.obj else {}
    merged.update({k: v for k, v in local.items() if v is not None})
    return merged


def _host(opts: dict):
    return make_host(
        strict=opts.get("strict_plugins") or None,
        third_party=False if opts.get("no_third_party_plugins") else None,
    )


def _choices(opts: dict, model=None, job=None, world=None) -> Choices:
    return Choices(
        impl=opts.get("impl") or _DEFAULTS.impl,
        kernel_backend=opts.get("kernel_backend") or _DEFAULTS.kernel_backend,
        quant=opts.get("quant") or _DEFAULTS.quant,
        hardware=opts.get("hardware") or _DEFAULTS.hardware,
        tp=opts.get("tp") or 1,
        pp=opts.get("pp") or 1,
        vpp=opts.get("vpp") or 1,
        cp=opts.get("cp") or 1,
        ep=opts.get("ep") or 1,
        qkv_format=opts.get("qkv_format"),
        model=model,
        max_tokens_per_rank=opts.get("max_tokens_per_rank"),
        rollout_engine=opts.get("rollout_engine") or _DEFAULTS.rollout_engine,
        rollout_url=opts.get("rollout_url"),
        dtype=opts.get("dtype"),
        job=job,
        world=world,
        orchestrator=opts.get("orchestrator") or _DEFAULTS.orchestrator,
        rollout_num_gpus=opts.get("rollout_num_gpus"),
        rollout_num_nodes=opts.get("rollout_num_nodes"),
        weight_transport=opts.get("weight_transport"),
    )


def _fail(message: str, code: int):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def resolve(opts: dict, *, probe: bool = True, job=None, world=None):
    """Plugin host + validated RunConfig, or exit with the reason. ``job`` ("score", "train") also checks
    that job's own limits in the combination table; ``world``: the run's number of ranks (None = tp x cp x ep)."""
    try:
        model_name = opts.get("model") or stages.DEFAULT_MODEL
        model = stages.model_config(model_name).config
        host = _host(opts)
        run = normalize(_choices(opts, model, job, world), host, model_name=model_name)
    except (InvalidCombination, UnknownBackendError, ValueError) as exc:
        _fail(str(exc), EXIT_INVALID)
    except PluginError as exc:
        _fail(str(exc), EXIT_INVALID)
    if probe:
        problems = availability_problems(run)
        if problems:
            _fail("\n".join(problems), EXIT_INVALID)
    return host, run


def _guarded(func, *args, **kwargs):
    """Run a command; an expected failure is one line ``error: ...`` (launchers.errors), unless --debug."""
    from launchers.errors import debug_enabled, one_line

    try:
        return func(*args, **kwargs)
    except (SystemExit, KeyboardInterrupt, click.exceptions.Exit, click.ClickException, click.Abort):
        raise
    except NotBuiltError as exc:
        if debug_enabled():
            raise
        _fail(str(exc), EXIT_NOT_BUILT)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if debug_enabled() or isinstance(exc, (GeneratorExit,)):
            raise
        _fail(one_line(exc, expected=(UserInputError, ConfigError)), EXIT_FAILED)


def subcommand(name: str, **kwargs):
    """A subcommand with the shared options whose NotBuiltError becomes exit 3."""

    def wrap(func):
        @main.command(name, **kwargs)
        @run_options
        @output_options
        @click.pass_context
        @functools.wraps(func)
        def command(ctx, quiet=False, verbose=False, debug=False, **params):
            if debug:
                from launchers.errors import set_debug

                set_debug(True)
            if quiet or verbose:
                _configure_output(quiet or _OUTPUT["quiet"], verbose or _OUTPUT["verbose"])
            opts = _merged(ctx, {k: params.pop(k) for k in list(params) if k in RUN_KEYS})
            return _guarded(func, opts, **params)

        return command

    return wrap


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@run_options
@output_options
@click.pass_context
def main(ctx: click.Context, debug: bool = False, quiet: bool = False, verbose: bool = False, **opts):
    """Train DeepSeek-V4 (V4-Flash, V4-Pro, tiny test models) for RL and SFT.

    With no subcommand, runs the main job on the embedded tiny model on the CPU.
    Every choice is explicit; invalid combinations fail before any work starts.
    """
    from launchers.errors import set_debug

    set_debug(debug)
    _configure_output(quiet, verbose)
    ctx.obj = {k: v for k, v in opts.items() if v is not None}
    if ctx.invoked_subcommand is None:
        _host_obj, run = resolve(ctx.obj, job="train")
        _guarded(stages.main_job, run)


@subcommand("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--probe/--no-probe", default=True, help="Check whether each backend can run on this machine.")
def plugins_cmd(opts, as_json: bool, probe: bool):
    """List every backend of every axis, with the distribution that provides it."""
    try:
        host = _host(opts)
    except PluginError as exc:
        _fail(str(exc), EXIT_INVALID)
    data = host.describe(probe=probe)
    if as_json:
        data["skipped_third_party_plugins"] = [{"module": s.module, "distribution": s.distribution, "error": e} for s, e in host.skipped]
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    stages.print_plugins(data)


@subcommand("validate")
@click.option("--json", "as_json", is_flag=True, help="Print the configuration as JSON.")
@click.option("--probe/--no-probe", default=True, help="Also check that the chosen backends can run on this machine.")
def validate_cmd(opts, as_json: bool, probe: bool):
    """Resolve the choices and print the run configuration, or fail with the reason."""
    _host_obj, run = resolve(opts, probe=probe)
    if as_json:
        click.echo(json.dumps(run.as_dict(), indent=2, sort_keys=True))
    else:
        stages.print_run_config(run)


@subcommand("combinations")
@click.option("--json", "as_json", is_flag=True, help="Print the supported combinations as JSON.")
@click.option("--write-bzl", type=click.Path(dir_okay=False), help="Write the Bazel test-matrix file (tests/combinations.bzl).")
@click.option("--write-readme", type=click.Path(dir_okay=False, exists=True), help="Rewrite the combinations table in this README.")
def combinations_cmd(opts, as_json: bool, write_bzl: Optional[str], write_readme: Optional[str]):
    """Print the table of supported combinations (derived from the plugins)."""
    from core.atomic import write_text_atomically
    from launchers import generated

    host = _host({**opts, "no_third_party_plugins": True})
    combos = supported_combinations(host)
    if write_bzl:
        write_text_atomically(stages.user_path(write_bzl), generated.combinations_bzl(combos))
    if write_readme:
        path = stages.user_path(write_readme)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        write_text_atomically(path, generated.replace_readme_tables(text, combos, host))
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in combos], indent=2))
    elif not (write_bzl or write_readme):
        click.echo(generated.combinations_markdown(combos) + generated.not_runnable_markdown(host))


@subcommand("prepare")
@click.option("--preset", default=None, help="Model preset to materialize (default: tiny).")
@click.option("--out", default=None, type=click.Path(file_okay=False), help="Checkpoint directory to write (with --hf-repo, default: DSV4_CACHE/hf/ORG--NAME--REVISION).")
@click.option("--weight-format", "weight_format", type=click.Choice(["bf16", "fp8", "mxfp4-experts"]), default=None, help="Weight format of the checkpoint (default: bf16).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None, help="Seed of the deterministic weights (default: 0).")
@click.option("--hf-repo", default=None, help="Download this Hugging Face Hub repository (ORG/NAME, e.g. deepseek-ai/DeepSeek-V4-Flash) instead of writing a preset.")
@click.option("--hf-revision", default=None, help="Branch, tag or commit of --hf-repo (default: main).")
@click.option("--hf-endpoint", default=None, help="Hub endpoint (a mirror); default: HF_ENDPOINT, else huggingface.co.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint made with other inputs.")
def prepare_cmd(opts, preset: Optional[str], out: Optional[str], weight_format: Optional[str], seed: Optional[int],
                hf_repo: Optional[str], hf_revision: Optional[str], hf_endpoint: Optional[str], overwrite: bool):
    """Write a deterministic official-format HF checkpoint for a preset, or download one (--hf-repo).

    A download goes through huggingface_hub (HF_TOKEN or `hf auth login` for
    gated repositories) and is verified as an official-format checkpoint.
    Safe to run concurrently and to interrupt; a rerun with the same inputs is
    skipped, and a rerun after a failed download fetches only what is missing.
    """
    if hf_repo:
        given = [o for o, v in (("--preset", preset), ("--weight-format", weight_format), ("--seed", seed)) if v is not None]
        if given:
            _fail(f"--hf-repo downloads a checkpoint as published: {', '.join(given)} do not apply. "
                  f"Fix: drop {', '.join(given)}", EXIT_INVALID)
        stages.prepare_hub(hf_repo, stages.user_path(out) if out else None, revision=hf_revision,
                           endpoint=hf_endpoint, overwrite=overwrite)
        return
    given = [o for o, v in (("--hf-revision", hf_revision), ("--hf-endpoint", hf_endpoint)) if v is not None]
    if given:
        _fail(f"{', '.join(given)} only apply with --hf-repo. Fix: add --hf-repo ORG/NAME, or drop "
              f"{', '.join(given)}", EXIT_INVALID)
    if not out:
        _fail("prepare --preset needs an output folder. Fix: add --out DIR", EXIT_INVALID)
    stages.prepare(preset=preset or "tiny", out=stages.user_path(out), dtype=weight_format or "bf16",
                   seed=0 if seed is None else seed, overwrite=overwrite)


@subcommand("inspect")
@click.option("--preset", default=None, help="Model preset (flash, pro, flash-4layer, flash-shaped, tiny).")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None, help="HF, native or torch_dist checkpoint directory.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None, help="GPUs per node of the layout (default: the fewest the --tp/--cp/--ep layout needs).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes of the layout.")
@click.option("--seq", type=click.IntRange(min=1), default=4096, show_default=True, help="Sequence length of the activation estimate.")
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences per micro-batch of the activation estimate.")
@click.option("--adam-moments-dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True, help="Adam's moments in the optimizer estimate (the training option adam_moments_dtype).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def inspect_cmd(opts, preset: Optional[str], checkpoint: Optional[str], nproc_per_node: Optional[int], nnodes: int,
                seq: int, micro_batch_size: int, adam_moments_dtype: str, as_json: bool):
    """Print the parameter count of a model by component, and the memory per GPU of training it.

    The estimate is for the layout of --tp, --cp, --ep and --pp on
    --nproc-per-node x --nnodes GPUs, in --dtype (default bf16), with
    Megatron's DistributedOptimizer: weights, fp32 gradients, optimizer state
    sharded over the data-parallel ranks, and a lower bound of the activations
    (docs/training.md, "Memory per GPU"). With --pp N it is the GPU of the
    largest stage: its layers, and the activations of the micro-batches
    1F1B keeps in flight there.
    """
    world = None if nproc_per_node is None else nproc_per_node * nnodes
    layout = dict(tp=opts.get("tp") or 1, cp=opts.get("cp") or 1, ep=opts.get("ep") or 1, pp=opts.get("pp") or 1,
                  world=world, dtype=opts.get("dtype") or "bf16", seq=seq, micro_batch=micro_batch_size,
                  moments=adam_moments_dtype)
    stages.inspect(preset=preset, checkpoint=stages.user_path(checkpoint) if checkpoint else None, as_json=as_json,
                   layout=layout)


@subcommand("logprobs")
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False), help="HF, native or megatron-core torch_dist checkpoint directory.")
@click.option("--tokens", required=True, type=click.Path(dir_okay=False), help="JSON file: a list of token-id lists.")
def logprobs_cmd(opts, checkpoint: str, tokens: str):
    """Score token sequences with the chosen implementation, kernels and --dtype.

    stdout carries only JSON: for each sequence, the list of
    log P(token_t | tokens before t) for t = 1..n-1. Logs go to stderr.
    With --qkv-format thd all sequences are packed into one stream; --cp N
    and --tp N run N local processes (gloo on the CPU) over it; --ep N runs N
    processes that each hold 1/N of the routed experts and score every N-th
    sequence; --pp N runs N processes, each one pipeline stage of the decoder
    layers, every sequence a row of its own (megatron: one THD segment each). The output format is the
    same either way, so runs are directly comparable.

    Indexer-score ties at the k-th place are broken by the lowest entry index
    (torch.topk may pick other tied entries: docs/interop.md, "Ties of indexer scores").
    """
    opts = {**opts, "model": opts.get("model") or checkpoint}
    run = resolve(opts, job="score")[1]
    stages.logprobs(run, checkpoint=stages.user_path(checkpoint), tokens=stages.user_path(tokens))


@subcommand("convert")
@click.option("--hf", "hf_dir", required=True, type=click.Path(file_okay=False), help="HF checkpoint directory.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to write.")
@click.option("--format", "fmt", type=click.Choice(stages.CONVERT_FORMATS), default="native", show_default=True,
              help="native: dsv4's DCP checkpoint; torch_dist: megatron-core dist_checkpointing under upstream Megatron names.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint that dsv4 wrote.")
def convert_cmd(opts, hf_dir, out, fmt, overwrite):
    """Convert an HF checkpoint into a native or a megatron-core torch_dist checkpoint.

    Names follow the one weight contract, so the result loads into either
    implementation. A native checkpoint's metadata records the contract
    version and the writer; a torch_dist one is written by megatron-core's own
    dist_checkpointing.save under upstream Megatron's sharded keys, with the
    HF config.json beside it. `--checkpoint` / `--model` accept all three.
    """
    run = resolve({**opts, "model": opts.get("model") or hf_dir})[1]
    stages.convert(run, stages.user_path(hf_dir), stages.user_path(out), overwrite=overwrite, fmt=fmt)


@subcommand("prepare-fp8")
@click.option("--in", "in_dir", required=True, type=click.Path(file_okay=False), help="Checkpoint with MXFP4 routed experts.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the FP8 checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output made from other inputs.")
def prepare_fp8_cmd(opts, in_dir, out, overwrite):
    """Convert MXFP4 routed experts losslessly to FP8 128x128 blocks.

    Every other tensor is copied byte for byte. A tile whose FP4 scales span
    too much for an exact FP8 conversion is an error naming the tensor and tile.
    Safe to run concurrently and to interrupt; a rerun is skipped.
    """
    stages.prepare_fp8(stages.user_path(in_dir), stages.user_path(out), overwrite=overwrite)


@subcommand("dequantize")
@click.option("--in", "in_dir", required=True, type=click.Path(file_okay=False), help="FP8 (or MXFP4-experts) checkpoint.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the BF16 checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output made from other inputs.")
def dequantize_cmd(opts, in_dir, out, overwrite):
    """Dequantize an FP8 checkpoint (128x128 blocks, e8m0 or fp32 scales) to BF16.

    MXFP4 routed experts are dequantized too; scale tensors are dropped,
    every other tensor is copied unchanged and the quantization entries leave
    config.json. Streams one shard at a time. Safe to run concurrently and to
    interrupt; a rerun is skipped.
    """
    stages.dequantize(stages.user_path(in_dir), stages.user_path(out), overwrite=overwrite)


def _tracker_list(ctx, param, value):
    """``--tracker a,b --tracker c`` -> ``("a", "b", "c")``; not given -> None (the setting's default)."""
    names = tuple(n.strip() for v in value for n in v.split(",") if n.strip())
    return names or None


def training_options(func):
    """Options shared by `train` and `full-train`; every other setting is a KEY=VALUE argument or a key of
    --config (launchers.config_file)."""
    for decl, kwargs in reversed((
        ("--mode", dict(type=click.Choice(["sft", "grpo"]), default="grpo", show_default=True, help="SFT on responses, or GRPO with a verifiable reward.")),
        ("--steps", dict(type=click.IntRange(min=1, max=10 ** 9), default=8, show_default=True, help="Total optimizer steps (a resumed run counts the steps already done).")),
        ("--run-dir", dict(type=click.Path(file_okay=False), default=None, help="Run folder (metrics.jsonl, train.log, TensorBoard events, checkpoints, plots). Default: dsv4-runs/IMPL-MODE-TIME.")),
        ("--resume", dict(is_flag=True, help="Continue the run in --run-dir from its last complete step.")),
        ("--data", dict(type=click.Path(dir_okay=False), default=None, help="JSONL data (prompt + response, or prompt + reward spec). Default: the built-in task.")),
        ("--lr", dict(type=float, default=None, help="Learning rate.")),
        ("--seed", dict(type=int, default=None, help="Seed of data order and sampling.")),
        ("--save-every", dict(type=click.IntRange(min=1), default=None, help="Checkpoint every N steps.")),
        ("--tracker", dict(multiple=True, callback=_tracker_list, metavar="NAME[,NAME]", help="Where each step's scalars and the run's configuration go besides metrics.jsonl: tensorboard, wandb, mlflow or none; a comma list or repeated (default: tensorboard). Settings: the libraries' environment variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME).")),
        ("--compile", dict(is_flag=True, help="torch.compile the implementation's blocks (fused kernels; each new batch shape or packing layout compiles again).")),
        ("--cuda-graphs", dict(is_flag=True, help="With --compile on a GPU: replay the compiled blocks as CUDA graphs (Inductor's reduce-overhead mode; SFT, rows padded to pad_to_length=N, tp/cp/ep 1, no packing budget).")),
        ("--vpp", dict(type=click.IntRange(min=1), default=None, help="Virtual pipeline stages per pipeline rank, with --pp: each rank holds N chunks of the decoder layers, run by megatron-core's interleaved 1F1B schedule (the layers must divide into --pp x N chunks; each step needs at least --pp micro-batches). Default: 1.")),
        ("--nproc-per-node", dict(type=click.IntRange(min=1), default=None, help="Ranks to start on this machine (torch.distributed's elastic launcher; one GPU each on a GPU --hardware). Default: tp x cp x ep. Under torchrun / srun the launcher's WORLD_SIZE is used instead.")),
        ("--orchestrator", dict(type=click.Choice(ORCHESTRATORS), default=None, help="Who starts the ranks and rollout engines: local (this machine's processes) or ray (actors on a Ray cluster: docs/ray.md). Default: local.")),
        ("--ray-address", dict(default=None, help="--orchestrator ray: the Ray cluster to connect to (HOST:PORT of its head, or `auto`). Default: RAY_ADDRESS, else a local cluster started for the run.")),
        ("--trainer-num-gpus", dict(type=click.IntRange(min=1), default=None, help="--orchestrator ray: the trainer's ranks across the cluster, one GPU each (on the CPU, one CPU bundle each). Default: tp x cp x ep.")),
        ("--rollout-num-gpus", dict(type=click.IntRange(min=1), default=None, help="--orchestrator ray: disaggregated rollout, the engines on this many devices of their own (one per data-parallel rank; on the CPU, CPU bundles). Default: colocated with the trainer's ranks.")),
        ("--rollout-num-nodes", dict(type=click.IntRange(min=1), default=None, help="--orchestrator ray, with --rollout-num-gpus N: spread the engines over this many nodes, N / this many on each (it must divide N). Default: wherever they fit.")),
        ("--weight-transport", dict(type=click.Choice(WEIGHT_TRANSPORTS), default=None, help="--orchestrator ray: how each step's weights reach the engine actors: objects (Ray's object store), gloo (a torch.distributed broadcast over host memory; --hardware cpu), nccl (the same over NCCL; GPU, disaggregated) or cuda-ipc (IPC handles to the trainer's GPU memory; GPU, colocated). Default: objects.")),
        ("--ray-max-restarts", dict(type=click.IntRange(min=0), default=None, help="--orchestrator ray: how often a dead engine actor is restarted, and the trainer group restarted from its last checkpoint. Default: 2.")),
        ("--config", dict(type=click.Path(dir_okay=False), default=None, help="TOML or JSON file of settings: any option above or below (without the dashes) and every training knob; a run folder's train_config.json repeats that run. Options given on the command line win over the file, KEY=VALUE arguments over both.")),
        ("--print-config", dict(is_flag=True, help="Print every setting this command resolved, as a TOML file --config reads, and exit without training.")),
    )):
        func = click.option(decl, **kwargs)(func)
    return click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")(func)


_JOB_KEYS = ("mode", "steps", "run_dir", "resume", "nproc_per_node", "trainer_num_gpus", "ray_address",
             "ray_max_restarts")
_RAY_JOB_KEYS = ("trainer_num_gpus", "ray_address", "ray_max_restarts")


@dataclass(frozen=True)
class _Training:
    """What `train` / `full-train` resolved from the defaults, --config, the command line and KEY=VALUE."""

    opts: dict        # the run's choices, for resolve()
    mode: str
    steps: int
    run_dir: Optional[str]
    resume: bool
    fields: dict      # TrainConfig fields given anywhere
    print_config: bool
    nproc_per_node: Optional[int] = None
    trainer_num_gpus: Optional[int] = None
    ray_address: Optional[str] = None
    ray_max_restarts: Optional[int] = None


def _training(opts: dict, kw: dict) -> _Training:
    from click.core import ParameterSource

    from launchers import config_file
    from launchers.console import detect_hardware

    ctx = click.get_current_context()
    config, print_config, overrides = kw.pop("config"), kw.pop("print_config"), kw.pop("overrides")
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    cli = {**opts, **{k: v for k, v in kw.items() if ctx.get_parameter_source(k) in given}}
    try:
        values = config_file.resolve(ctx.command, config=stages.user_path(config) if config else None, cli=cli,
                                     overrides=overrides)
    except config_file.ConfigFileError as exc:
        _fail(str(exc), EXIT_INVALID)
    run_opts = {k: v for k, v in values.items() if (k in RUN_KEYS or k in TRAIN_RUN_KEYS) and v is not None}
    if "hardware" not in run_opts:
        run_opts["hardware"] = detect_hardware()
    knobs = {f.name for f in dataclasses.fields(config_file.train_config_type())}
    fields = {k: v for k, v in values.items() if k in knobs}
    if run_opts.get("max_tokens_per_rank") is not None:   # the run's packing budget is the trainer's too
        fields["max_tokens_per_rank"] = int(run_opts["max_tokens_per_rank"])
    if fields.get("data"):
        fields["data"] = str(stages.user_path(fields["data"]))
    job = {k: values.get(k, kw[k]) for k in _JOB_KEYS}
    if job["resume"] and not job["run_dir"]:
        _fail("--resume needs the run to continue. Fix: add --run-dir RUN_DIR", EXIT_INVALID)
    _check_orchestration(run_opts.get("orchestrator"), job)
    return _Training(run_opts, job["mode"], job["steps"], job["run_dir"], job["resume"], fields, print_config,
                     job["nproc_per_node"], job["trainer_num_gpus"], job["ray_address"], job["ray_max_restarts"])


def _check_orchestration(orchestrator, job: dict) -> None:
    """The Ray options need --orchestrator ray, which starts every rank itself (as an actor)."""
    from orchestration.launch import launched_env

    if orchestrator != "ray":
        given = [f"--{k.replace('_', '-')}" for k in _RAY_JOB_KEYS if job[k] is not None]
        if given:
            _fail(f"{' and '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --orchestrator ray. Fix: "
                  f"add --orchestrator ray, or drop {' and '.join(given)}", EXIT_INVALID)
        return
    if job["nproc_per_node"] is not None:
        _fail("--orchestrator ray places the trainer's ranks on the cluster's GPUs: --nproc-per-node does not apply. "
              "Fix: use --trainer-num-gpus N", EXIT_INVALID)
    if launched_env() is not None:
        _fail("--orchestrator ray starts every rank as a Ray actor, and this process is already one rank of "
              "torchrun / srun. Fix: run `dsv4 train --orchestrator ray` once, without torchrun / srun", EXIT_INVALID)


def _train_config(t: _Training):
    """The TrainConfig of the settings; an out-of-range knob is one line before any work starts."""
    from launchers import config_file

    return config_file.train_config_type()(**t.fields)


def _print_config(run, t: _Training) -> None:
    """The resolved settings as TOML on stdout (`--print-config`)."""
    from launchers import config_file

    cfg = _train_config(t)
    # the rank count is the launcher's or --nproc-per-node's (below), not a choice of its own
    choices = {k: v for k, v in run.as_dict().items() if k not in ("providers", "job", "model_name", "world")}
    choices["model"] = run.model_name
    choices.update({k: v for k, v in t.opts.items() if k in ("strict_plugins", "no_third_party_plugins")})
    job = {"mode": t.mode, "steps": t.steps, "resume": t.resume}
    for key in ("nproc_per_node", *_RAY_JOB_KEYS):
        if getattr(t, key) is not None:
            job[key] = getattr(t, key)
    if t.run_dir:
        job["run_dir"] = str(stages.user_path(t.run_dir))
    # a field that is also a run choice (max_tokens_per_rank) stands once, under [run]
    train = {**job, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in choices}}
    click.echo(config_file.to_toml({"run": choices, "train": train}, header=(
        "dsv4 train --config FILE: every setting, as this command resolved it.",
        "Precedence: defaults < this file < options on the command line < KEY=VALUE arguments.",
        '"none" stands for an unset optional value.')), nl=False)


def _train_kwargs(run, t: _Training) -> dict:
    placement = {}
    if run.orchestrator == "ray":
        placement = dict(ray_address=t.ray_address, ray_max_restarts=t.ray_max_restarts)
    return dict(mode=t.mode, steps=t.steps,
                run_dir=stages.user_path(t.run_dir) if t.run_dir else stages.default_run_dir(run, t.mode),
                resume=t.resume, progress=not _OUTPUT["quiet"], **placement, **t.fields)


def _train_world(nproc_per_node) -> int | None:
    """The run's number of ranks: the launcher's ``WORLD_SIZE`` under torchrun / srun, else
    ``--nproc-per-node`` (None: the layout's default, tp x cp x ep)."""
    import os

    from orchestration.launch import env_world_size

    world = env_world_size()
    if world is None:
        return nproc_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nproc_per_node is not None and nproc_per_node != local:
        _fail(f"--nproc-per-node {nproc_per_node} differs from the launcher's {local} ranks on this node. "
              f"Fix: leave --nproc-per-node out under torchrun / srun", EXIT_INVALID)
    return world


def _check_launched_run_dir(run_dir) -> None:
    """Ranks started by torchrun / srun each compute their defaults: the run folder must be named."""
    from orchestration.launch import env_world_size

    if (env_world_size() or 1) > 1 and not run_dir:
        _fail("a run started by torchrun / srun needs one run folder for every rank. Fix: add --run-dir DIR",
              EXIT_INVALID)


def _prepared_training(opts: dict, kw: dict):
    """`train` / `full-train` settings resolved and checked: ``(run, settings)``, or None after
    ``--print-config`` printed them."""
    t = _training(opts, kw)
    world = t.trainer_num_gpus if t.opts.get("orchestrator") == "ray" else _train_world(t.nproc_per_node)
    if t.nproc_per_node is not None and t.opts.get("orchestrator") != "ray":
        from orchestration.dist_env import DistEnvError, check_local_ranks

        try:
            check_local_ranks(t.nproc_per_node, gpu=t.opts.get("hardware") not in (None, "cpu"))
        except DistEnvError as exc:
            _fail(str(exc), EXIT_INVALID)
    host, run = resolve(t.opts, job="train", world=world)
    if t.print_config:
        _print_config(run, t)
        return None
    from core.combinations import InvalidCombination
    from core.config import ConfigError
    from train.config_checks import check_mode, check_train_options
    from reporting.trackers import check_available

    cfg = _train_config(t)
    try:                                           # before any stage runs
        check_mode(t.mode, cfg)
        check_train_options(run, cfg, host)
    except (ConfigError, InvalidCombination) as exc:
        _fail(str(exc), EXIT_INVALID)
    check_available(cfg.tracker)
    _check_launched_run_dir(t.run_dir)
    return run, t


@subcommand("train")
@training_options
def train_cmd(opts, **kw):
    """Train (SFT or GRPO) the chosen implementation from --model (an HF or native checkpoint).

    Every step publishes the trained weights to the rollout engine through the
    real export path (quantized per --quant), checks them, generates, and
    trains on the implementation's own log-probabilities. Every training knob
    is a KEY=VALUE argument (e.g. `lr=1e-3 group_size=8`) or a key of --config;
    --print-config lists them.
    """
    prepared = _prepared_training(opts, kw)
    if prepared is not None:
        run, t = prepared
        stages.train(run, stages.model_checkpoint(run), **_train_kwargs(run, t))


@subcommand("full-train")
@training_options
def full_train_cmd(opts, **kw):
    """Run prepare -> (prepare-fp8) -> convert -> train, skipping completed stages.

    Takes the settings of `train` (--config, KEY=VALUE, --print-config).
    """
    prepared = _prepared_training(opts, kw)
    if prepared is not None:
        run, t = prepared
        stages.full_train(run, **_train_kwargs(run, t))


@subcommand("export")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="Run folder.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="HF checkpoint directory to write.")
@click.option("--step", type=int, default=None, help="Checkpoint step (default: the last complete one).")
@click.option("--weight-format", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True, help="Weight format of the written checkpoint: bf16, or fp8 (128x128 blocks, as the official checkpoints).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export (only a folder dsv4 wrote).")
def export_cmd(opts, run_dir, out, step, weight_format, overwrite):
    """Write a run's checkpoint as an official-format HF checkpoint."""
    from launchers.outputs import export_run

    path = stages.user_path(out)
    built = export_run(stages.user_path(run_dir), path, step=step, weight_format=weight_format, overwrite=overwrite)
    stages.log.print(f"{'wrote' if built else 'already exported:'} {path}")


@subcommand("plot")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--smoothing", type=click.FloatRange(0, 1, max_open=True), default=0.6, show_default=True, help="Weight of the past in the exponential moving average drawn over each raw curve (TensorBoard's smoothing; 0: raw curves only).")
def plot_cmd(opts, run_dir, smoothing):
    """Write PNG curves of a run, axes labelled with units: reward, loss, grad norm, learning rate,
    log-prob diff, KL, groups with all-equal rewards, tokens/s, time per phase, and a summary."""
    from launchers.plot import plot_run

    for path in plot_run(stages.user_path(run_dir), smoothing=smoothing):
        click.echo(str(path))


if __name__ == "__main__":
    main(prog_name="dsv4")
