"""Entry point of the `triton` kernel backend."""

from typing import Optional

from core.kernel_ops import OpTable  # noqa: F401 (the return type)
from core.probes import python_package_missing


def unavailable_reason() -> Optional[str]:
    return python_package_missing("triton")


def ops() -> "OpTable":
    """Return the triton implementations of the DeepSeek-V4 ops, by the reference op names.

    Triton kernels (CUDA tensors; ``kernels/triton/attention.py``, ``indexer.py``, ``mhc.py``, ``sinkhorn.py``):

    * ``sparse_attention_with_sink(q, kv, indices, sink, scale)``: forward + backward kernels for
      bf16/fp16 inputs with a power-of-two head dim; other inputs are refused with the fix (the run's
      ``--dtype`` is checked against the backend's dtypes at parse time already).
    * ``indexer_scores(q, k, w)``: bf16/fp16 ``q`` and ``k``, fp32 ``w``, fp32 accumulation and fp32 scores
      (the reference returns the input dtype); no backward, so inputs that require a gradient are refused.
      The table declares ``indexer_inputs="activation"``: every caller passes ``q`` and ``k`` in the run's
      dtype (``kernels.reference.indexer.indexer_input_dtype``). fp32 ``q`` and ``k`` (never a run's input:
      ``--dtype fp32`` is refused with this backend) would run as IEEE fp32 dots.
    * ``hc_pre``, ``hc_post``, ``hc_head``, ``sinkhorn``: fused mHC kernels, forward + backward, fp32
      coefficient math; bf16/fp16 streams, fp32 mapping weights / coefficients, hc_mult <= 8; other inputs
      are refused with the reason (``kernels/triton/mhc_checks.py``).

    * ``apply_rope(x, cos, sin, inverse)``: one pass over ``x`` (bf16/fp16/fp32), the pairs rotated in fp32;
      its backward is the inverse rotation (``kernels/triton/rope.py``).
    * ``rms_normalize(x, eps, out_dtype)``: the weightless RMS norm (the per-head query norm), one pass each way,
      fp32 row sums (``kernels/triton/norm.py``).
    * ``rms_norm(x, weight, eps)``: the weighted RMS norm of every ``engine.layers.RMSNorm`` (bf16/fp16/fp32 ``x``,
      the weight in the model's dtype or fp32-kept), one pass each way, ``dw`` from per-program fp32 partial sums
      (``kernels/triton/norm.py``).
    * ``weighted_swiglu(h, w, limit, out_dtype)``: the routed experts' clamped SwiGLU times the gate weight,
      one pass each way (``kernels/triton/swiglu.py``).
    * ``hadamard_transform(x)``: the Walsh-Hadamard transform of the indexer's queries and keys, the reference's
      butterflies and roundings in one kernel (``kernels/triton/hadamard.py``); its backward is the same kernel.

    Each kernel launcher is a ``torch.library`` custom op (``dsv4_triton::...``, ``kernels/gpu_ops.py``), so
    ``torch.compile`` (``--compile``) traces these entry points into its graphs without a graph break.

    Extra names beyond the reference set (THD entry points): ``sparse_attention_with_sink_thd``
    (``return_lse=True`` also gives the natural-log LSE), ``indexer_scores_thd`` (with causal or
    segment ``ks/ke`` ranges), ``indexer_topk``; ``experts_grouped_mm``, the rollout engine's decode step's
    routed experts for few rows per expert, and ``expert_order``, its eager MoE's pairs in expert order in one
    launch, ``experts_gather_mm``, ``experts_scatter_mm`` and ``moe_combine``, its GEMMs through that order and
    the pairs' sum, and ``experts_swiglu_scatter_mm``, the activation and the second GEMM in one launch
    (``kernels/triton/experts.py``); ``route_experts``, its eager MoE's router in one launch
    (``kernels/triton/routing.py``); ``draw_tokens``, the rollout engine's
    sampler at top-p 1, and ``draw_record``, a decode step's draw with the engine's records of it
    (``kernels/triton/sampling.py``); ``compressor_step``, its eager decode step's compressors
    after their GEMMs in one launch (``kernels/triton/compress.py``); ``norm_rope``, its eager decode step's query
    and key norms and rotations (and the key's write into the ring), one launch each
    (``kernels/triton/norm_rope.py``); ``decode_topk``, its eager decode step's indexer picks in one launch, and
    ``attention_rows``, a window or HCA layer's attention rows in one (``kernels/triton/topk.py``);
    ``index_query``, its indexer query's rotation, Hadamard transform and casts in one launch
    (``kernels/triton/index_query.py``); ``linear_group``, the projections of a layer's attention
    input in one launch at a few tokens, ``grouped_projection``, the attention's grouped ``wo_a`` with the same
    kernel's row blocks, and ``linear_post``, its ``wo_b`` with the site's mHC post in the same kernel's epilogue
    (``kernels/triton/linear_group.py``); ``hc_pre_norm``, its eager decode step's
    mHC pre and the norm after it in one launch at a few tokens, and ``moe_combine_post``, the MoE's pairs summed
    inside its mHC post (``kernels/triton/mhc_decode.py``);
    ``attention_inverse_rope``, its eager decode step's sparse attention with the inverse rotation of its output in
    the kernel's epilogue, one launch where the attention and ``apply_rope`` were two (``kernels/triton/attention.py``).
    """
    from kernels import gpu_common
    from kernels.triton import (attention, compress, experts, hadamard, index_query, indexer, linear_group, logprobs,
                                mhc, mhc_decode, norm, norm_rope, rope, routing, sampling, swiglu, topk)

    return gpu_common.make_ops("triton", attention, indexer, mhc, rope, norm, swiglu, logprobs, experts, hadamard,
                               sampling, routing, compress, norm_rope, topk, index_query, linear_group,
                               mhc_decode, decode_attention=attention)
