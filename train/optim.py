"""The trainer's optimizer: gradient reduction over data parallel, clipping and AdamW, in two builds.

* :class:`MegatronOptimizer` (GPU targets): megatron-core's ``DistributedDataParallel`` (gradients accumulated
  in fp32 in contiguous buckets, a step's first one copied in: ``engine.grad_buffers``, and reduced bucket by
  bucket) and its ``DistributedOptimizer`` (fp32 master
  weights and Adam moments sharded over the data-parallel ranks; the bf16 model weights are refreshed from
  the masters after each step). Gradients are SUMMED, not averaged (``calculate_per_token_loss``): the trainer
  divides every loss by the step's global token count, so the sum is the one-rank gradient. The reduce runs
  after the last backward of the step (``overlap_grad_reduce`` off): some parameters get no gradient in some
  steps (the miles indexer without its loss, experts no token reached), and an overlapped reduce waits for
  every parameter of a bucket.
* :class:`TorchOptimizer` (the CPU target; megatron-core's optimizer allocates CUDA tensors): the same
  reduction written with ``torch.distributed`` (one coalesced all-reduce per group: dense parameters over
  data x context parallel, routed experts over the expert-data-parallel group), the global gradient norm
  (tensor-parallel shards and expert-parallel banks summed once), clipping and ``torch.optim.AdamW`` on the
  model's own parameters (fp32, the CPU default), with megatron-core's update rules: no weight decay on
  one-dimensional parameters and biases, and a parameter that got no gradient is stepped with a zero one.

Both return the pre-clip global gradient norm from :meth:`step`, refuse a non-finite norm BEFORE updating
(``train.step_guard``), and describe their state for checkpoints the same way (one code path for both):
:meth:`shard_state` gives, per ``"<parameter>/<key>"``, the FULL tensor's shape and the pieces of it this
rank holds (``engine.tp.tp_pieces``: its tensor-parallel slice, its experts, and for the distributed
optimizer its data-parallel range of the flat fp32 state), views of the live state, nothing gathered;
:meth:`load_shard_state` fills the same pieces of this rank's state from a checkpoint written by any layout.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

from engine.tp import full_shape, tp_pieces, tp_spec

from engine.fused_optim import clipped
from engine.grad_allreduce import all_reduce_grads

STATE_KEYS = ("exp_avg", "exp_avg_sq")
MASTER = "master"          # the fp32 master weights (kept when the model computes in bf16)


def _is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _pieces(p: torch.nn.Parameter, flat: torch.Tensor, start: int = 0):
    """``(full shape, pieces)`` of the elements ``[start, start + flat.numel())`` of this rank's ``p``-shaped
    tensor flattened (``flat``): where they lie in the FULL parameter (``engine.tp.tp_pieces``)."""
    rank, world = 0, 1
    if _initialized():
        from engine.layout import current as parallel_layout

        layout = parallel_layout()

        rank, world = layout.tp_rank, layout.tp
    spec = tp_spec(p)
    return full_shape(p.shape, spec, world), tp_pieces(flat, tuple(p.shape), start, spec, rank, world)


class _Base:
    def __init__(self, model, cfg):
        self.model, self.cfg = model, cfg
        self.named = dict(_named_parameters(model))
        self.params = list(self.named.values())

    def zero_grad(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """What updates the weights (the run log's configuration lines)."""
        return f"torch.optim.AdamW ({self.kind})"

    def no_sync(self):
        """Context for every backward of the step but the last (gradient accumulation)."""
        import contextlib

        return contextlib.nullcontext()

    def grad_tensors(self) -> Iterable[Tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def weights_finite(self):
        """True when the step itself checked every weight it wrote (then the trainer skips its own pass)."""
        return None

    def _check(self, gnorm: float) -> None:
        """A non-finite gradient norm stops the run before the update, naming the first bad tensor."""
        from core.finite import check_finite, check_finite_number

        if math.isfinite(gnorm):
            return
        check_finite(self.grad_tensors(), where="gradient")
        check_finite_number("the gradient norm", gnorm, where="gradient")


def _named_parameters(model) -> List[Tuple[str, torch.nn.Parameter]]:
    """Trainable parameters under the names checkpoints use: the implementation module's own (native) names,
    or the reference model's official ones."""
    inner = getattr(model, "module", None)
    inner = inner if isinstance(inner, torch.nn.Module) else getattr(model, "model", model)
    return [(n, p) for n, p in inner.named_parameters() if p.requires_grad]


class TorchOptimizer(_Base):
    """``torch.optim.AdamW`` with the trainer's gradient reduction (see the module docstring)."""

    kind = "torch"

    def __init__(self, model, cfg):
        super().__init__(model, cfg)
        self.opt = torch.optim.AdamW(weight_decay_groups(self.named, cfg.weight_decay), lr=cfg.lr,
                                     betas=tuple(cfg.betas))

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def grad_tensors(self):
        return ((n, p.grad) for n, p in self.named.items() if p.grad is not None)

    def _reduce(self) -> None:
        if not _initialized():
            return
        from engine.layout import current

        layout = current()
        dense = [p for p in self.params if not _is_expert(p)]
        experts = [p for p in self.params if _is_expert(p)]
        all_reduce_grads(dense, layout.group("dp_cp"))
        all_reduce_grads(experts, layout.group("expert_dp"))

    def _global_norm(self) -> float:
        """sqrt of the sum of squares of the FULL model's gradients: replicated tensors counted once, tensor-
        parallel shards summed over tensor parallel, expert banks over expert parallel."""
        replicated = torch.zeros((), dtype=torch.float64)
        tp_sharded = torch.zeros((), dtype=torch.float64)
        experts = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum().cpu()
            if _is_expert(p):
                experts += sq
            elif tp_spec(p) is not None:
                tp_sharded += sq
            else:
                replicated += sq
        if _initialized():
            from engine.layout import current

            layout = current()
            if layout.tp > 1:
                dist.all_reduce(tp_sharded, group=layout.group("tp"))
            # expert banks: split over expert parallel, and (as tensors) over the expert tensor-parallel group
            if layout.ep > 1:
                dist.all_reduce(experts, group=layout.group("ep"))
            if layout.etp > 1:
                dist.all_reduce(experts, group=layout.group("etp"))
            if layout.pp > 1:          # each pipeline stage holds its own parameters
                dist.all_reduce(replicated.add_(tp_sharded).add_(experts), group=layout.group("pp"))
                tp_sharded.zero_(), experts.zero_()
        return float((replicated + tp_sharded + experts).sqrt())

    def step(self) -> float:
        self._reduce()
        gnorm = self._global_norm()
        self._check(gnorm)
        clip = self.cfg.grad_clip
        if clip > 0:
            coef = clip / (gnorm + 1e-6)
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.detach().mul_(coef)
        for p in self.params:          # megatron-core's optimizer steps every parameter, with a zero gradient
            if p.grad is None:         # where none arrived (its fp32 buffer): decay and moments move alike here
                p.grad = torch.zeros_like(p)
        self.opt.step()
        return gnorm

    # -- checkpoints -----------------------------------------------------------
    @torch.no_grad()
    def shard_state(self):
        """``({"<param>/<key>": (full shape, this rank's pieces)}, {param: Adam step count})``; collective only
        for the step counts under expert parallelism. A parameter never updated has zero moments and step 0."""
        steps, out = {}, {}
        for n, p in self.named.items():
            st = self.opt.state.get(p, {})
            steps[n] = int(st["step"]) if "step" in st else 0
            for k in STATE_KEYS:
                t = st[k].detach() if k in st else torch.zeros_like(p)
                out[f"{n}/{k}"] = _pieces(p, t.reshape(-1))
        return out, _every_rank_steps(steps)

    @torch.no_grad()
    def load_shard_state(self, read, steps: Dict[str, int]) -> None:
        """``read({name: pieces})`` fills the pieces from a checkpoint; this rank's state is rebuilt from them."""
        bufs = {n: {k: torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for k in STATE_KEYS}
                for n, p in self.named.items() if steps.get(n)}
        read({f"{n}/{k}": _pieces(self.named[n], buf)[1] for n, by_key in bufs.items() for k, buf in by_key.items()})
        for n, p in self.named.items():
            if n not in bufs:
                self.opt.state.pop(p, None)    # never updated: AdamW starts its state on the first gradient
                continue
            self.opt.state[p] = {"step": torch.tensor(float(steps[n])),
                                 **{k: bufs[n][k].view(p.shape) for k in STATE_KEYS}}


def weight_decay_groups(named: Dict[str, torch.nn.Parameter], weight_decay: float) -> List[dict]:
    """AdamW parameter groups with megatron-core's default rule (``megatron.core.optimizer``: no weight decay on
    one-dimensional parameters and biases: norms, sinks, scales), so the CPU target's optimizer takes the step
    of the GPU targets' distributed optimizer."""
    decay = [p for n, p in named.items() if p.ndim > 1 and not n.endswith(".bias")]
    keep = [p for n, p in named.items() if p.ndim <= 1 or n.endswith(".bias")]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0})
            if g["params"]]


def scheduled_groups(groups: List[dict], cfg) -> None:
    """Give each of megatron-core's parameter groups the learning rate and weight decay its multipliers ask for.
    megatron-core marks the groups (``wd_mult`` 0 for one-dimensional parameters and biases, ``lr_mult``) and
    leaves the multiplying to its ``OptimizerParamScheduler.step``, which this trainer (constant lr) does not run:
    without this every group took the full weight decay on a GPU, norms and biases too (found by
    tests/train/test_fused_optim_gpu.py against :class:`TorchOptimizer`)."""
    for g in groups:
        g["lr"] = cfg.lr * g.get("lr_mult", 1.0)
        g["weight_decay"] = cfg.weight_decay * g.get("wd_mult", 1.0)


def _every_rank_steps(steps: Dict[str, int]) -> Dict[str, int]:
    """Merge the step counts of every expert-parallel rank (each holds other experts) and pipeline stage."""
    from engine.layout import current as parallel_layout

    layout = parallel_layout()
    if not _initialized() or layout.ep * layout.pp == 1:
        return steps
    parts = [None] * layout.ep
    dist.all_gather_object(parts, steps, group=layout.group("ep"))
    if layout.pp > 1:
        from engine.pipeline import gather_over_stages

        parts = [p for stage in gather_over_stages(parts, layout) for p in stage]
    merged: Dict[str, int] = {}
    for part in parts:
        for n, v in part.items():
            merged[n] = max(merged.get(n, 0), v)
    return merged


def _max_step(step: int) -> int:
    if not _initialized():
        return step
    from .distributed import collective_device

    t = torch.tensor([step], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class MegatronOptimizer(_Base):
    """megatron-core DDP + DistributedOptimizer (see the module docstring)."""

    kind = "megatron-distributed"

    def __init__(self, model, cfg, *, dtype: torch.dtype, kernel_backend: str = "none", fuse_wgrad: bool = False):
        super().__init__(model, cfg)
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        from engine.grad_buffers import CopyFirstDDP

        inner = model.module
        for p in self.params:
            if _is_expert(p):
                p.allreduce = False          # megatron-core: reduced over the expert-data-parallel group
        bf16 = dtype == torch.bfloat16
        tconfig = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, bf16=bf16,
                                    params_dtype=dtype, calculate_per_token_loss=True)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True, bucket_size=40_000_000)
        # a step's first gradient copied, not added; by the Triton cast kernel in a triton/cuda backend's run
        self.ddp = CopyFirstDDP(tconfig, ddp_config, inner, kernel_backend=kernel_backend)
        beta1, beta2 = tuple(cfg.betas)
        oconfig = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  adam_beta1=beta1, adam_beta2=beta2, bf16=bf16, params_dtype=dtype,
                                  use_distributed_optimizer=True, clip_grad=cfg.grad_clip)
        self.opt = get_megatron_optimizer(oconfig, [self.ddp])
        for part in self._parts():
            scheduled_groups(part.optimizer.param_groups, cfg)
        from engine.fused_optim import install, install_triton_adam, use_bf16_moments

        # torch's fused AdamW and a device-side gradient norm where megatron-core fell back to unfused ones; on a
        # GPU with Triton, one kernel for AdamW, the bf16 weights and their finite check
        self.kernels = install([part.optimizer for part in self._parts()])
        self.triton_adam = install_triton_adam(self._parts())
        if cfg.adam_moments_dtype == "bf16":
            use_bf16_moments(self._parts(), self.triton_adam)
        if self.triton_adam:
            self.kernels["adam"] = "Triton one-pass AdamW writing the bf16 weights (kernels.triton.adamw)"
        self.wgrad_fusion = None               # counts of what writes its weight gradient into the fp32 buffer
        if fuse_wgrad:
            from engine.wgrad_fusion import enable

            self.wgrad_fusion = enable(inner)

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def no_sync(self):
        return self.ddp.no_sync()

    def grad_tensors(self):
        return ((n, p.main_grad) for n, p in self.named.items() if getattr(p, "main_grad", None) is not None)

    def step(self) -> float:
        """Reduce, one global gradient norm (its one host read), the check, clipping, Adam on the fp32 shards and
        the copy back into the model's weights. megatron-core's own ``step()`` would prepare the gradients and
        compute the norm a second time; its pieces are called once each instead."""
        self.ddp.settle_grad_buffer()              # zero what no backward reached (nothing was zeroed up front)
        self.ddp.finish_grad_sync()                # bucketed reduce-scatter of the fp32 gradients
        self.opt.prepare_grads()                   # the fp32 shards' .grad: views of the reduced buffer
        gnorm = float(self.opt.get_grad_norm())
        self._check(gnorm)                         # before anything is updated
        clip = self.cfg.grad_clip
        coef = min(1.0, clip / (gnorm + 1e-6)) if clip > 0 else 1.0   # megatron-core's clip_grad_by_total_norm_fp32
        with clipped([part.optimizer for part in self._parts()], coef):   # inside the fused Adam kernel
            if not self.opt.step_with_ready_grads():   # Adam on the fp32 shards, copy back (and all-gather)
                raise RuntimeError("megatron-core's optimizer skipped the step")
        return gnorm

    def describe(self) -> str:
        f = self.wgrad_fusion
        wgrad = f"written by their GEMMs (kernels.wgrad; {f['expert_banks']} expert banks)" if f else \
            "cast in (engine.grad_buffers)"
        return (f"megatron-core DistributedOptimizer: {self.kernels['adam']}, gradient norm {self.kernels['grad_norm']}"
                f", fp32 weight gradients {wgrad}")

    def weights_finite(self):
        """Whether every weight the last step wrote is finite, from the Triton kernel's flags (one host read, the
        flags of every rank combined); None without that kernel."""
        if not self.triton_adam:
            return None
        ok = torch.stack([part.optimizer.weights_finite() for part in self._parts()]).all().to(torch.int32)
        if _initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok)

    def _parts(self):
        """The distributed optimizers megatron-core built (a ChainedOptimizer holds several)."""
        return list(getattr(self.opt, "chained_optimizers", None) or [self.opt])

    def _main_map(self) -> Dict[torch.nn.Parameter, tuple]:
        """model parameter -> ``(part, fp32 main shard, start, end)``: the pairing megatron-core itself uses to
        copy masters back into the model (``model_*_groups`` beside ``shard_fp32_*_groups``); the torch
        optimizer's state is keyed by the main shard, ``[start, end)`` is its range of the flat parameter."""
        if getattr(self, "_mains", None) is None:
            mains = {}
            for part in self._parts():
                pairs = [(part.model_float16_groups, part.shard_fp32_from_float16_groups),
                         (part.model_fp32_groups, part.shard_fp32_groups)]
                for model_groups, main_groups in pairs:
                    for model_group, main_group in zip(model_groups, main_groups):
                        for model_param, main in zip(model_group, main_group):
                            r = part._get_model_param_range_map(model_param)["param"]
                            if main.numel() != r.end - r.start:
                                raise RuntimeError(f"megatron-core's optimizer shard of a {tuple(model_param.shape)} "
                                                   f"parameter has {main.numel()} elements, its range {r.start}:{r.end}")
                            mains[model_param] = (part, main, r.start, r.end)
            self._mains = mains
        return self._mains

    def _ranges(self, p):
        return self._main_map().get(p)

    def _states(self, p) -> Dict[str, torch.Tensor]:
        """``{"param": fp32 main shard, "exp_avg", "exp_avg_sq", "step"}`` of this rank's range of ``p``."""
        part, main, _s, _e = self._main_map()[p]
        return {"param": main, **{k: v for k, v in part.optimizer.state.get(main, {}).items()
                                  if isinstance(v, torch.Tensor)}}

    @torch.no_grad()
    def shard_state(self):
        """Like :meth:`TorchOptimizer.shard_state`, with the fp32 master weights (``"<param>/master"``): each
        data-parallel rank gives its range of every parameter's flat state, straight from megatron-core's
        shard buffers; the ranges of all data-parallel ranks tile each parameter."""
        step, out = 0, {}
        for n, p in self.named.items():
            rng = self._ranges(p)
            if rng is None:
                continue                                   # other data-parallel ranks hold all of it
            _part, main, start, end = rng
            st = self._states(p)
            if "step" in st:
                step = max(step, int(st["step"]))
            for k in (MASTER, *STATE_KEYS):
                t = st.get("param" if k == MASTER else k)
                t = torch.zeros(end - start, dtype=torch.float32, device=main.device) if t is None else t.detach()
                out[f"{n}/{k}"] = _pieces(p, t.reshape(-1), start)
        step = _max_step(step)        # one Adam over the data-parallel shards: every parameter steps together
        return out, _every_rank_steps({n: step for n in self.named})

    @torch.no_grad()
    def load_shard_state(self, read, steps: Dict[str, int]) -> None:
        step = max(steps.values(), default=0)
        for part in self._parts():
            with getattr(part.optimizer, "masters_only", contextlib.nullcontext)():   # (the model is loaded)
                part._init_optimizer_states_with_dummy_values()
        wanted, counters = {}, []
        for n, p in self.named.items():
            rng = self._ranges(p)
            if rng is None:
                continue
            start = rng[2]
            for k, t in self._states(p).items():
                if k == "step":
                    counters.append(t)
                    continue
                wanted[f"{n}/{MASTER if k == 'param' else k}"] = _pieces(p, t.view(-1), start)[1]
        read(wanted)                                       # straight into megatron-core's shard buffers
        for t in counters:
            t.fill_(float(step))


def build_optimizer(model, cfg, run_config=None):
    """The run's optimizer: megatron-core's distributed optimizer on a GPU target, else torch's AdamW."""
    gpu = run_config is not None and run_config.selection.hardware.gpu and hasattr(model, "module")
    if gpu:
        from engine.wgrad_fusion import resolve

        fuse = resolve(cfg.wgrad_fusion, True, run_config.torch_dtype, bool(cfg.compile_blocks))
        return MegatronOptimizer(model, cfg, dtype=run_config.torch_dtype, kernel_backend=run_config.kernel_backend,
                                 fuse_wgrad=fuse)
    return TorchOptimizer(model, cfg)
