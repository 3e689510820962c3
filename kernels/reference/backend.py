"""Entry point of the `none` kernel backend: the reference ops."""

from types import SimpleNamespace


def ops() -> SimpleNamespace:
    """The reference implementations of the DeepSeek-V4 ops, by op name.

    Every other kernel backend provides the same names and is tested against
    these functions.
    """
    from kernels.reference import attention, compressor, indexer, mhc

    return SimpleNamespace(
        sparse_attention_with_sink=attention.sparse_attention_with_sink,
        indexer_scores=indexer.indexer_scores,
        hadamard_transform=compressor.hadamard_transform,
        sinkhorn=mhc.sinkhorn,
        hc_pre=mhc.hc_pre,
        hc_post=mhc.hc_post,
        hc_head=mhc.hc_head,
    )
