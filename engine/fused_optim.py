"""Fused multi-tensor kernels for megatron-core's distributed optimizer when neither Transformer Engine nor Apex
is installed (the GPU machines this project is measured on have neither).

Why: without them megatron-core 0.19 falls back to

* ``torch.optim.AdamW`` in its default *foreach* mode: about six passes over the fp32 master weights, moments
  and gradients (measured on one H200 at flash-shaped: about 150 ms of device time per step);
* ``megatron.core.utils.local_multi_tensor_l2_norm`` for the gradient norm: one ``torch.norm`` per tensor and
  ``torch.tensor(list of CUDA scalars)``, which reads every norm back to the host (about 900 host
  synchronisations per step at flash-shaped);
* ``local_multi_tensor_scale``: one ``dst.copy_(src * scale)`` per tensor.

What this installs instead (torch's own kernels, the same math):

* :func:`use_fused_adam`: torch's fused AdamW (``fused=True``: one multi-tensor CUDA kernel updates parameters
  and both moments of every tensor in a pass), set on the optimizer's param groups before any state exists;
* :func:`foreach_l2_norm`: ``torch._foreach_norm`` over the tensors and one norm of the norms, left on the
  device (megatron-core reads it back once, for the step's clipping and its metric);
* :func:`foreach_scale`: ``torch._foreach_mul_`` / ``torch._foreach_copy_`` over the tensor lists;
* :func:`clipped`: gradient clipping folded into the fused AdamW kernel (its ``grad_scale`` input divides every
  gradient as it is read), instead of a pass that rewrites every fp32 gradient (about 13 ms of the step);
* :func:`fuse_master_copy` (CUDA with Triton): the whole step in one Triton kernel (``kernels.triton.adamw``):
  AdamW on every fp32 master shard writes the bf16 model weight beside it, in place of megatron-core's copy of
  the masters into the model afterwards, and raises a flag when a weight it wrote is non-finite, in place of
  the trainer's check pass over every weight (:meth:`TritonAdamW.weights_finite`).

Only megatron-core's own fallbacks are replaced: with Apex or Transformer Engine present their fused kernels stay
(:func:`install` says which ran in its description).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Sequence

import torch


def foreach_l2_norm(chunk_size: int, noop_flag, tensor_lists: Sequence[List[torch.Tensor]], per_tensor: bool,
                    *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm``: ``(norm of all tensors as a [1] fp32 tensor, None)``, with no
    host synchronisation."""
    if per_tensor:
        raise ValueError("foreach_l2_norm: per-tensor norms are not used by the trainer")
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=_device(tensor_lists)), None
    norms = torch._foreach_norm(tensors, 2)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag, tensor_lists: Sequence[List[torch.Tensor]], scale: float):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst[i] = src[i] * scale`` over two lists."""
    src, dst = tensor_lists
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        if scale != 1.0:
            torch._foreach_mul_(list(dst), scale)
        return
    torch._foreach_copy_(list(dst), list(src))
    if scale != 1.0:
        torch._foreach_mul_(list(dst), scale)


def _device(tensor_lists) -> torch.device:
    for ts in tensor_lists:
        for t in ts:
            return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def use_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a torch ``Adam`` / ``AdamW`` to its fused kernel (before its first step: the step counters are
    then created on the device, as the fused kernel needs). False when it is another optimizer, or its
    parameters are not all on a device the fused kernel supports."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(optimizer.state.get(p) for p in params):
        raise RuntimeError("use_fused_adam: the optimizer has already stepped; switch it before its first step")
    if not params or any(p.device.type not in ("cuda", "cpu") or not p.is_floating_point() for p in params):
        return False
    for g in optimizer.param_groups:
        g["fused"], g["foreach"] = True, False
    optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, False
    return True


def install(torch_optimizers: Sequence[torch.optim.Optimizer]) -> Dict[str, str]:
    """Use the fused kernels in megatron-core's optimizer modules (where they fell back) and in the torch
    optimizers it built; returns what runs, for the run's description."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer as mcore_optimizer

    out = {}
    if clip_grads.l2_norm_impl is getattr(mcore_utils, "local_multi_tensor_l2_norm", None):
        clip_grads.l2_norm_impl = foreach_l2_norm
    if clip_grads.l2_norm_impl is foreach_l2_norm:           # (installed by an earlier optimizer of this process)
        out["grad_norm"] = "torch._foreach_norm (on the device)"
    else:
        out["grad_norm"] = f"{getattr(clip_grads.l2_norm_impl, '__module__', '?')} multi_tensor_l2norm"
    local_scale = getattr(mcore_utils, "local_multi_tensor_scale", None)
    for mod in (clip_grads, mcore_optimizer):
        if getattr(mod, "multi_tensor_scale_impl", None) is local_scale:
            mod.multi_tensor_scale_impl = foreach_scale
    fused = [use_fused_adam(o) for o in torch_optimizers]
    out["adam"] = ("torch fused AdamW" if fused and all(fused) else
                   ", ".join(sorted({type(o).__module__ + "." + type(o).__name__ for o in torch_optimizers})))
    return out


def install_triton_adam(parts) -> bool:
    """:func:`fuse_master_copy` on every part (megatron-core ``DistributedOptimizer``) of the trainer's optimizer;
    True when every part runs the one-pass Triton kernel (then the trainer's weight check is its flag)."""
    done = [fuse_master_copy(part, part.optimizer) for part in parts]
    return bool(done) and all(done)


@contextlib.contextmanager
def clipped(torch_optimizers: Sequence[torch.optim.Optimizer], coef: float):
    """Inside: the optimizers' next ``step()`` sees every gradient times ``coef`` (clipping by the global norm).
    A fused Adam applies it in its own kernel (``grad_scale = 1 / coef``); any other optimizer's gradients
    are scaled here, in one multi-tensor pass."""
    scaled = []
    if coef != 1.0:
        for o in torch_optimizers:
            params = [p for g in o.param_groups for p in g["params"] if p.grad is not None]
            if not params:
                continue
            if all(g.get("fused") for g in o.param_groups):
                o.grad_scale = torch.full((), 1.0 / coef, dtype=torch.float32, device=params[0].device)
                scaled.append(o)
            else:
                torch._foreach_mul_([p.grad for p in params], coef)
    try:
        yield
    finally:
        for o in scaled:
            del o.grad_scale


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW whose ``step()`` is ``kernels.triton.adamw``'s one-pass kernel over every tensor of a group.
    The state is torch's fused AdamW's (``step`` an fp32 tensor on the device, ``exp_avg``, ``exp_avg_sq``), so
    megatron-core's state handling and the trainer's checkpoints see a torch AdamW. ``model_outputs`` maps a
    master to the bf16 model weight the kernel writes beside it (:func:`fuse_master_copy`)."""

    model_outputs: Dict[torch.Tensor, torch.Tensor]
    moments_dtype: torch.dtype = torch.float32      # adam_moments_dtype: bf16 moments are the kernel's too

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW: closures are not supported")
        flag = self._finite_flag()
        flag.zero_()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("TritonAdamW: amsgrad and maximize are not supported")
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype,
                                                        memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            steps = [st["step"] for st in states]
            if steps:
                torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            self._kernel().step(params, [p.grad for p in params], [st["exp_avg"] for st in states],
                                [st["exp_avg_sq"] for st in states], steps,
                                [self.model_outputs.get(p) for p in params], [group["weight_decay"]] * len(params),
                                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                grad_scale=getattr(self, "grad_scale", None), flag=flag)

    @contextlib.contextmanager
    def masters_only(self):
        """Inside: a step updates the masters and moments only. megatron-core creates the state before a
        checkpoint load with a dummy step (``_init_optimizer_states_with_dummy_values``: zero gradients, the run's
        lr); written through, it would replace the model weights just loaded with the masters of before the load."""
        outs, self.model_outputs = self.model_outputs, {}
        try:
            yield
        finally:
            self.model_outputs = outs

    def weights_finite(self) -> torch.Tensor:
        """A device bool: every weight the last step wrote (masters, and the bf16 weights beside them) is finite."""
        return self._finite_flag()[0] == 0

    def _finite_flag(self) -> torch.Tensor:
        if getattr(self, "_flag", None) is None:
            device = next(p.device for g in self.param_groups for p in g["params"])
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._flag

    def _kernel(self):
        if getattr(self, "_multi", None) is None:
            from kernels.triton.adamw import MultiTensorAdamW

            self._multi = MultiTensorAdamW()
        return self._multi


def use_bf16_moments(parts, triton_adam: bool) -> None:
    """``adam_moments_dtype=bf16``: the Triton AdamW of every part (megatron-core ``DistributedOptimizer``) keeps
    both moments in bf16; refused where that kernel does not run (no other optimizer here keeps bf16 moments)."""
    if not triton_adam:
        from core.config import ConfigError

        why = triton_adam_refusal([p for part in parts for g in part.optimizer.param_groups for p in g["params"]])
        raise ConfigError(f"training option 'adam_moments_dtype' = bf16 needs the Triton AdamW, which cannot run "
                          f"here ({why or 'an optimizer layout it does not serve'}). Fix: adam_moments_dtype=fp32")
    for part in parts:
        part.optimizer.moments_dtype = torch.bfloat16


def triton_adam_refusal(params) -> str:
    """Why :class:`TritonAdamW` cannot step these parameters here ("" when it can)."""
    if not params or any(p.device.type != "cuda" or p.dtype != torch.float32 or not p.is_contiguous() for p in params):
        return "the masters are not contiguous fp32 CUDA tensors"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return ""


def fuse_master_copy(part, optimizer: torch.optim.Optimizer) -> bool:
    """Make the torch AdamW of one megatron-core ``DistributedOptimizer`` (``part``) a :class:`TritonAdamW` that
    writes each bf16 model weight shard where megatron-core's ``_copy_main_params_to_model_params`` would copy it
    (the shard's range of its bucket's ``param_data``), and turn that copy off. Where a model weight is fp32, its
    master is that very range already (megatron-core keeps fp32 weights as their own masters) and nothing is
    written. False (nothing changed) when the layout is not this one, or the kernel cannot run."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or any(optimizer.state.get(p) for g in
                                                                         optimizer.param_groups for p in g["params"]):
        return False
    if triton_adam_refusal([p for g in optimizer.param_groups for p in g["params"]]):
        return False
    outs = {}
    pairs = [(part.shard_fp32_from_float16_groups, part.model_float16_groups, True),
             (part.shard_fp32_groups, part.model_fp32_groups, False)]
    for main_groups, model_groups, low_precision in pairs:
        for main_group, model_group in zip(main_groups, model_groups):
            for main, model_param in zip(main_group, model_group):
                world = part._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf, _dtype, bucket = part.model_param_gbuf_map[model_param]
                shard = part.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start:world.end]
                if shard.numel() != main.numel():
                    return False
                if low_precision:
                    if shard.dtype != torch.bfloat16:
                        return False
                    outs[main] = shard
                elif shard.data_ptr() != main.data_ptr():
                    return False
    optimizer.__class__ = TritonAdamW
    optimizer.model_outputs = outs
    part._copy_main_params_to_model_params = lambda: None       # the kernel wrote the model weights
    return True
