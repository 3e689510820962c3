"""Entry point of the `none` kernel backend: the reference ops."""

from core.kernel_ops import OpTable

NAME = "none"


def reference_functions() -> dict:
    """The reference implementations of the DeepSeek-V4 ops, by op name: the oracle every other kernel
    backend is tested against, and what a GPU backend names for the ops it has no kernel for."""
    from kernels.reference import attention, compressor, indexer, layers, mhc, moe, rope

    return dict(
        sparse_attention_with_sink=attention.sparse_attention_with_sink,
        indexer_scores=indexer.indexer_scores,
        hadamard_transform=compressor.hadamard_transform,
        sinkhorn=mhc.sinkhorn,
        hc_pre=mhc.hc_pre,
        hc_post=mhc.hc_post,
        hc_head=mhc.hc_head,
        apply_rope=rope.apply_rope,
        rms_normalize=layers.rms_normalize,
        rms_norm=layers.rms_norm,
        weighted_swiglu=moe.weighted_swiglu,
        head_logprobs=layers.head_logprobs,
    )


def ops() -> OpTable:
    """The reference ops as the `none` backend's table (any dtype, any device)."""
    return OpTable(NAME, reference_functions(), dtypes=None)
