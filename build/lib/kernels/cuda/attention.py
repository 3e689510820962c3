"""CUDA C++ sparse MQA attention forward with an attention sink, for the NVIDIA H200 (sm_90a).

Same contract as :func:`kernels.triton.attention.sparse_attention_fwd` (THD layout)::

    o, lse2 = sparse_attention_fwd(q, kv, idx, sink, scale)

``q [T,H,D]`` bf16, ``kv [Tkv,D]`` bf16 (one shared K = V head), ``idx [T,K]`` int32 (int64 is converted;
``-1`` = empty slot, skipped), ``sink [H]`` (a logit, not scaled; converted to fp32). Returns ``o [T,H,D]``
bf16 and ``lse2 [T,H]`` fp32 in log2 units (``lse * log2(e)``, the sink included), so the Triton backward
(:func:`kernels.triton.attention.sparse_attention_bwd`) takes them as they are. A row whose slots are all
``-1`` gives ``o = 0`` and ``lse = sink``. Row ids in ``idx`` must be ``< Tkv`` (not checked, as in Triton).

Default kernel: variant 6 (persistent, lazy O rescale; 357 TFLOPS at the V4-Flash shape and 394 at V4-Pro on
an H200, against Triton's 262 / 284; ``kernels/cuda/NOTES.md``). ``DSV4_CUDA_ATTN_VARIANT`` picks another.

What it takes: bf16, D = 512, H a multiple of 64, contiguous CUDA tensors on a compute-capability 9.0 GPU;
anything else raises ``ValueError`` with the fix. The kernel (``kernels/cuda/sparse_attention_fwd.cuh``,
design notes in ``kernels/cuda/NOTES.md``) is compiled on first use with
``torch.utils.cpp_extension.load`` (nvcc, ``-gencode=arch=compute_90a,code=sm_90a``) into
``~/.cache/dsv4/cuda_kernels/<hash of the sources and flags>`` (``DSV4_CUDA_KERNELS_CACHE`` overrides the
folder); later processes load the cached build.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Optional, Tuple

import torch

from kernels.cuda.shape import HEAD_DIM, HEAD_TILE

__all__ = ["sparse_attention_fwd", "VARIANTS", "DEFAULT_VARIANT", "load_extension"]

_HERE = Path(__file__).resolve().parent
_SOURCES = ["binding.cpp"] + [f"sparse_attention_fwd_v{v}.cu" for v in range(10)] + ["sparse_attention_fwd_ablations.cu"]
_HEADERS = ["sparse_attention_fwd.cuh", "sparse_attention_params.h"]
_CUDA_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "--use_fast_math",
               "-Xptxas", "-v", "-lineinfo"]
_CXX_FLAGS = ["-O3", "-std=c++17"]

# Kernel variants (every variant computes the same function; see sparse_attention_fwd.cuh).
# variant = PV + 3 * PIPE. PV, how O += P.V is issued: 0 = m64n256k16, MN-major B with LBO = 8 KB /
# SBO = 1 KB; 1 = the same with LBO and SBO swapped; 2 = four m64n64k16 (no block stride needed).
# PIPE: 0 = each tile in order; 1 = S of tile i+1 issued before P.V of tile i (softmax overlaps P.V).
# 6, 7: persistent (grid = SMs, the KV ring runs on across tokens), PIPE 0 order, lazy O rescale, PV 0 / 2.
# 8, 9: persistent, lazy, PV 0, each consumer computes the full S itself (no exchange; 1.5x the tensor work),
# 8 with ping-pong (the consumers take turns issuing S, so one's softmax runs under the other's S), 9 without.
# Variants 1 and 4 swap two descriptor offsets and are wrong by design (they confirmed variant 0's layout on
# an H200, 2026-12-01: o relative error 1.08): built, but no entry point runs them.
VARIANTS = (0, 2, 3, 5, 6, 7, 8, 9)
WRONG_VARIANTS = (1, 4)
# timing ablations (outputs wrong by design; bench only, through :func:`timing_ablation`): 100 / 102 = variant
# 0 / 2 without the S exchange and the softmax, 200 = the gather alone
ABLATIONS = {100: "pv0, no S exchange/softmax", 102: "pv2, no S exchange/softmax", 200: "gather only"}
DEFAULT_VARIANT = 6     # persistent, lazy rescale: the fastest on an H200 (kernels/cuda/NOTES.md)

_lock = threading.Lock()
_ext = None


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((_HERE / name).read_bytes())
    h.update(" ".join(_CUDA_FLAGS + _CXX_FLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    return h.hexdigest()[:16]


def load_extension(verbose: bool = False):
    """Compile (first use) or load the extension; returns the module with ``fwd``."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            from torch.utils.cpp_extension import load

            key = _source_hash()
            root = Path(os.environ.get("DSV4_CUDA_KERNELS_CACHE",
                                       Path.home() / ".cache" / "dsv4" / "cuda_kernels"))
            build = root / key
            build.mkdir(parents=True, exist_ok=True)
            _ext = load(name=f"dsv4_cuda_attn_{key}", sources=[str(_HERE / s) for s in _SOURCES],
                        extra_cuda_cflags=_CUDA_FLAGS, extra_cflags=_CXX_FLAGS,
                        extra_include_paths=[str(_HERE)], build_directory=str(build), verbose=verbose)
    return _ext


def check_inputs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                 contiguous: bool = True) -> None:
    """Raise ``ValueError`` (naming the fix) unless the kernel takes these inputs; ``contiguous=False`` leaves
    out the layout check (the backend's entry points check before the launcher makes its inputs contiguous)."""
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or sink.dim() != 1:
        raise ValueError(f"expected q [T,H,D], kv [Tkv,D], idx [T,K], sink [H]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(idx.shape)}, {tuple(sink.shape)}")
    T, H, D = q.shape
    if kv.shape[1] != D or idx.shape[0] != T or sink.shape[0] != H:
        raise ValueError("shape mismatch between q [T,H,D], kv [Tkv,D], idx [T,K] and sink [H]")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(f"the cuda attention kernel takes bf16 q and kv, got {q.dtype}, {kv.dtype}: cast them "
                         "with .bfloat16() or use --kernel-backend triton (bf16/fp16)")
    if D != HEAD_DIM:
        raise ValueError(f"the cuda attention kernel is built for head dim {HEAD_DIM}, got {D}: use "
                         "--kernel-backend triton for other head dims")
    if H % HEAD_TILE:
        raise ValueError(f"the cuda attention kernel takes a multiple of {HEAD_TILE} heads, got {H}: pad the heads "
                         f"to a multiple of {HEAD_TILE} or use --kernel-backend triton")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be int32 (or int64), got {idx.dtype}")
    if not (q.is_cuda and kv.is_cuda and idx.is_cuda and sink.is_cuda):
        raise ValueError("the cuda attention kernel needs CUDA tensors: move q, kv, idx and sink to the GPU "
                         "(.cuda())")
    if not (q.device == kv.device == idx.device == sink.device):
        raise ValueError("q, kv, idx and sink must be on one GPU")
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"the cuda attention kernel is built for sm_90a (H100/H200), this GPU is sm_{cap[0]}{cap[1]}: "
                         "use --kernel-backend triton")
    if not contiguous:
        return
    for name, x in (("q", q), ("kv", kv), ("idx", idx)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous: pass {name}.contiguous()")


def sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float, variant: Optional[int] = None,
                         out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward only. Returns ``o [T,H,D]`` bf16 and ``lse2 [T,H]`` fp32 in log2 units.

    ``variant``: the PV issue variant (``VARIANTS``; default ``DEFAULT_VARIANT``). ``out``: optional
    preallocated ``(o, lse2)`` (contiguous, bf16 / fp32) that the kernel overwrites entirely (tests poison
    them first)."""
    check_inputs(q, kv, idx, sink)
    if idx.dtype != torch.int32:
        idx = idx.to(torch.int32)
    sink = sink.to(torch.float32).contiguous()
    T, H, D = q.shape
    if out is None:
        o = torch.empty_like(q)
        lse2 = torch.empty(T, H, dtype=torch.float32, device=q.device)
    else:
        o, lse2 = out
    if T == 0:
        return o, lse2
    v = default_variant() if variant is None else int(variant)
    if v not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} (the variants that compute the function), got {v}")
    return _launch(q, kv, idx, sink, scale, o, lse2, v)


def default_variant() -> int:
    """``DSV4_CUDA_ATTN_VARIANT`` if set (one of :data:`VARIANTS`, else a ValueError naming them), else
    :data:`DEFAULT_VARIANT`."""
    raw = os.environ.get("DSV4_CUDA_ATTN_VARIANT")
    if raw is None:
        return DEFAULT_VARIANT
    if not raw.strip().isdigit() or int(raw) not in VARIANTS:
        raise ValueError(f"DSV4_CUDA_ATTN_VARIANT={raw!r}: it must be one of {VARIANTS} (unset it for the "
                         f"default, {DEFAULT_VARIANT})")
    return int(raw)


def timing_ablation(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                    which: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A timing ablation (:data:`ABLATIONS`; its outputs are WRONG by design): for the benchmark only."""
    if which not in ABLATIONS:
        raise ValueError(f"ablation must be one of {sorted(ABLATIONS)}, got {which}")
    check_inputs(q, kv, idx, sink)
    T, H, _ = q.shape
    o, lse2 = torch.empty_like(q), torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return o, lse2
    return _launch(q, kv, idx.to(torch.int32), sink.to(torch.float32).contiguous(), scale, o, lse2, which)


def _launch(q, kv, idx, sink, scale, o, lse2, v):
    load_extension().fwd(q, kv, idx, sink, o, lse2, float(scale), v)
    return o, lse2
