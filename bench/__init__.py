"""The benchmarks, each an entry point (``python -m bench.<name>``), and the modules they share; results in
``bench/results/``.

* :mod:`bench.train_cli` - ``dsv4 train`` itself per parallel layout: tokens/s per GPU, MFU, memory, scaling,
  beside transformers' eager step.
* :mod:`bench.grpo` - a GRPO step of ``dsv4 train``, phase by phase, per weight-sync mode.
* :mod:`bench.parallel` - multi-GPU training throughput per parallel layout, and weight-export GB/s.
* :mod:`bench.thd` - packed THD against padded BSHD on the same sample lengths (CPU).
* :mod:`bench.kernels_triton`, :mod:`bench.kernels_tilelang`, :mod:`bench.kernels_cuda`, :mod:`bench.kernels_mhc` -
  the GPU kernels against the PyTorch reference or each other (harness: :mod:`bench.kernels_common`).
* :mod:`bench.rollout` - prefill and decode tokens/s of the rollout engine, against transformers' ``generate``.
* :mod:`bench.convert` - throughput of the quantization converters.

Shared: :mod:`bench.flops` (FLOPs per step and MFU), :mod:`bench.configs` (the benchmark model and run
configs, a record's config summary), :mod:`bench.reference_step` (transformers' eager training step, the
reference of bench.train_cli).

The top layer, beside ``launchers/``: it may import every package, and no package imports it.
"""
