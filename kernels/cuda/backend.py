"""Entry point of the `cuda` kernel backend: the CUDA C++ sparse-attention forward for sm_90a (H100 / H200),
with the triton backend's kernels for everything else.

Why a backend of its own: the kernel is written for one attention shape (head dim 512, query heads in tiles
of 64: DeepSeek-V4-Flash and -Pro) and one GPU generation, where Triton's forward is structurally limited
(docs/kernels-and-benchmarks.md#sparse-attention-and-indexer-kernels); the record declares the shape
(``attention_head_dims``, ``attention_heads_multiple``), so another model is refused at parse time (rule
``kernel-attention-shape``) instead of reaching a kernel that cannot take it.
"""

from __future__ import annotations

import shutil
from typing import Optional

from core.kernel_ops import OpTable  # noqa: F401 (the return type)
from core.probes import python_package_missing


def unavailable_reason() -> Optional[str]:
    """Triton (the backward, the indexer and the mHC kernels) and a CUDA compiler (the forward is compiled on
    first use with torch.utils.cpp_extension)."""
    missing = python_package_missing("triton")
    if missing:
        return missing
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception as e:                      # a torch build without the extension tools
        return f"torch.utils.cpp_extension is unavailable ({type(e).__name__}: {e})"
    if shutil.which("nvcc") is None and not CUDA_HOME:
        return "no CUDA compiler: the cuda backend compiles its kernel with nvcc on first use (install the CUDA toolkit or set CUDA_HOME)"
    return None


def ops() -> "OpTable":
    """The op table: ``sparse_attention_with_sink`` / ``_thd`` are this backend's (CUDA forward, Triton
    backward, through the ``dsv4_cuda`` custom ops of :mod:`kernels.gpu_ops`); ``indexer_scores`` / ``_thd`` /
    ``indexer_topk``, ``apply_rope``, ``rms_normalize``, ``rms_norm``, ``weighted_swiglu``, ``hadamard_transform``
    and the mHC ops are the triton backend's kernels, named as such (``kernels_ran`` counts them under
    ``triton.``). bf16 q and kv, head dim 512, query heads a multiple of 64, CUDA tensors on a
    compute-capability 9.0 GPU: anything else is refused with the fix."""
    from kernels import gpu_common
    from kernels.cuda import entry
    from kernels.triton.backend import ops as triton_ops

    triton_table = triton_ops()           # every op name, with its provider
    own = dict(sparse_attention_with_sink=entry.sparse_attention_with_sink,
               sparse_attention_with_sink_thd=entry.sparse_attention_with_sink_thd)
    delegated = {name: (triton_table.provider[name], getattr(triton_table, name))
                 for name in triton_table.names() if name not in own}
    return OpTable("cuda", own, delegated=delegated, dtypes=gpu_common.GPU_DTYPES[:1],
                   indexer_inputs=triton_table.indexer_inputs)
