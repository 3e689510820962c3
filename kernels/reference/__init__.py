"""Readable single-device PyTorch reference implementation of DeepSeek-V4.

See ``model.DeepseekV4Model`` (the model), ``params.count_parameters`` and the
pure building blocks in ``rope``, ``attention``, ``compressor``, ``indexer``,
``mhc`` and ``moe``.
"""
