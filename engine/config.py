"""TransformerConfig factory: ModelConfig + parallel sizes -> megatron ``TransformerConfig``.

Every fused / jit / TE path is switched off (CPU-safe; megatron's fused ops would be
torch.compile'd on first use), parameters are created on the CPU
(``use_cpu_initialization=True``) and the DeepSeek-V4 MoE fields are filled in
(sqrtsoftplus scores, top-k scaling factor, expert bias, SwiGLU clamp value)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .runtime import ensure_megatron

__all__ = ["CPU_SAFE_FLAGS", "parallel_sizes", "make_transformer_config"]

#: TransformerConfig flags that keep megatron-core off its fused / compiled / CUDA-only paths.
CPU_SAFE_FLAGS = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
    moe_grouped_gemm=False,
    cross_entropy_loss_fusion=False,
    use_cpu_initialization=True,
    tp_comm_overlap=False,
    sequence_parallel=False,
)


def parallel_sizes(run_config=None) -> dict:
    """``{"tp", "cp", "ep", "pp"}`` from a RunConfig (1s when None)."""
    return {k: int(getattr(run_config, k, 1) or 1) for k in ("tp", "cp", "ep", "pp")}


def make_transformer_config(model_config, run_config=None, *, params_dtype=torch.float32,
                            perform_initialization: bool = True, init_method_std: float = 0.02, **overrides):
    """A megatron ``TransformerConfig`` for a DeepSeek-V4 ``ModelConfig``.

    ``run_config`` supplies ``tp`` / ``cp`` / ``ep`` / ``pp`` (any object with those attributes).
    The DeepSeek-V4-specific shapes that TransformerConfig has no field for (o_groups,
    compressor, indexer, mHC) are read from ``model_config`` by the modules themselves."""
    ensure_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = model_config
    p = parallel_sizes(run_config)
    kw = dict(
        num_layers=c.n_layers,
        hidden_size=c.dim,
        ffn_hidden_size=c.moe_inter_dim,
        num_attention_heads=c.n_heads,
        kv_channels=c.head_dim,
        num_query_groups=1,
        tensor_model_parallel_size=p["tp"],
        context_parallel_size=p["cp"],
        expert_model_parallel_size=p["ep"],
        pipeline_model_parallel_size=p["pp"],
        pipeline_dtype=params_dtype,     # required with pp > 1 (the trainer's schedule sends fp32: engine.pipeline)
        normalization="RMSNorm",
        layernorm_epsilon=c.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        perform_initialization=perform_initialization,
        init_method_std=init_method_std,
        attention_softmax_in_fp32=True,
        num_moe_experts=c.n_routed_experts,
        moe_ffn_hidden_size=c.moe_inter_dim,
        moe_shared_expert_intermediate_size=c.moe_inter_dim * c.n_shared_experts,
        moe_router_topk=c.n_activated_experts,
        moe_router_score_function=c.score_func,
        moe_router_topk_scaling_factor=c.route_scale,
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        activation_func_clamp_value=c.swiglu_limit if c.swiglu_limit > 0 else None,
        **CPU_SAFE_FLAGS,
    )
    if params_dtype == torch.bfloat16:
        kw["bf16"] = True
    kw.update(overrides)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    cfg = TransformerConfig(**{k: v for k, v in kw.items() if k in fields})
    # Not TransformerConfig fields in this megatron-core version: carried as attributes.
    cfg.activation_func_clamp_shared_expert = bool(c.shared_expert_clamp)
    cfg.dsv4_model_config = c
    return cfg
