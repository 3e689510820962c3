"""The benchmarks, every one an entry point (``python -m bench.<name>``); results in ``bench/results/``.

* :mod:`bench.train_step` - one-GPU training step: tokens/s and MFU of miles, megatron and transformers.
* :mod:`bench.parallel` - multi-GPU training throughput per parallel layout, and weight-export GB/s.
* :mod:`bench.train_cli` - ``dsv4 train`` itself per parallel layout: tokens/s per GPU, MFU, memory, scaling.
* :mod:`bench.thd` - packed THD against padded BSHD on the same sample lengths (CPU).
* :mod:`bench.kernels_triton`, :mod:`bench.kernels_tilelang` - the GPU kernels against the PyTorch
  reference (harness: :mod:`bench.kernels_common`).
* :mod:`bench.convert` - throughput of the quantization converters.

The top layer, beside ``launchers/``: it may import every package, and no package imports it.
"""
