"""Readable single-device PyTorch reference implementation of DeepSeek-V4.

See ``model.DeepseekV4Model`` (the model), ``params.count_parameters`` and the
pure building blocks in ``rope``, ``attention``, ``compressor``, ``indexer``,
``mhc`` and ``moe``. This package marker imports nothing, so that registering
the `none` kernel backend (``plugin.py``) does not import torch.
"""
