"""The SFT / GRPO training loop of one rank (``dsv4 train``): the run's setup, its steps, checkpoints and export.

:class:`_Run` sets a rank's run up (the models, the optimizer, where the run starts: :func:`train.run_folder.open_run`,
the rollout engine) and runs the loop; the steps are :func:`train.sft.sft_step` and :func:`train.grpo.grpo_step`,
whose phases (sync, rollout, reward, log-probs, train) are functions of :mod:`train.grpo`. The ranks themselves are
started by :mod:`orchestration.training`, which calls :func:`train_rank` in every rank.

The rollout engine is the run's (``--rollout-engine``: the assembly's ``rollout_engine``), made once the run folder is
checked and shut down however the run ends; a server engine (SGLang) is started on the run's starting weights
(written to ``RUN_DIR/<engine>_init``) or connected to at ``--rollout-url``.

Both modes add the training model's own loss term when it has one (``TrainForward.aux_loss``: megatron's indexer
KL loss with ``dsa_indexer_loss_coeff``; metric ``indexer_loss``). The training model is the run's implementation
(``train_impl`` None; see :func:`train.model.build_train_model`). Metrics go to ``RUN_DIR/metrics.jsonl`` and
TensorBoard, the printed lines (resolved configuration, one line per step) also to ``RUN_DIR/train.log``
(:mod:`reporting.run_log`); checkpoints every ``save_every`` steps and at the end (:mod:`train.checkpointing`);
``resume=True`` continues after the last complete checkpoint. With ``export_at_end`` the final weights are written
as an HF checkpoint to ``RUN_DIR/hf``.

Ranks (``run_config.world > 1``; :mod:`train.distributed` holds the trainer's view of the layout): each
data-parallel rank trains on its share of the step's samples, its leader's rollout engine generating them; losses
are divided by the step's global token count and gradients summed (:mod:`train.optim`: megatron-core's distributed
optimizer on GPUs), so every layout takes the one-rank step. Context-parallel ranks run their slice of each packed
(THD) micro-batch. Global rank 0 does the file I/O (config, metrics, export) but checkpoints, which every rank
writes its own share of (:mod:`train.checkpointing`). Dynamic batching (``max_tokens_per_rank``, THD): SFT
sequences / GRPO samples are packed in order into micro-batches with :func:`core.packing.pack_micro_batches`
(never split; the run's CP size and the model's pad rule), gradients accumulated; metrics ``packing_efficiency``
(real / padded tokens) and ``micro_batches``. With cp=1 and no budget the loop is unchanged (rows packed by
``pack_rows``).

Test hook: ``DSV4_TRAIN_KILL_AT="STEP:PHASE"`` (:mod:`train.step_common`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

import torch

from core.assembly import assemble
from core.memory import check_run_fits_gpu
from core.sequence_limits import check_sequences
from rollout.async_rollout import RolloutPipeline
from rollout.shared_weights import choose_weight_sync
from reporting import kernel_compiles, profiling
from rollout.sglang_engine import DEFAULT_SETTINGS as SGLANG_DEFAULTS

from . import data as D
from . import step_guard
from .checkpointing import latest_checkpoint, save_checkpoint
from .config_checks import check_static_shapes, check_true_on_policy
from .distributed import ParallelGroups, check_divisible
from .export import export_model
from .grpo import grpo_step
from .model import build_train_model, full_view, load_model_source
from .optim import build_optimizer
from reporting.metrics import MetricsLogger
from .run_folder import open_run, resumes
from .sft import sft_step
from .step_common import maybe_kill

MODES = ("sft", "grpo")


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a run (saved to ``RUN_DIR/train_config.json``; resume checks it)."""

    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    # data
    data: Optional[str] = None              # JSONL path; None = the built-in task
    batch_size: int = 8                      # SFT: sequences per step
    prompts_per_step: int = 2                # GRPO: prompts per step
    group_size: int = 4                      # GRPO: samples per prompt
    # rollout (the engine, its dtype and the published weight format are the run's choices:
    # --rollout-engine, --dtype, --quant)
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                           # 0 = off
    check_weights: bool = True
    max_bucket_bytes: int = 64 << 20
    # how the trained weights reach the rollout engine each GRPO step (rollout.shared_weights): "auto" shares
    # the trainer's memory with the built-in engine where it can (same process and device, whole weights on
    # the rank, bf16 publish, no async_rollout or true_on_policy) and copies otherwise; "shared" refuses a
    # run where it cannot share; "copy" always exports, publishes, loads and checks (rollout.weight_sync)
    weight_sync: Literal["auto", "shared", "copy"] = "auto"
    # the built-in engine (--rollout-engine reference; docs/rollout.md): how many samples decode at once
    # (continuous batching: a finished sample's slot takes the next waiting one; None = every sample of the
    # step at once), whether its decode step replays CUDA graphs (None = on for a CUDA device; true on
    # the CPU is refused), and whether the decode step runs as torch.compile (Inductor) code, compiled when the
    # engine first decodes (by region: two compiles per layer kind, whatever the depth and slot buckets; off by
    # default: on an H200 building the bench config's slots with it took 54 s, which a short run does not win
    # back). Samples do not depend on the first two.
    rollout_max_slots: Optional[int] = None
    rollout_cuda_graphs: Optional[bool] = None
    rollout_compile: bool = False
    # colocated mode: the rollout engine shares the trainer's devices and gives its memory back (weights and
    # KV cache; SGLang: release/resume_memory_occupation) while the trainer computes log-probs and trains;
    # the next step's weight update takes it again, in place (docs/rollout.md#colocated-mode)
    colocate: bool = SGLANG_DEFAULTS["colocate"]
    # asynchronous rollout (rollout.async_rollout): the next step's samples are generated, from the weights this
    # step's sync loaded, while this step computes log-probs and trains; step k then trains on samples of the
    # weights synced at step k-1, one step off-policy (metric rollout_policy_lag; docs/training.md)
    async_rollout: bool = False
    # the SGLang engine (--rollout-engine sglang; rollout.sglang_engine): how each step's weights reach the
    # server ("tensors": update_weights_from_tensor, the server on this machine; "disk": an HF checkpoint in
    # RUN_DIR/sglang_weights that it reloads), the server's tensor-parallel size (a started server's --tp-size;
    # with --rollout-url, checked against the server), and for a server the trainer starts: its port (0 = a
    # free one), more `sglang.launch_server` arguments (one shell-quoted string), the seconds to wait for it
    sglang_weight_sync: Literal["tensors", "disk"] = SGLANG_DEFAULTS["sglang_weight_sync"]
    sglang_tp_size: int = SGLANG_DEFAULTS["sglang_tp_size"]
    sglang_port: int = SGLANG_DEFAULTS["sglang_port"]
    sglang_server_args: str = SGLANG_DEFAULTS["sglang_server_args"]
    sglang_startup_timeout_s: float = SGLANG_DEFAULTS["sglang_startup_timeout_s"]
    # several ranks (torchrun / srun / local ranks): seconds each rank waits for the others to start before it
    # names the ranks it waited for and stops (orchestration.dist_env)
    rendezvous_timeout_s: float = 300.0
    # GRPO loss
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    normalize_adv_std: bool = True
    # old log-probs (the ratio's denominator) from a no-grad forward of their own before the update; False: from
    # the update's own forward, detached, the same policy since a step takes one optimizer step (train.grpo.
    # recomputes_old_logprobs; true_on_policy and --pp always recompute)
    recompute_old_logprobs: bool = False
    # replay
    routing_replay: bool = True
    # the built-in engine records the indexer's top-k picks (CSA layers), the trainer (reference, miles, megatron;
    # rows or packed) replays them; tp = cp = pp = 1, local orchestrator (train.config_checks refuses the rest)
    indexer_replay: bool = False
    # MTP
    mtp_coef: float = 0.0
    # megatron's indexer KL loss weight (dsa_indexer_loss_coeff); None = off
    dsa_indexer_loss_coeff: Optional[float] = None
    # model: None = the run's implementation (run_config.impl);
    # "reference" = the reference model (tests of the loop itself)
    train_impl: Optional[str] = None
    # true on-policy (docs/rollout.md#true-on-policy): the rollout log-probs equal the trainer's recomputation bit
    # for bit (train_rollout_logprob_abs_diff == 0.0). With train_impl="reference", the built-in engine on the
    # CPU (fp32, bf16) or one NVIDIA GPU (bf16), or train_impl miles / megatron on the CPU in fp32 (the engine draws
    # from the trainer's module, rollout.reference_engine.TrainModuleEngine), one rank: the engine re-runs each group's padded
    # [n, prompt + max_new_tokens] batch for every token (no KV cache), every routed expert runs over every row,
    # the weights reach the engine in the trainer's own dtypes; anything else is refused
    true_on_policy: bool = False
    # torch.compile the implementation's blocks (engine.compile): fewer, fused kernels on a GPU; every
    # new batch shape or packing (THD) layout recompiles, so it pays off for long runs of steady shapes
    compile_blocks: bool = False
    # with compile_blocks: replay the compiled blocks as CUDA graphs (Inductor's reduce-overhead mode, as in the
    # training benchmark; SFT on one GPU's BSHD or row-packed micro-batches, needs pad_to_length)
    cuda_graphs: bool = False
    # SFT: pad every sequence (prompt + response) to this many tokens, so every micro-batch has one shape;
    # padding is masked out of the loss (None = pad to the longest sequence of the micro-batch)
    pad_to_length: Optional[int] = None
    # activation recomputation (engine.recompute): "none", "selective" (each block's attention) or "full"
    recompute: str = "none"
    # samples per forward/backward on each rank, gradients accumulated over the rank's share of the step;
    # None = SFT: the rank's whole batch, GRPO: micro_batch_tokens decides (the global batch is batch_size, or
    # prompts_per_step x group_size). Packed runs (max_tokens_per_rank) size micro-batches by tokens instead.
    micro_batch_size: Optional[int] = None
    # GRPO without micro_batch_size or packing: as many samples per micro-batch as fit this many padded tokens
    # (core.packing.budget_rows); None = 8192. true_on_policy: one prompt group each (its engine's shape)
    micro_batch_tokens: Optional[int] = None
    # Adam's two moments in fp32, or bf16 (--hardware nvidia, the Triton AdamW: 4 bytes less state per parameter,
    # a lighter step; kernels.triton.adamw)
    adam_moments_dtype: str = "fp32"
    # weight gradients written by their GEMMs straight into the fp32 gradient buffer, with no bf16 gradient and no
    # cast/add pass (engine.wgrad_fusion): "auto" = on where it applies (a GPU target, bf16, eager), "on" refuses
    # a run where it cannot, "off"
    wgrad_fusion: str = "auto"
    # dynamic batching: pack SFT sequences / GRPO samples into THD micro-batches of at most this many
    # (padded) tokens per CP rank (core.packing), gradients accumulated; None = run_config's, else off
    max_tokens_per_rank: Optional[int] = None
    # bookkeeping
    # where each step's scalars go besides metrics.jsonl (reporting.trackers): tensorboard, wandb, mlflow or none
    tracker: Tuple[str, ...] = ("tensorboard",)
    save_every: int = 10
    # False: no checkpoint after the last step unless save_every divides it (benchmarks; a Flash-shaped run's
    # final checkpoint with its fp32 optimizer state is about 80 GB)
    save_at_end: bool = True
    keep_last: int = 2
    export_at_end: bool = True
    # profile the run's last N steps with torch.profiler (global rank 0): device time per category, kernels and
    # host syncs per step, written to RUN_DIR/profile/budget.json (reporting.profiling); 0 = off
    profile_steps: int = 0

    def __post_init__(self) -> None:
        from .config_checks import validate

        validate(self)  # ranges: one error naming the key and the allowed range

    def to_json(self) -> Dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["tracker"] = list(self.tracker)
        return d


def resolve_model_config(run_config, model_source):
    """``(the run's ModelConfig, the checkpoint folder to load or None)`` for a model source (a checkpoint folder, a
    preset name, a ModelConfig) and the run's own model config."""
    from core.config import ModelConfig, preset

    cfg = run_config.model
    if isinstance(model_source, ModelConfig):
        return model_source, None
    if model_source is not None and Path(str(model_source)).is_dir():
        from core.checkpoint import open_checkpoint
        from core.native_checkpoint import is_native_checkpoint, native_model_config

        if is_native_checkpoint(model_source):
            native_cfg = native_model_config(model_source)
            return (native_cfg if cfg is None else cfg), str(model_source)
        from converters.torch_dist import check_torch_dist, is_torch_dist_checkpoint

        if is_torch_dist_checkpoint(model_source):
            return check_torch_dist(model_source, cfg), str(model_source)
        reader = open_checkpoint(model_source, config=cfg)
        return reader.config if cfg is None else cfg, str(model_source)
    if isinstance(model_source, str):
        return preset(model_source), None
    if cfg is not None:
        return cfg, None
    raise ValueError("run_training needs a model: a checkpoint folder, a preset name or a ModelConfig")


def _export_starting_weights(run, engine: str) -> Path:
    """The model's weights now (the starting or the resumed ones) as an HF checkpoint in the run's publish
    format, with the tokenizer: ``RUN_DIR/<engine>_init`` (global rank 0 writes it)."""
    from rollout.weight_sync import checkpoint_format

    fmt = checkpoint_format(run.publish_format, purpose=f"starting a --rollout-engine {engine} server")
    path = run.run_dir / f"{engine}_init"
    view = full_view(run.model, run.dist)
    if run.dist.is_main:
        export_model(view, path, weight_format=fmt, tokenizer=run.tok)
    run.dist.barrier()
    return path


class _Run:
    """One rank's run: set up by :meth:`__init__` (models, optimizer, start step, rollout engine), run by
    :meth:`run` (the steps of :mod:`train.sft` / :mod:`train.grpo`, metrics, checkpoints, the final export)."""

    def __init__(self, run_config, model_source, mode, steps, run_dir, resume, cfg: TrainConfig, progress: bool,
                 layout=None, engine_source=None, parts=None):
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
        if steps < 1:
            raise ValueError("--steps must be >= 1")
        self.mode, self.steps, self.cfg, self.progress, self.run_config = mode, steps, cfg, progress, run_config
        self.engine_source = engine_source   # the orchestrator's engine for this rank (train_rank), or None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.parts = parts if parts is not None else assemble(run_config)   # the run's handles, made once per rank
        self.model_config, self.ckpt_source = resolve_model_config(run_config, model_source)
        self.tok = D.tokenizer_for(self.ckpt_source, self.model_config.vocab_size)
        self.examples = D.load_data(cfg.data, mode)
        check_sequences(D.example_lengths(self.tok, self.examples, mode, cfg.max_new_tokens), self.model_config,
                        source=f"{mode.upper()} data {cfg.data or '(built-in)'}")   # before the model is built
        check_run_fits_gpu(self.model_config, run_config, cfg.adam_moments_dtype)    # and the state against the GPU
        torch.manual_seed(cfg.seed)
        self.dtype = run_config.torch_dtype                               # the run's --dtype
        self.publish_format = run_config.selection.quant.publish_format   # published to the engine: --quant's
        # no random init when a load overwrites every weight (and is checked to): a model source, or the run's
        # own checkpoint that --resume continues from (the init of a large model takes minutes, all overwritten)
        self.resume_fills = self.ckpt_source is None and resumes(self.run_dir, resume)
        self._build_models(layout)
        self.engine = None
        self.rollouts = None             # async_rollout: the leader's generate call in flight (rollout.async_rollout)
        self._peak_bytes = 0             # the run's device-memory peak before the last reset (train phase)
        self.start_step = open_run(self, resume)
        # last, so a failure before it leaves no server running (run() stops the engine); none when no step is left
        if mode == "grpo" and self.start_step < self.steps:
            self.engine = self._start_rollout_engine()
        try:    # how the weights reach the engine (rollout.shared_weights: in place where it can, else copied)
            self.weight_sync = choose_weight_sync(cfg, self.engine, self.dist, self.publish_format,
                                                  next(self.model.parameters()).device)
        except Exception:
            if self.engine is not None:
                self.engine.shutdown()       # a refused run leaves no server running
            raise
        if self.engine is not None and cfg.async_rollout:
            self.rollouts = RolloutPipeline(self.engine)

    def _build_models(self, layout) -> None:
        """The training model (loaded from the model source), the optimizer, the KL reference policy (GRPO with
        ``kl_coef > 0``) and this rank's view of the parallel layout."""
        from engine.layout import current

        cfg, run_config = self.cfg, self.run_config
        loads = self.ckpt_source is not None or self.resume_fills
        self.model = build_train_model(self.model_config, run_config, impl=cfg.train_impl,
                                       dtype=self.dtype, seed=cfg.seed,
                                       dsa_indexer_loss_coeff=cfg.dsa_indexer_loss_coeff,
                                       compile_blocks=cfg.compile_blocks, cuda_graphs=cfg.cuda_graphs,
                                       recompute=cfg.recompute, initialize=not loads, parts=self.parts)
        self.layout = layout or current()      # this rank's parallel layout (engine.layout), built once
        self.dist = ParallelGroups.of(self.layout)
        check_divisible(self.dist, self.mode, cfg)
        self.max_tokens_per_rank = cfg.max_tokens_per_rank or getattr(run_config, "max_tokens_per_rank", None)
        # the layout rules (packing and --cp need --qkv-format thd) are the combination table's
        self.packed = bool(getattr(self.model, "packs_streams", False)) and (
            self.dist.cp > 1 or self.max_tokens_per_rank is not None)
        check_static_shapes(cfg, packed=self.packed, rows=cfg.batch_size // self.dist.dp)
        if cfg.true_on_policy:
            check_true_on_policy(run_config, cfg, self.model, self.dist)
            self.model.row_invariant = True
        self.source_desc = load_model_source(self.model, self.ckpt_source)
        self.optim = build_optimizer(self.model, cfg, run_config)
        self.profiler = None               # profile_steps: set in run(), once the start step is known
        self.ref_model = None
        if self.mode == "grpo" and cfg.kl_coef > 0:
            self.ref_model = build_train_model(self.model_config, run_config, impl=cfg.train_impl,
                                               dtype=self.dtype, seed=cfg.seed, initialize=not loads,
                                               parts=self.parts)
            load_model_source(self.ref_model, self.ckpt_source)   # the starting weights (same seed, same source)
            self.ref_model.eval().requires_grad_(False)
            self.ref_model.row_invariant = bool(cfg.true_on_policy)

    def _start_rollout_engine(self):
        """This data-parallel rank's rollout engine (on its leader; None elsewhere). A server engine that the
        trainer starts (no ``--rollout-url``) loads the run's starting weights: every rank takes part in writing
        them (:func:`_export_starting_weights`), the leader's factory gets their folder as ``model_path``."""
        run_config, options = self.run_config, {}
        record = run_config.selection.rollout
        if record.server and run_config.rollout_url is None:
            options["model_path"] = _export_starting_weights(self, record.name)
        if not self.dist.is_leader:
            return None
        if self.engine_source is not None:
            return self.engine_source()
        if self.cfg.true_on_policy and self.model.impl != "reference":
            # an implementation's module: the engine draws from it (docs/rollout.md#true-on-policy)
            from rollout.reference_engine import TrainModuleEngine

            return TrainModuleEngine(self.model)
        return self.parts.rollout_engine(self.model_config, dtype=self.dtype, settings=self.cfg, run_dir=self.run_dir,
                                         publish_format=self.publish_format, **options)

    def description(self) -> Dict[str, Any]:
        """The run's resolved configuration (``train_config.json``; the trackers' params / config)."""
        return {"mode": self.mode, "train": self.cfg.to_json(), "model_config": self.model_config.to_hf_dict(),
                "model_source": self.ckpt_source,  # "run": the run's choices (`dsv4 train --config` reads them)
                "run": self.run_config.as_dict()}

    # -- what the steps use (train.sft, train.grpo) -----------------------------------------------
    def clip_and_step(self) -> float:
        """Reduce the gradients over data (and context) parallel, clip, step (``train.optim``: a non-finite
        gradient norm stops the run before the update); returns the pre-clip global gradient norm."""
        with profiling.scope("optimizer"):
            gnorm = self.optim.step()
        if self.optim.weights_finite() is not True:       # (True: the Triton AdamW checked what it wrote)
            step_guard.check_parameters(self.model)       # the update itself blew up (e.g. lr=inf)
        return gnorm

    def row_chunks(self, n: int, size: Optional[int] = None) -> List[slice]:
        """This rank's ``n`` rows in micro-batches of ``size`` rows (default ``micro_batch_size``; one when unset)."""
        size = size or self.cfg.micro_batch_size or n
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def accumulating(self, k: int, n: int):
        """Every backward of the step but the last accumulates without reducing (``train.optim``)."""
        return self.optim.no_sync() if k < n - 1 else contextlib.nullcontext()

    def micro_batches(self, lengths: List[int]):
        """``([sample indices per micro-batch], packing efficiency)`` (core.packing; samples never split)."""
        from .distributed import pack

        pr = pack(lengths, self.model_config, self.dist.cp, self.max_tokens_per_rank)
        return [list(mb.sample_indices) for mb in pr.micro_batches], pr.efficiency

    def engine_memory(self) -> Dict[str, Any]:
        """After the rollout (the leader): the bytes of weights the engine still holds (0 once released; engines
        that can say)."""
        held = getattr(self.engine, "held_bytes", None)
        return {} if held is None else {"engine_memory_gib": held() / 2**30}

    def memory_phase_start(self) -> Dict[str, Any]:
        """After the rollout: on a GPU a fresh peak for the train phase (the run's peak so far is kept for
        ``peak_memory_gib``)."""
        out = {}
        if torch.cuda.is_initialized():
            self._peak_bytes = max(self._peak_bytes, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return out

    def memory_phase_end(self) -> Dict[str, Any]:
        """Peak allocated in log-probs and training (colocation lowers it); allocator retries (flush+sync each)."""
        s = torch.cuda.memory_stats() if torch.cuda.is_initialized() else {}   # max_memory_allocated's peak
        return {"train_peak_memory_gib": s["allocated_bytes.all.peak"] / 2**30,
                "cuda_alloc_retries": s["num_alloc_retries"]} if s else {}

    def _peak_memory_gib(self) -> Optional[float]:
        """The run's peak allocated device memory so far (rank 0's device)."""
        if not torch.cuda.is_initialized():
            return None
        return max(self._peak_bytes, torch.cuda.max_memory_allocated()) / 2**30

    # -- loop --------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        """Every rank runs the steps (their collectives); global rank 0 alone prints and writes the run
        folder; every rank writes its share of each checkpoint, and the final export gathers the full state."""
        from reporting import run_log

        main = self.dist.is_main
        logger = None
        last_row: Dict[str, Any] = {}
        try:                     # the engine is shut down however the run ends (a started server is stopped)
            logger = MetricsLogger(self.run_dir, start_step=self.start_step, trackers=self.cfg.tracker,
                                   config={**self.description(), "steps": self.steps}) if main else None
            with (run_log.file_log(self.run_dir) if main else contextlib.nullcontext()), run_log.step_progress(
                    self.mode, self.steps, self.start_step, enabled=self.progress and main) as bar:
                for line in (run_log.config_lines(self.run_config, self.cfg, mode=self.mode, steps=self.steps,
                                                  start_step=self.start_step, run_dir=self.run_dir,
                                                  source=self.source_desc) if main else ()):
                    run_log.log.info(line)
                if main:
                    run_log.log.info(f"optimizer: {self.optim.describe()}")
                if main and self.engine is not None:
                    run_log.log.info(self.weight_sync.line())
                if main and self.start_step >= self.steps:
                    run_log.log.info(f"{self.run_dir}: already at step {self.start_step} >= --steps {self.steps}")
                self.profiler = self._step_profiler()
                for step in range(self.start_step + 1, self.steps + 1):
                    t0 = time.perf_counter()
                    try:
                        with self.profiler.step(step) if self.profiler else contextlib.nullcontext(), \
                                kernel_compiles.counted(f"step {step}") as compiled:
                            row = grpo_step(self, step) if self.mode == "grpo" else sft_step(self, step)
                        row.update(compiled.metrics())       # a slow step that compiled kernels says so
                        step_guard.check_loss(row)
                    except step_guard.NonFiniteError as exc:
                        found = latest_checkpoint(self.run_dir)
                        raise step_guard.diverged(step, exc, self.run_dir, found and found[0], self.cfg.lr) from None
                    dt = time.perf_counter() - t0
                    if self.profiler is not None:
                        self.profiler.after_step(step)
                    row["step"] = step
                    row["time_step"] = dt
                    row["tokens_per_s"] = row["tokens"] / dt if dt > 0 else 0.0
                    row.update(lr=self.cfg.lr, wall_time=time.time(), world_size=self.dist.world)
                    row["peak_memory_gib"] = self._peak_memory_gib()
                    last_row = row
                    if logger is not None:
                        logger.log(row)
                        bar.step(row)
                        run_log.log.debug("metrics " + json.dumps(row, sort_keys=True, default=str))
                    if step % self.cfg.save_every == 0 or (step == self.steps and self.cfg.save_at_end):
                        maybe_kill(step, "checkpoint")
                        save_checkpoint(self.run_dir, step, self.model, self.optim, keep_last=self.cfg.keep_last,
                                        extra={"mode": self.mode, "layout": self._layout()}, groups=self.dist)
                budget = profiling.read_budget(self.run_dir) if self.profiler else None
                for line in profiling.format_budget(budget) if budget and main else ():
                    run_log.log.info(line)
        finally:
            if self.profiler is not None:
                self.profiler.close()
            if logger is not None:
                logger.close()
            if self.rollouts is not None:    # a run that failed mid-step: the engine must not be generating
                self.rollouts.close()
            if self.engine is not None:
                self.engine.shutdown()
        result = {"run_dir": str(self.run_dir), "start_step": self.start_step, "steps": self.steps,
                  "last": last_row}
        if self.cfg.export_at_end and self.start_step < self.steps:
            view = full_view(self.model, self.dist)
            if main:
                result["hf_export"] = str(export_model(view, self.run_dir / "hf", tokenizer=self.tok))
            self.dist.barrier()
        return result

    def _step_profiler(self) -> Optional[profiling.StepProfiler]:
        """``profile_steps``: global rank 0 profiles the run's last steps (reporting.profiling); compiled blocks fuse
        across modules, so their profile has op names only."""
        n = self.cfg.profile_steps
        if n <= 0 or not self.dist.is_main or self.start_step >= self.steps:
            return None
        model = getattr(self.model, "module", None)
        model = model if isinstance(model, torch.nn.Module) else self.model
        return profiling.StepProfiler(model, self.run_dir, first=max(self.start_step + 1, self.steps - n + 1),
                                      last=self.steps, module_scopes=not self.cfg.compile_blocks)

    def _layout(self) -> Dict[str, int]:
        from engine.layout import current

        d = self.dist
        return {"world": d.world, "dp": d.dp, "tp": d.tp, "cp": d.cp, "ep": d.ep, "pp": d.pp, "vpp": current().vp,
                "optimizer": self.optim.kind}


def train_rank(run_config, model_source, mode, steps, run_dir, resume, cfg, progress, *, layout=None,
               engine_source: Optional[Callable[[], Any]] = None, parts=None) -> Dict[str, Any]:
    """One rank's run, in process groups already joined (:mod:`orchestration.training` starts the ranks).
    ``layout``: this rank's ``engine.layout.ParallelLayout`` (None: the process's; one rank without a group).
    ``engine_source``: where this data-parallel leader's rollout engine comes from when the orchestrator owns
    the engines (``--orchestrator ray``: the proxy of the rank's engine actor); None = the run's engine is made
    here (the run's, ``parts.rollout_engine``). ``parts``: the run's assembly (``core.assembly.assemble``), made
    once per rank by the launcher (None: assembled here)."""
    return _Run(run_config, model_source, mode, steps, run_dir, resume, cfg, progress, layout=layout,
                engine_source=engine_source, parts=parts).run()
