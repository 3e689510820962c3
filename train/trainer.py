"""The SFT / GRPO training loop (``dsv4 train``).

One GRPO step::

    update_weights  sync the trained weights into the rollout engine (export -> publish -> load -> check)
    rollout         P prompts x G samples each (temperature / top-p), rewards, routed experts per token
    logprobs        old log-probs recomputed by the training model (no grad; routing replayed), plus
                    the reference policy's when kl_coef > 0; rollout-vs-train diagnostics
    train           clipped policy loss (+ k3 KL penalty, + MTP loss), one optimizer step

With ``async_rollout`` the rollout of step k+1 is sent right after step k's weight sync and runs while step k
computes log-probs and trains; step k takes its own batch (in flight since step k-1) before its sync, so it trains
one step off-policy (:mod:`train.async_rollout`; metric ``rollout_policy_lag``).

The rollout engine is the run's (``--rollout-engine``, :func:`_rollout_engine`), made once the run folder is
checked and shut down however the run ends; a server engine (SGLang) is started on the run's starting weights
(written to ``RUN_DIR/<engine>_init``) or connected to at ``--rollout-url``.

One SFT step: a batch of (prompt, response) pairs, token-mean NLL on response tokens (+ MTP), one
optimizer step. Both modes add the training model's own loss term when it has one (``TrainForward.aux_loss``:
megatron's indexer KL loss with ``dsa_indexer_loss_coeff``; metric ``indexer_loss``). The training model
is the run's implementation (``train_impl`` None; see :func:`train.model.build_train_model`). Metrics go to ``RUN_DIR/metrics.jsonl`` and TensorBoard, the printed lines (resolved configuration, one line per step) also to ``RUN_DIR/train.log`` (:mod:`train.run_log`); checkpoints every
``save_every`` steps and at the end (:mod:`train.checkpointing`); ``resume=True`` continues after the
last complete checkpoint. With ``export_at_end`` the final weights are written as an HF checkpoint to
``RUN_DIR/hf``.

Ranks (``run_config.world > 1``; :mod:`train.launch` starts or joins them, :mod:`train.distributed` holds the
layout): each data-parallel rank trains on its share of the step's samples, its leader's rollout engine
generating them; losses are divided by the step's global token count and gradients summed
(:mod:`train.optim`: megatron-core's distributed optimizer on GPUs), so every layout takes the one-rank step.
Context-parallel ranks run their slice of each packed (THD) micro-batch. Global rank 0 does the file I/O
(config, metrics, export) but checkpoints, which every rank writes its own share of (:mod:`train.checkpointing`).
Dynamic batching (``max_tokens_per_rank``, THD): SFT sequences / GRPO samples are packed in order into
micro-batches with :func:`core.packing.pack_micro_batches` (never split; the run's CP size and the
model's pad rule), gradients accumulated; metrics ``packing_efficiency`` (real / padded tokens) and
``micro_batches``. With cp=1 and no budget the loop is unchanged (rows packed by ``pack_rows``).

Test hook: ``DSV4_TRAIN_KILL_AT="STEP:PHASE"`` (PHASE in rollout, logprobs, train, update_weights,
checkpoint) SIGKILLs the process at that point of that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch

from core.atomic import write_text_atomically

from . import data as D
from .async_rollout import RolloutPipeline
from .checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from .engines import SamplingParams
from .losses import (group_advantages, grpo_loss, mtp_loss, sample_mean_diag, sft_loss_sum,
                     zero_variance_group_frac)
from .metrics import MetricsLogger, truncate_after
from .distributed import ParallelGroups, check_divisible
from .export import CONFIG_FILE, export_model
from .model import build_train_model, full_view, load_model_source
from .optim import build_optimizer
from .replay import routing_match
from .weight_sync import sync_weights
from . import profiling, state_io, step_guard
from .config_checks import check_mode, check_static_shapes, check_train_options, check_true_on_policy
from .run_folder import config_differences, has_progress
from .run_claim import claimed_run_folder
from core.errors import UserInputError
from core.sequence_limits import check_sequences

MODES = ("sft", "grpo")
REF_MODEL_FILE = "ref_model.safetensors"     # the KL reference policy's weights (safetensors: never unpickled)
KILL_ENV = "DSV4_TRAIN_KILL_AT"


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
    # the built-in engine (--rollout-engine reference; docs/rollout.md): how many samples decode at once
    # (continuous batching: a finished sample's slot takes the next waiting one; None = every sample of the
    # step at once), whether its decode step replays CUDA graphs (None = on for a CUDA device; true on
    # the CPU is refused), and whether the decode step runs as torch.compile (Inductor) code, compiled when the
    # engine first decodes (at most three compiles for all slot buckets; off by default: on an H200 building
    # the bench config's slots with it took 54 s, which a short run does not win back). Samples do not depend
    # on the first two.
    rollout_max_slots: Optional[int] = None
    rollout_cuda_graphs: Optional[bool] = None
    rollout_compile: bool = False
    # colocated mode: the rollout engine shares the trainer's devices and gives its memory back (weights and
    # KV cache; SGLang: release/resume_memory_occupation) while the trainer computes log-probs and trains;
    # the next step's weight update takes it again, in place (docs/rollout.md#colocated-mode)
    colocate: bool = False
    # asynchronous rollout (train.async_rollout): the next step's samples are generated, from the weights this
    # step's sync loaded, while this step computes log-probs and trains; step k then trains on samples of the
    # weights synced at step k-1, one step off-policy (metric rollout_policy_lag; docs/training.md)
    async_rollout: bool = False
    # the SGLang engine (--rollout-engine sglang; train.sglang_engine): how each step's weights reach the
    # server ("tensors": update_weights_from_tensor, the server on this machine; "disk": an HF checkpoint in
    # RUN_DIR/sglang_weights that it reloads), the server's tensor-parallel size (a started server's --tp-size;
    # with --rollout-url, checked against the server), and for a server the trainer starts: its port (0 = a
    # free one), more `sglang.launch_server` arguments (one shell-quoted string), the seconds to wait for it
    sglang_weight_sync: Literal["tensors", "disk"] = "tensors"
    sglang_tp_size: int = 1
    sglang_port: int = 0
    sglang_server_args: str = ""
    sglang_startup_timeout_s: float = 900.0
    # several ranks (torchrun / srun / local ranks): seconds each rank waits for the others to start before it
    # names the ranks it waited for and stops (train.dist_env)
    rendezvous_timeout_s: float = 300.0
    # GRPO loss
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    normalize_adv_std: bool = True
    # replay
    routing_replay: bool = True
    indexer_replay: bool = False             # refused when true: not built (train.config_checks says why)
    # MTP
    mtp_coef: float = 0.0
    # megatron's indexer KL loss weight (dsa_indexer_loss_coeff); None = off
    dsa_indexer_loss_coeff: Optional[float] = None
    # model: None = the run's implementation (run_config.impl; "reference" without a run config);
    # "reference" = the reference model (tests of the loop itself)
    train_impl: Optional[str] = None
    # true on-policy (docs/rollout.md#true-on-policy): the rollout log-probs equal the trainer's recomputation bit
    # for bit (train_rollout_logprob_abs_diff == 0.0). With train_impl="reference", the built-in engine on the
    # CPU (fp32, bf16) or one NVIDIA GPU (bf16), or train_impl miles / megatron on the CPU in fp32 (the engine draws
    # from the trainer's module, train.engines.TrainModuleEngine), one rank: the engine re-runs each group's padded
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
    # None = SFT: the rank's whole batch, GRPO: one prompt group (the global batch is batch_size, or
    # prompts_per_step x group_size). Packed runs (max_tokens_per_rank) size micro-batches by tokens instead.
    micro_batch_size: Optional[int] = None
    # dynamic batching: pack SFT sequences / GRPO samples into THD micro-batches of at most this many
    # (padded) tokens per CP rank (core.packing), gradients accumulated; None = run_config's, else off
    max_tokens_per_rank: Optional[int] = None
    # bookkeeping
    # where each step's scalars go besides metrics.jsonl (train.trackers): tensorboard, wandb, mlflow or none
    tracker: Tuple[str, ...] = ("tensorboard",)
    save_every: int = 10
    # False: no checkpoint after the last step unless save_every divides it (benchmarks; a Flash-shaped run's
    # final checkpoint with its fp32 optimizer state is about 80 GB)
    save_at_end: bool = True
    keep_last: int = 2
    export_at_end: bool = True
    # profile the run's last N steps with torch.profiler (global rank 0): device time per category, kernels and
    # host syncs per step, written to RUN_DIR/profile/budget.json (train.profiling); 0 = off
    profile_steps: int = 0

    def __post_init__(self) -> None:
        from .config_checks import validate

        validate(self)  # ranges: one error naming the key and the allowed range

    def to_json(self) -> Dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["tracker"] = list(self.tracker)
        return d


# settings a resumed run may change: they do not change what is trained
RESUME_MAY_CHANGE = ("tracker", "profile_steps", "rendezvous_timeout_s")


def _compared(desc: Dict, keys) -> Dict:
    """The parts of a run description that ``--resume`` must find unchanged."""
    out = {k: desc.get(k) for k in keys}
    if isinstance(out.get("train"), dict):
        out["train"] = {k: v for k, v in out["train"].items() if k not in RESUME_MAY_CHANGE}
    return out


def _maybe_kill(step: int, phase: str) -> None:
    want = os.environ.get(KILL_ENV)
    if want and want == f"{step}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 65_537 + 11) % (2 ** 63)


def _resolve_model_config(run_config, model_source):
    from core.config import ModelConfig, preset

    cfg = getattr(run_config, "model", None) if run_config is not None else None
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


def _resumes(run_dir: Path, resume: bool) -> bool:
    """Whether this run continues from a checkpoint in ``run_dir`` (``--resume`` and one exists), decided before
    the model is built so that it is built without random init: :func:`train.checkpointing.load_checkpoint`
    then writes every weight (and checks it did). Every rank decides alike (the run folder is shared)."""
    return bool(resume) and latest_checkpoint(run_dir) is not None


def _pad_batch(seqs: List[List[int]], pad: int, length: Optional[int] = None) -> torch.Tensor:
    """Rows padded with ``pad`` to the longest sequence, or to ``length`` (``pad_to_length``)."""
    L = max(len(s) for s in seqs)
    if length is not None:
        if L > length:
            raise UserInputError(f"a sequence of {L} tokens (prompt + response) is longer than pad_to_length="
                                 f"{length}. Fix: raise pad_to_length to {L} or more, or shorten the data")
        L = length
    return torch.tensor([s + [pad] * (L - len(s)) for s in seqs], dtype=torch.long)


class _Run:
    def __init__(self, run_config, model_source, mode, steps, run_dir, resume, cfg: TrainConfig, progress: bool):
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
        if steps < 1:
            raise ValueError("--steps must be >= 1")
        self.mode, self.steps, self.cfg, self.progress = mode, steps, cfg, progress
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_config = run_config
        self.model_config, self.ckpt_source = _resolve_model_config(run_config, model_source)
        self.tok = D.tokenizer_for(self.ckpt_source, self.model_config.vocab_size)
        self.examples = D.load_data(cfg.data, mode)
        check_sequences(D.example_lengths(self.tok, self.examples, mode, cfg.max_new_tokens), self.model_config,
                        source=f"{mode.upper()} data {cfg.data or '(built-in)'}")   # before the model is built
        torch.manual_seed(cfg.seed)
        # the run's dtype (--dtype); the reference loop of tests without a run config trains in fp32
        self.dtype = run_config.torch_dtype if run_config is not None else torch.float32
        # no random init when a load overwrites every weight (and is checked to): a model source, or the run's
        # own checkpoint that --resume continues from (the init of a large model takes minutes, all overwritten)
        self._resume_fills = self.ckpt_source is None and _resumes(self.run_dir, resume)
        loads = self.ckpt_source is not None or self._resume_fills
        self.model = build_train_model(self.model_config, run_config, impl=cfg.train_impl,
                                       dtype=self.dtype, seed=cfg.seed,
                                       dsa_indexer_loss_coeff=cfg.dsa_indexer_loss_coeff,
                                       compile_blocks=cfg.compile_blocks, cuda_graphs=cfg.cuda_graphs,
                                       recompute=cfg.recompute, initialize=not loads)
        self.dist = ParallelGroups.current()
        check_divisible(self.dist, mode, cfg)
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
        if mode == "grpo" and cfg.kl_coef > 0:
            self.ref_model = build_train_model(self.model_config, run_config, impl=cfg.train_impl,
                                               dtype=self.dtype, seed=cfg.seed, initialize=not loads)
            load_model_source(self.ref_model, self.ckpt_source)   # the starting weights (same seed, same source)
            self.ref_model.eval().requires_grad_(False)
            self.ref_model.row_invariant = bool(cfg.true_on_policy)
        self.engine = None
        self.rollouts = None             # async_rollout: the leader's generate call in flight (train.async_rollout)
        self._peak_bytes = 0             # the run's device-memory peak before the last reset (train phase)
        # the weight format published to the engine: the run's --quant scheme's
        self.publish_format = run_config.selection.quant.publish_format if run_config is not None else "bf16"
        self.start_step = 0
        self._write_or_check_config(resume, model_source)
        # last, so a failure before it leaves no server running (run() stops the engine); none when no step is left
        if mode == "grpo" and self.start_step < self.steps:
            self.engine = self._start_rollout_engine()
            if cfg.async_rollout and self.engine is not None:
                self.rollouts = RolloutPipeline(self.engine)

    def _start_rollout_engine(self):
        """This data-parallel rank's rollout engine (on its leader; None elsewhere). A server engine that the
        trainer starts (no ``--rollout-url``) loads the run's starting weights: every rank takes part in writing
        them (:meth:`_export_starting_weights`), the leader's factory gets their folder as ``model_path``."""
        run_config, options = self.run_config, {}
        if run_config is not None:
            record = run_config.selection.rollout
            if record.server and run_config.rollout_url is None:
                options["model_path"] = self._export_starting_weights(record.name)
        if not self.dist.is_leader:
            return None
        if self.cfg.true_on_policy and self.model.impl != "reference":
            # an implementation's module: the engine draws from it (docs/rollout.md#true-on-policy)
            from .engines import TrainModuleEngine

            return TrainModuleEngine(self.model)
        return _rollout_engine(run_config, self.model_config, self.dtype, settings=self.cfg, run_dir=self.run_dir,
                               publish_format=self.publish_format, **options)

    def _export_starting_weights(self, engine: str) -> Path:
        """The model's weights now (the starting or the resumed ones) as an HF checkpoint in the run's publish
        format, with the tokenizer: ``RUN_DIR/<engine>_init`` (global rank 0 writes it)."""
        from .export import checkpoint_format

        fmt = checkpoint_format(self.publish_format, purpose=f"starting a --rollout-engine {engine} server")
        path = self.run_dir / f"{engine}_init"
        view = full_view(self.model, self.dist)
        if self.dist.is_main:
            export_model(view, path, weight_format=fmt, tokenizer=self.tok)
        self.dist.barrier()
        return path

    # -- config / resume ---------------------------------------------------
    def _write_or_check_config(self, resume: bool, model_source) -> None:
        """Rank 0 writes / checks the run folder; every other rank loads the same checkpoint (its share)."""
        self._write_or_check_run_folder(resume, model_source)
        if self._resume_fills and self.start_step == 0:
            # built without init for a checkpoint that was then not loaded (the run folder changed meanwhile)
            from core.finite import check_written

            check_written(self.model, source=f"no checkpoint of {self.run_dir}")
        self._keep_reference_policy()

    def _keep_reference_policy(self) -> None:
        """The KL reference policy is the run's starting weights: written (full tensors) when the run starts,
        read back on resume (each rank keeps its share), so a resumed run keeps its reference whatever its
        layout or ``--model``."""
        if self.ref_model is None:
            return
        path = self.run_dir / REF_MODEL_FILE
        if self.start_step > 0:
            from core.finite import check_written

            self.ref_model.load_native_state(state_io.load_tensors(path))
            check_written(self.ref_model, source=f"the run's reference policy {path}")   # built without init
            return
        view = full_view(self.ref_model, self.dist)
        if self.dist.is_main:
            state_io.save_tensors(path, dict(view.native_tensors()))
        self.dist.barrier()

    def _write_or_check_run_folder(self, resume: bool, model_source) -> None:
        if self.dist.world == 1:
            return self._write_or_check_config_main(resume, model_source)
        if self.dist.is_main:
            try:
                self._write_or_check_config_main(resume, model_source)
                found = latest_checkpoint(self.run_dir) if self.start_step else None
                msg = (self.start_step, None if found is None else str(found[1]), None)
            except Exception as exc:
                self.dist.broadcast_world((0, None, f"{type(exc).__name__}: {exc}"))
                raise
            self.dist.broadcast_world(msg)
            return None
        step, folder, err = self.dist.broadcast_world(None)
        if err is not None:
            raise RuntimeError(f"rank 0 failed: {err}")
        if folder is not None:
            load_checkpoint(folder, self.model, self.optim)
        self.start_step = int(step)
        return None

    def _description(self) -> Dict[str, Any]:
        """The run's resolved configuration (``train_config.json``; the trackers' params / config)."""
        return {"mode": self.mode, "train": self.cfg.to_json(), "model_config": self.model_config.to_hf_dict(),
                "model_source": self.ckpt_source,  # "run": the run's choices (`dsv4 train --config` reads them)
                "run": None if self.run_config is None else self.run_config.as_dict()}

    def _write_or_check_config_main(self, resume: bool, model_source) -> None:
        p = self.run_dir / CONFIG_FILE
        desc = self._description()
        found = latest_checkpoint(self.run_dir)
        if resume and found is not None:
            saved = json.loads(p.read_text()) if p.is_file() else None
            keys = ("mode", "train", "model_config")
            diff = [] if saved is None else config_differences(_compared(saved, keys), _compared(desc, keys))
            if diff:
                raise UserInputError(f"{self.run_dir}: --resume with options that differ from the run's "
                                     f"({'; '.join(diff[:6])}{'; ...' if len(diff) > 6 else ''}); resume with "
                                     f"the original options (see {p}) or start a new --run-dir")
            step, folder = found
            st = load_checkpoint(folder, self.model, self.optim)
            self.start_step = int(st["step"])
        else:
            if not resume and has_progress(self.run_dir):
                raise UserInputError(f"{self.run_dir} already holds a run; pass --resume to continue it or use "
                                     f"a new --run-dir")
            write_text_atomically(p, json.dumps(desc, indent=2, sort_keys=True) + "\n")
        truncate_after(self.run_dir, self.start_step)

    # -- steps -------------------------------------------------------------
    def sft_step(self, step: int) -> Dict[str, Any]:
        cfg, tok = self.cfg, self.tok
        batch = self.dist.share(D.batch_for_step(self.examples, cfg.seed, step, cfg.batch_size))  # this DP rank's
        seqs, masks = [], []
        for ex in batch:
            p, r = D.encode_prompt(tok, ex.prompt), D.encode_response(tok, ex.response)
            seqs.append(p + r)
            masks.append([0] * (len(p) - 1) + [1] * len(r))   # next-token targets that are response tokens
        check_sequences([len(s) for s in seqs], self.model_config, source=f"SFT data {cfg.data or '(built-in)'}",
                        device="cuda" if torch.cuda.is_initialized() else "cpu")   # one sequence: a lower bound
        ids = _pad_batch(seqs, tok.eos_token_id, cfg.pad_to_length)   # padding: never a target (mask 0)
        mask = torch.tensor([m + [0] * (ids.shape[1] - 1 - len(m)) for m in masks], dtype=torch.bool)
        t0 = time.perf_counter()
        self.model.train()
        with profiling.scope("zero_grad"):
            self.optim.zero_grad()
        _maybe_kill(step, "train")
        # every rank divides by the step's GLOBAL response-token count: the summed gradient is the token mean
        n_local = float(mask.sum())
        n_global = max(self.dist.sum_over_dp([n_local])[0], 1.0)
        lengths = [len(q) for q in seqs]
        if self.packed:                  # dynamic batching: packed THD micro-batches (core.packing)
            mbs, eff = self._micro_batches(lengths)
        else:                            # micro_batch_size rows each (one micro-batch when it is not set)
            mbs, eff = [list(range(ids.shape[0]))[rows] for rows in self._row_chunks(ids.shape[0])], None
        loss_acc = mtp_acc = aux_acc = 0.0
        have_mtp = have_aux = False
        for k, idx in enumerate(mbs):    # each adds its response tokens' NLL sum / the step's response tokens
            kw = {}
            if self.packed:
                Sm = max(lengths[i] for i in idx)
                sub_ids, sub_mask = ids[idx, :Sm], mask[idx, :Sm - 1]
                kw["lengths"] = [lengths[i] for i in idx]
            else:
                sub_ids, sub_mask = ids[idx], mask[idx]
            if cfg.cuda_graphs:          # the previous micro-batch's graph outputs may be overwritten now
                torch.compiler.cudagraph_mark_step_begin()
            fwd = self.model.forward_train(sub_ids, with_mtp=cfg.mtp_coef > 0, **kw)
            loss_sum, _n = sft_loss_sum(fwd.logprobs, sub_mask)
            loss = loss_sum / n_global
            frac = float(sub_mask.sum()) / n_global     # MTP and aux terms weighted by token share
            total = loss
            mtp = mtp_loss(fwd.mtp_logits, sub_ids, sub_mask) if cfg.mtp_coef > 0 else None
            if mtp is not None:
                total = total + cfg.mtp_coef * mtp * frac
                mtp_acc += float(mtp.detach()) * frac
                have_mtp = True
            if fwd.aux_loss is not None:
                total = total + fwd.aux_loss * frac
                aux_acc += float(fwd.aux_loss.detach()) * frac
                have_aux = True
            with self._accumulating(k, len(mbs)):
                total.backward()
            loss_acc += float(loss.detach())
        gnorm = self._clip_and_step()
        t_train = time.perf_counter() - t0
        tokens = float(sum(lengths)) if self.packed else float(ids.numel())
        loss_g, mtp_g, aux_g, tokens = self.dist.sum_over_dp([loss_acc, mtp_acc, aux_acc, tokens])
        row = {"loss": loss_g, "mtp_loss": mtp_g if have_mtp else None, "grad_norm": gnorm,
               "indexer_loss": aux_g if have_aux else None, "micro_batches": len(mbs),
               "reward_mean": None, "train_rollout_logprob_abs_diff": None, "train_rollout_kl": None,
               "time_rollout": 0.0, "time_logprobs": 0.0, "time_train": t_train, "time_update_weights": 0.0,
               "tokens": int(tokens), "response_tokens": int(n_global)}
        if eff is not None:
            row["packing_efficiency"] = eff
        return row

    def _clip_and_step(self) -> float:
        """Reduce the gradients over data (and context) parallel, clip, step (``train.optim``: a non-finite
        gradient norm stops the run before the update); returns the pre-clip global gradient norm."""
        with profiling.scope("optimizer"):
            gnorm = self.optim.step()
        step_guard.check_parameters(self.model)           # the update itself blew up (e.g. lr=inf)
        return gnorm

    def _row_chunks(self, n: int) -> List[slice]:
        """This rank's ``n`` rows in micro-batches of ``micro_batch_size`` rows (one when it is not set)."""
        size = self.cfg.micro_batch_size or n
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _accumulating(self, k: int, n: int):
        """Every backward of the step but the last accumulates without reducing (``train.optim``)."""
        return self.optim.no_sync() if k < n - 1 else contextlib.nullcontext()

    def _micro_batches(self, lengths: List[int]):
        """``([sample indices per micro-batch], packing efficiency)`` (core.packing; samples never split)."""
        from .distributed import pack

        pr = pack(lengths, self.model_config, self.dist.cp, self.max_tokens_per_rank)
        return [list(mb.sample_indices) for mb in pr.micro_batches], pr.efficiency

    def _step_prompts(self, step: int):
        """This data-parallel rank's examples of ``step``, their encoded prompts and the index of its first prompt in
        the step (sample seeds follow it, whatever the layout)."""
        batch = self.dist.share(D.batch_for_step(self.examples, self.cfg.seed, step, self.cfg.prompts_per_step))
        return batch, [D.encode_prompt(self.tok, ex.prompt) for ex in batch], self.dist.dp_rank * len(batch)

    def _generate(self, step: int, version: int, *, in_background: bool = False):
        """Generate the batch of ``step`` on the leader's engine (which holds weights ``version``): now, or issued to
        the async pipeline (:mod:`train.async_rollout`)."""
        cfg = self.cfg
        _batch, prompts, first = self._step_prompts(step)
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, (self.tok.eos_token_id,), cfg.top_k)
        kw = dict(n=cfg.group_size, seed=_step_seed(cfg.seed, step), first_prompt=first)
        if in_background:
            return self.rollouts.issue(step, version, prompts, params, **kw)
        return self.engine.generate(prompts, params, **kw)

    def grpo_step(self, step: int) -> Dict[str, Any]:
        cfg, tok = self.cfg, self.tok
        out: Dict[str, Any] = {}
        t_step = time.perf_counter()
        # async rollout: this step's batch, in flight since the previous step's sync, is taken before this step's
        # sync (the engine is never updated while it generates); None for a run's (or a resumed run's) first step
        taken = self.rollouts.take(step) if self.rollouts is not None else None
        # update_weights: every rank takes part in gathering the full weights; each engine loads them
        _maybe_kill(step, "update_weights")
        self.model.eval()
        view = full_view(self.model, self.dist)
        if self.dist.is_leader and getattr(self.engine, "reads_trainer_weights", False):
            # no sync: the engine computes with this very module (train.engines.TrainModuleEngine)
            self.engine.version = step
            out.update(time_update_weights=0.0, weight_check_ok=None, weight_sync_bytes=0, weight_sync_buckets=0,
                       weight_quant_max_rel_err=0.0)
        elif self.dist.is_leader:
            rep = sync_weights(view, self.engine, version=step, scheme=self.publish_format,
                               engine_dtype=self.dtype, max_bucket_bytes=cfg.max_bucket_bytes,
                               check=cfg.check_weights, lossless=cfg.true_on_policy)
            if rep.check is not None and not rep.check.ok:
                raise RuntimeError("weight sync check failed:\n" + rep.check.summary())
            out.update(time_update_weights=rep.seconds, weight_check_ok=None if rep.check is None else rep.check.ok,
                       weight_sync_bytes=rep.bytes, weight_sync_buckets=rep.buckets,
                       weight_quant_max_rel_err=rep.max_quant_rel_err)
        del view
        # rollout: this data-parallel rank's prompts, on its leader's engine (broadcast to its TP x CP ranks);
        # each sample's seed is a function of (seed, step, the prompt's index in the step), whatever the layout
        _maybe_kill(step, "rollout")
        t0 = time.perf_counter()
        batch, _prompts, _first = self._step_prompts(step)
        groups = None
        if self.dist.is_leader:
            if taken is None:             # generated now, from the weights just loaded
                groups, version = self._generate(step, step), step
                wait = time.perf_counter() - t0
            else:
                groups, version, wait = taken
            out.update(rollout_policy_lag=step - version, time_rollout_wait=wait)
            if cfg.colocate:
                self.engine.release_memory()
            # what the engine holds, asked before it is busy with the next batch (an actor answers in call order)
            out.update(self._engine_memory())
            if self.rollouts is not None and step < self.steps:   # the next batch, from the weights just loaded
                self._generate(step + 1, step, in_background=True)
                out["at_next_rollout_issued"] = time.perf_counter() - t_step
        groups, lag = self.dist.broadcast_from_leader((groups, out.get("rollout_policy_lag")))
        out["rollout_policy_lag"] = lag
        out.update(self._memory_phase_start())
        rewards, items = [], []
        for ex, samples in zip(batch, groups):
            r = []
            for s in samples:
                body = s.response_ids[:-1] if s.finish_reason == "stop" else s.response_ids
                r.append(D.compute_reward(D.decode_response(tok, s.response_ids), body, ex.reward))
            r = torch.tensor(r)
            rewards.append(r)
            items.append(self._group_tensors(samples, r))
        out["time_rollout"] = time.perf_counter() - t0
        if self.packed:                  # dynamic batching: micro-batches of samples across groups
            items, out["packing_efficiency"] = self._packed_items(items)
            out["micro_batches"] = len(items)
        elif cfg.micro_batch_size is not None:   # micro-batches of micro_batch_size samples across groups
            items = self._sample_items(items)
            out["micro_batches"] = len(items)
        lkw = (lambda it: {"lengths": it["lengths"]}) if self.packed else (lambda it: {})
        # logprobs
        _maybe_kill(step, "logprobs")
        t0 = time.perf_counter()
        diffs, kls, matches, w = [], [], [], []
        with torch.no_grad():
            for it in items:
                fwd = self.model.forward_train(it["ids"], routing_replay=it["routed"], temperature=cfg.temperature,
                                               **lkw(it))
                it["old"] = fwd.logprobs
                if self.ref_model is not None:
                    it["ref"] = self.ref_model.logprobs(it["ids"], routing_replay=it["routed"],
                                                        temperature=cfg.temperature, **lkw(it))
                d, k = sample_mean_diag(fwd.logprobs, it["rollout_lp"], it["mask"])
                diffs.append(d)
                kls.append(k)
                w.append(it["ids"].shape[0])
                if it["routed"] is not None:
                    matches.append(routing_match(fwd.routing_used, it["routed"]))
        out["time_logprobs"] = time.perf_counter() - t0
        n_samples, diff_sum, kl_sum, match_sum, match_n = self.dist.sum_over_dp([
            float(sum(w)), sum(d * n for d, n in zip(diffs, w)), sum(k * n for k, n in zip(kls, w)),
            float(sum(matches)), float(len(matches))])
        out["train_rollout_logprob_abs_diff"] = diff_sum / n_samples
        out["train_rollout_kl"] = kl_sum / n_samples
        out["routing_replay_match"] = (match_sum / match_n) if match_n else None
        # train: every rank divides by the step's GLOBAL response-token count (gradients are summed)
        _maybe_kill(step, "train")
        t0 = time.perf_counter()
        self.model.train()
        with profiling.scope("zero_grad"):
            self.optim.zero_grad()
        local_tokens = float(sum(int(it["mask"].sum()) for it in items))
        total_tokens = self.dist.sum_over_dp([local_tokens])[0]
        loss_acc = pg_acc = kl_acc = clip_acc = mtp_acc = aux_acc = 0.0
        have_aux = False
        for i, it in enumerate(items):
            fwd = self.model.forward_train(it["ids"], routing_replay=it["routed"], temperature=cfg.temperature,
                                           with_mtp=cfg.mtp_coef > 0, **lkw(it))
            loss, pg_term, kl_term, clipped = grpo_loss(
                fwd.logprobs, it["old"], it["adv"], it["mask"], total_tokens=total_tokens, ref_logp=it.get("ref"),
                kl_coef=cfg.kl_coef, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
            pg_acc += float(pg_term.detach())
            clip_acc += float(clipped)
            if kl_term is not None:
                kl_acc += float(kl_term.detach())
            if cfg.mtp_coef > 0:
                m = mtp_loss(fwd.mtp_logits, it["ids"], it["mask"])
                if m is not None:
                    frac = float(it["mask"].sum()) / max(total_tokens, 1.0)
                    loss = loss + cfg.mtp_coef * m * frac
                    mtp_acc += float(m.detach()) * frac
            if fwd.aux_loss is not None:     # implementation's own term (indexer KL), token-weighted
                frac = float(it["mask"].sum()) / max(total_tokens, 1.0)
                loss = loss + fwd.aux_loss * frac
                aux_acc += float(fwd.aux_loss.detach()) * frac
                have_aux = True
            with self._accumulating(i, len(items)):
                loss.backward()
            loss_acc += float(loss.detach())
        gnorm = self._clip_and_step()
        out["time_train"] = time.perf_counter() - t0
        out["at_train_end"] = time.perf_counter() - t_step
        out.update(self._memory_phase_end())
        loss_acc, pg_acc, kl_acc, mtp_acc, aux_acc, clip_acc, tokens = self.dist.sum_over_dp([
            loss_acc, pg_acc, kl_acc, mtp_acc, aux_acc, clip_acc,
            float(sum(it["ids"].numel() for it in items))])
        allr = torch.tensor(self.dist.gather_over_dp(torch.cat(rewards).tolist()))
        zero_var_groups, n_groups = self.dist.sum_over_dp([zero_variance_group_frac(rewards) * len(rewards),
                                                           float(len(rewards))])
        out.update(loss=loss_acc, pg_loss=pg_acc, kl_loss=kl_acc if self.ref_model is not None else None,
                   mtp_loss=mtp_acc if cfg.mtp_coef > 0 else None, grad_norm=gnorm,
                   indexer_loss=aux_acc if have_aux else None,
                   pg_clipfrac=clip_acc / max(total_tokens, 1.0), reward_mean=float(allr.mean()),
                   zero_variance_group_frac=zero_var_groups / max(n_groups, 1.0),
                   reward_std=float(allr.std(unbiased=False)), response_len_mean=total_tokens / n_samples,
                   tokens=int(tokens), response_tokens=int(total_tokens))
        return out

    def _engine_memory(self) -> Dict[str, Any]:
        """After the rollout (the leader): the bytes of weights the engine still holds (0 once released; engines
        that can say)."""
        held = getattr(self.engine, "held_bytes", None)
        return {} if held is None else {"engine_memory_gib": held() / 2**30}

    def _memory_phase_start(self) -> Dict[str, Any]:
        """After the rollout: on a GPU a fresh peak for the train phase (the run's peak so far is kept for
        ``peak_memory_gib``)."""
        out = {}
        if torch.cuda.is_initialized():
            self._peak_bytes = max(self._peak_bytes, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return out

    def _memory_phase_end(self) -> Dict[str, Any]:
        """The peak allocated while computing log-probs and training (the number colocation lowers)."""
        if not torch.cuda.is_initialized():
            return {}
        return {"train_peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}

    def _peak_memory_gib(self) -> Optional[float]:
        """The run's peak allocated device memory so far (rank 0's device)."""
        if not torch.cuda.is_initialized():
            return None
        return max(self._peak_bytes, torch.cuda.max_memory_allocated()) / 2**30

    def _group_tensors(self, samples, rewards: torch.Tensor) -> Dict[str, torch.Tensor]:
        c = self.model_config
        P = len(samples[0].prompt_ids)
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        # true_on_policy: the shape the engine drew every token with (train.engines, ReferenceEngine._generate_lockstep)
        ids = _pad_batch(seqs, self.tok.eos_token_id, P + self.cfg.max_new_tokens if self.cfg.true_on_policy else None)
        S = ids.shape[1]
        mask = torch.zeros(len(samples), S - 1, dtype=torch.bool)
        rollout_lp = torch.zeros(len(samples), S - 1)
        routed = None
        if self.cfg.routing_replay and all(s.routed_experts is not None for s in samples):
            routed = torch.full((len(samples), S, c.n_layers, c.n_activated_experts), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            R = len(s.response_ids)
            mask[i, P - 1:P - 1 + R] = True
            rollout_lp[i, P - 1:P - 1 + R] = s.logprobs.float()
            if routed is not None:
                re = s.routed_experts
                routed[i, :re.shape[0]] = re
        adv = group_advantages(rewards, normalize_std=self.cfg.normalize_adv_std)
        return {"ids": ids, "mask": mask, "rollout_lp": rollout_lp, "routed": routed, "adv": adv,
                "lengths": [len(q) for q in seqs]}

    def _sample_items(self, items):
        """The groups' samples regrouped into micro-batches of ``micro_batch_size`` rows (in order; rows padded
        to the longest sample of their micro-batch)."""
        flat = self._flat_samples(items)
        n = flat["ids"].shape[0]
        out = []
        for rows in self._row_chunks(n):
            idx = list(range(n))[rows]
            Sm = max(flat["lengths"][i] for i in idx)
            out.append({"ids": flat["ids"][rows, :Sm], "mask": flat["mask"][rows, :Sm - 1],
                        "rollout_lp": flat["rollout_lp"][rows, :Sm - 1], "adv": flat["adv"][rows],
                        "routed": None if flat["routed"] is None else flat["routed"][rows, :Sm],
                        "lengths": [flat["lengths"][i] for i in idx]})
        return out

    def _flat_samples(self, items):
        """Every group's rows in one batch, padded to the longest sample."""
        S = max(it["ids"].shape[1] for it in items)

        def pad(t, width, fill):
            if t.shape[1] == width:
                return t
            extra = torch.full((t.shape[0], width - t.shape[1]) + tuple(t.shape[2:]), fill, dtype=t.dtype)
            return torch.cat([t, extra], dim=1)

        routed = None
        if all(it["routed"] is not None for it in items):
            routed = torch.cat([pad(it["routed"], S, -1) for it in items])
        return {"ids": torch.cat([pad(it["ids"], S, self.tok.eos_token_id) for it in items]),
                "mask": torch.cat([pad(it["mask"], S - 1, False) for it in items]),
                "rollout_lp": torch.cat([pad(it["rollout_lp"], S - 1, 0.0) for it in items]),
                "adv": torch.cat([it["adv"] for it in items]), "routed": routed,
                "lengths": [n for it in items for n in it["lengths"]]}

    def _packed_items(self, items):
        """The groups' samples regrouped into packed micro-batches (core.packing, in order, never split):
        ``(items, packing efficiency)``; each item's rows are trimmed to its longest sample."""
        flat = self._flat_samples(items)
        lengths, routed = flat["lengths"], flat["routed"]
        mbs, eff = self._micro_batches(lengths)
        out = []
        for idx in mbs:
            Sm = max(lengths[i] for i in idx)
            out.append({"ids": flat["ids"][idx, :Sm], "mask": flat["mask"][idx, :Sm - 1],
                        "rollout_lp": flat["rollout_lp"][idx, :Sm - 1], "adv": flat["adv"][idx],
                        "routed": None if routed is None else routed[idx, :Sm],
                        "lengths": [lengths[i] for i in idx]})
        return out, eff

    # -- loop --------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        """Every rank runs the steps (their collectives); global rank 0 alone prints and writes the run
        folder; every rank writes its share of each checkpoint, and the final export gathers the full state."""
        from . import run_log

        main = self.dist.is_main
        logger = None
        last_row: Dict[str, Any] = {}
        try:                     # the engine is shut down however the run ends (a started server is stopped)
            logger = MetricsLogger(self.run_dir, start_step=self.start_step, trackers=self.cfg.tracker,
                                   config={**self._description(), "steps": self.steps}) if main else None
            with (run_log.file_log(self.run_dir) if main else contextlib.nullcontext()), run_log.step_progress(
                    self.mode, self.steps, self.start_step, enabled=self.progress and main) as bar:
                for line in (run_log.config_lines(self.run_config, self.cfg, mode=self.mode, steps=self.steps,
                                                  start_step=self.start_step, run_dir=self.run_dir,
                                                  source=self.source_desc) if main else ()):
                    run_log.log.info(line)
                if main:
                    run_log.log.info(f"optimizer: {self.optim.describe()}")
                if main and self.start_step >= self.steps:
                    run_log.log.info(f"{self.run_dir}: already at step {self.start_step} >= --steps {self.steps}")
                self.profiler = self._step_profiler()
                for step in range(self.start_step + 1, self.steps + 1):
                    t0 = time.perf_counter()
                    try:
                        with self.profiler.step(step) if self.profiler else contextlib.nullcontext():
                            row = self.grpo_step(step) if self.mode == "grpo" else self.sft_step(step)
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
                    row["lr"] = self.cfg.lr
                    row["wall_time"] = time.time()
                    row["world_size"] = self.dist.world
                    row["peak_memory_gib"] = self._peak_memory_gib()
                    last_row = row
                    if logger is not None:
                        logger.log(row)
                        bar.step(row)
                        run_log.log.debug("metrics " + json.dumps(row, sort_keys=True, default=str))
                    if step % self.cfg.save_every == 0 or (step == self.steps and self.cfg.save_at_end):
                        _maybe_kill(step, "checkpoint")
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
        """``profile_steps``: global rank 0 profiles the run's last steps (train.profiling); compiled blocks fuse
        across modules, so their profile has op names only."""
        n = self.cfg.profile_steps
        if n <= 0 or not self.dist.is_main or self.start_step >= self.steps:
            return None
        model = getattr(self.model, "module", None)
        model = model if isinstance(model, torch.nn.Module) else self.model
        return profiling.StepProfiler(model, self.run_dir, first=max(self.start_step + 1, self.steps - n + 1),
                                      last=self.steps, module_scopes=not self.cfg.compile_blocks)

    def _layout(self) -> Dict[str, int]:
        d = self.dist
        return {"world": d.world, "dp": d.dp, "tp": d.tp, "cp": d.cp, "ep": d.ep, "optimizer": self.optim.kind}


def _rollout_engine(run_config, model_config, dtype, **options):
    """The run's rollout engine (``core.assembly``), in the run's dtype; ``options`` (the trainer's settings,
    run folder, publish format, a started server's ``model_path``) go to its factory
    (``core.protocols.EngineFactory``). Without a run config (tests of the loop itself on the reference
    model) the built-in reference engine."""
    if run_config is not None and run_config.orchestrator == "ray":   # this rank's engine actor (train.ray_launch)
        from .ray_engines import rank_engine

        return rank_engine()
    if run_config is None:
        from .engines import make_reference_engine

        return make_reference_engine(model_config, dtype=dtype, **options)
    from core.assembly import assemble

    return assemble(run_config).rollout_engine(model_config, dtype=dtype, **options)


def run_training(run_config, model_source, *, mode: str, steps: int, run_dir, resume: bool = False,
                 config: Optional[TrainConfig] = None, progress: bool = True, ray_address: Optional[str] = None,
                 ray_max_restarts: Optional[int] = None, **overrides) -> Dict[str, Any]:
    """Train for ``steps`` steps (in total, counting the steps of a resumed run).

    ``run_config``: a :class:`core.run_config.RunConfig` (or None); ``model_source``: an HF-format
    checkpoint folder, a preset name (random init) or a ModelConfig; ``mode``: "sft" | "grpo";
    ``config``: a :class:`TrainConfig`, with ``overrides`` (field=value) applied on top. Returns a dict
    with the run folder, the start step and the last metrics row.

    Ranks (:mod:`train.launch`): inside torchrun / srun (torch.distributed's environment) this process is one
    rank of ``run_config.world``; otherwise a run of several ranks starts them here as local workers through
    torch.distributed's elastic launcher and returns rank 0's result. ``run_config.orchestrator == "ray"``: the
    ranks and rollout engines are actors on the Ray cluster at ``ray_address`` (:mod:`train.ray_launch`).
    """
    from .launch import joined_ranks, launch_local_ranks

    from .trackers import check_available

    cfg = dataclasses.replace(config or TrainConfig(), **overrides)
    check_available(cfg.tracker)                   # a tracker's missing library: one line, before any work
    check_mode(mode, cfg)
    world = 1 if run_config is None else run_config.world
    if run_config is not None:
        check_divisible(run_config, mode, cfg)     # before any rank starts
        check_train_options(run_config, cfg)
    # one writer per run folder (train.run_claim: lock, resume checks); a failed start leaves no run folder
    with claimed_run_folder(run_dir, resume=resume, steps=steps):
        if run_config is not None and run_config.orchestrator == "ray":
            from .ray_launch import run_on_ray

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            return run_on_ray(run_config, _rank_main, model_config=_resolve_model_config(run_config, model_source)[0],
                              model_source=model_source, mode=mode, steps=steps,
                              run_dir=run_dir, resume=resume, cfg=cfg, progress=progress, address=ray_address,
                              max_restarts=ray_max_restarts)
        if world > 1 and not joined_ranks():
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            return launch_local_ranks(run_config, _rank_main, (run_config, model_source, mode, steps, str(run_dir),
                                                               resume, cfg, progress))
        return _rank_main(run_config, model_source, mode, steps, run_dir, resume, cfg, progress)


def _rank_main(run_config, model_source, mode, steps, run_dir, resume, cfg, progress) -> Dict[str, Any]:
    """One rank's run: join the run's process groups (torchrun's environment), train."""
    from .launch import init_rank

    if run_config is not None and run_config.world > 1:
        init_rank(run_config, rendezvous_timeout_s=cfg.rendezvous_timeout_s)
    return _Run(run_config, model_source, mode, steps, run_dir, resume, cfg, progress).run()
