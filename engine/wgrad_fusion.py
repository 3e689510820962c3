"""The training option ``wgrad_fusion``: weight gradients written by their GEMMs straight into megatron-core's
fp32 gradient buffer (``kernels.wgrad``), turned on for a model its optimizer has wrapped.

Which GEMMs: megatron-core's Column/RowParallelLinear (attention projections, shared experts, the MTP
projections of the megatron implementation) take their own ``gradient_accumulation_fusion`` path, which calls
Apex's ``fused_weight_gradient_mlp_cuda``; :func:`enable` hands megatron-core's layers module
``kernels.wgrad.APEX_API`` under that name and switches the path on per layer. The project's linears
(``engine.layers.Linear``, and ``kernels.reference.layers.linear_fp32``: the output head, the compressor
projections) read the parameter's ``fuse_wgrad`` flag that :func:`enable` sets. The routed experts' banks
(``engine.moe._WeightBank``, a grouped GEMM) write theirs with one mixed-dtype cuBLAS GEMM per expert
(``kernels.wgrad.grouped_wgrad_gemms``).

Where it applies: a bf16 model wrapped by ``engine.grad_buffers.CopyFirstDDP`` (the GPU targets' optimizer;
every trained parameter has its fp32 ``main_grad``) on CUDA, eager. ``auto`` turns it on there; ``on`` refuses a
run where it cannot apply (:func:`refusal`); under ``--compile`` it stays off (a compiled backward cannot write
the buffer from inside the graph).
"""

from __future__ import annotations

import torch

from kernels import wgrad

__all__ = ["MODES", "enable", "refusal", "resolve"]

MODES = ("auto", "on", "off")


def refusal(gpu: bool, dtype: torch.dtype, compiled: bool) -> str:
    """Why the fusion cannot apply to a run ("" when it can): it needs a GPU target's optimizer (the fp32
    gradient buffers), bf16 weights and an eager model."""
    if not gpu:
        return "it writes megatron-core's fp32 gradient buffers, which only the GPU targets' optimizer keeps"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} weights (the fused GEMM takes bf16 or fp16 operands and writes fp32)"
    if compiled:
        return "--compile (a compiled backward cannot write the gradient buffer from inside its graph)"
    return ""


def resolve(mode: str, gpu: bool, dtype: torch.dtype, compiled: bool) -> bool:
    """``auto`` / ``on`` / ``off`` -> whether the run fuses; ``on`` where :func:`refusal` objects raises."""
    if mode not in MODES:
        raise ValueError(f"wgrad_fusion must be one of {', '.join(MODES)}, not {mode!r}")
    why = refusal(gpu, dtype, compiled)
    if mode == "on" and why:
        from core.config import ConfigError

        raise ConfigError(f"training option 'wgrad_fusion' = on cannot apply: {why}. Fix: wgrad_fusion=auto or off")
    return mode != "off" and not why


def _megatron_linear_types() -> tuple:
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = wgrad.APEX_API     # what the layers call under that name
    return layers.ColumnParallelLinear, layers.RowParallelLinear


def enable(model: torch.nn.Module) -> dict:
    """Fuse the weight gradients of every trained parameter of ``model`` that has a ``main_grad`` (call after the
    optimizer's DDP wrapped it), the routed experts' banks included: theirs with one cuBLAS GEMM per expert
    (``kernels.wgrad.grouped_wgrad_gemms``), for every kernel backend. The Triton grouped kernel
    (``kernels.triton.grouped_wgrad``) is not chosen: it ran below those GEMMs at the Flash shapes
    (bench/results/kernels-grouped-wgrad-gemms-h200.json).
    Returns counts: ``{"megatron_linears", "expert_banks", "parameters"}``."""
    from engine.moe import _WeightBank

    linear_types = _megatron_linear_types()
    banks = 0
    for module in model.modules():
        if isinstance(module, _WeightBank) and module.experts()[0].is_cuda \
                and all(getattr(p, "main_grad", None) is not None for p in module.experts()):
            module.wgrad_fused = True
            banks += 1
    layers = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, linear_types) and isinstance(w, torch.Tensor) and w.requires_grad \
                and getattr(w, "main_grad", None) is not None:
            module.gradient_accumulation_fusion = True
            layers += 1
    params = 0
    for p in model.parameters():
        if p.requires_grad and getattr(p, "main_grad", None) is not None:
            p.fuse_wgrad = True
            params += 1
    return {"megatron_linears": layers, "expert_banks": banks, "parameters": params}
