"""Entry point of the `tilelang` kernel backend."""

from typing import Optional

from core.kernel_ops import OpTable  # noqa: F401 (the return type)
from core.probes import python_package_missing


def unavailable_reason() -> Optional[str]:
    return python_package_missing("tilelang")


def ops() -> "OpTable":
    """Return the tilelang implementations of the DeepSeek-V4 ops, by the reference op names.

    TileLang kernels (CUDA tensors; ``kernels/tilelang/attention.py``, ``indexer.py``; compiled on first
    use per (heads, head dim, dtype, launch config) and cached by TileLang on disk):

    * ``sparse_attention_with_sink(q, kv, indices, sink, scale)``: forward + backward kernels for
      bf16/fp16 CUDA inputs with a power-of-two head dim >= 32; other dtypes (fp32/fp64), head dims or
      CPU tensors are refused with the fix.
    * ``indexer_scores(q, k, w)``: bf16/fp16 CUDA ``q`` and ``k``, fp32 ``w``, fp32 accumulation and fp32
      scores (the reference returns the input dtype). The table declares ``indexer_inputs="activation"``:
      every caller passes ``q`` and ``k`` in the run's dtype (``kernels.reference.indexer.indexer_input_dtype``).
      Other inputs (fp32/fp64: ``--dtype fp32`` is refused with this backend), and inputs that require a
      gradient (no backward), are refused.

    Each kernel launcher is a ``torch.library`` custom op (``dsv4_tilelang::...``, ``kernels/gpu_ops.py``): a
    graph node under ``torch.compile`` (``--compile``); TileLang compiles a kernel when the op first runs, never
    while dynamo traces.

    Named from the reference set (backend ``none``; no TileLang kernel): ``hadamard_transform``,
    ``sinkhorn``, ``hc_pre``, ``hc_post``, ``hc_head``.

    Extra names beyond the reference set (THD entry points, same as the triton backend):
    ``sparse_attention_with_sink_thd`` (``return_lse=True`` also gives the natural-log LSE),
    ``indexer_scores_thd`` (with causal or segment ``ks/ke`` ranges), ``indexer_topk``.
    """
    from kernels import gpu_common
    from kernels.tilelang import attention, indexer

    return gpu_common.make_ops("tilelang", attention, indexer)
