"""Registers the `megatron` attention implementation (the Megatron-native design)."""

from core.hookspecs import hookimpl
from core.records import AttentionImpl


@hookimpl
def dsv4_attention_impls():
    return [
        AttentionImpl(
            name="megatron",
            description="Megatron-native design: THD, native-style hyper-connections, indexer trained by a KL loss; tensor parallel 1; context and expert parallel",
            factory="backends.megatron.impl:build_model",
            qkv_formats=("thd",),
            max_tensor_parallel=1,
            tp_hint="its attention and hyper-connection modules are not tensor-parallel",
            # context parallelism: engine.thd_attention (issue #6); expert parallelism: engine.expert_parallel
            context_parallel=True,
            expert_parallel=True,
            pipeline_parallel=True,     # engine.pipeline over rows, a THD segment each (backends.megatron.stage)
        )
    ]
