"""Registers the `miles` attention implementation (the plugin path)."""

from core.hookspecs import hookimpl
from core.records import AttentionImpl


@hookimpl
def dsv4_attention_impls():
    return [
        AttentionImpl(
            name="miles",
            description="plugin path: DeepSeek-V4 attention and mHC as megatron-core modules; BSHD; tensor parallel",
            factory="backends.miles.impl:build_model",
            # THD and context parallelism arrive with packing (issue #6); expert
            # parallelism is not built yet. Declared here so the table refuses them.
            qkv_formats=("bshd",),
            max_tensor_parallel=None,
            context_parallel=False,
            expert_parallel=False,
        )
    ]
