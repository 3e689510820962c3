"""Registers the `miles` attention implementation (the plugin path)."""

from core.hookspecs import hookimpl
from core.records import AttentionImpl


@hookimpl
def dsv4_attention_impls():
    return [
        AttentionImpl(
            name="miles",
            description=("plugin path: DeepSeek-V4 attention and mHC as megatron-core modules; BSHD and THD; "
                         "tensor, context and expert parallel"),
            factory="backends.miles.impl:build_model",
            # THD packing and context parallelism: engine.thd_attention (issue #6).
            qkv_formats=("bshd", "thd"),
            max_tensor_parallel=None,
            context_parallel=True,
            expert_parallel=True,
            pipeline_parallel=True,     # engine.pipeline: stages of decoder layers, megatron-core's 1F1B
        )
    ]
