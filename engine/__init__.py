"""megatron-core glue shared by the ``miles`` and ``megatron`` implementations of DeepSeek-V4.

* :mod:`engine.layout` - the run's parallel layout (``ParallelLayout``: sizes, this rank's place, process groups),
  built once per rank by the hardware target; the one module that touches megatron-core's ``parallel_state``.
* :mod:`engine.runtime` - ``ensure_megatron()`` (CPU shims + import), ``ensure_parallel_state`` (the layout has the
  model's sizes).
* :mod:`engine.config` - ``make_transformer_config`` (ModelConfig + parallel sizes -> TransformerConfig).
* :mod:`engine.tp` - TP sharding metadata on parameters, shard / gather helpers, fp32 keep marks.
* :mod:`engine.layers` - ``Linear`` (replicated), ``RMSNorm``, ``KeepFP32Module``.
* :mod:`engine.moe` - the DeepSeek-V4 MoE (``DSv4MoE``: router with sqrtsoftplus / hash routing,
  grouped SwiGLU experts with the asymmetric clamp, shared expert with the clamp switch).
* :mod:`engine.expert_parallel` - expert parallelism: which experts a rank holds (global names), the
  autograd-aware all-to-all that carries routed rows to their expert's rank and back.
* :mod:`engine.loading` - HF checkpoint -> native model through ``core.weight_contract.hf_to_native``,
  with TP sharding by rank (and only this rank's experts under EP); full (unsharded) native state /
  gradients of a TP- or EP-sharded model.
* :mod:`engine.compile` - ``compile_blocks``: ``torch.compile`` of every block in place (optionally CUDA graphs).
* :mod:`engine.thd_attention` - packed-sequence (THD) and context-parallel attention pieces shared by
  both implementations (``ThdContext``, CP all-gather / left-boundary exchange with autograd,
  compressors on compacted slots, per-segment indexer top-k).
* :mod:`launchers.scoring` - ``score_packed``: sequences packed into one THD stream, optionally over CP /
  TP / EP gloo processes (imports the plugin host and the cpu target lazily, at call time).
* :mod:`bench.thd` - ``python -m bench.thd --out FILE.json``: THD vs padded BSHD tokens/s.

Import of this package does not import megatron; the submodules that need it call
``engine.runtime.ensure_megatron()`` first.
"""
