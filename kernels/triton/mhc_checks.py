"""What the Triton mHC kernels (``kernels/triton/mhc.py``, ``sinkhorn.py``) take, checked before a launch.

The kernels refuse rather than hand an input to the reference op (no silent fallback): the reference op is a
backend of its own (``--kernel-backend none``). Each refusal says which input is wrong and what to do.
Only torch (and the torch-only ``kernels.gpu_ops``) is imported here.
"""

from __future__ import annotations

import torch

from kernels import gpu_common
from kernels.gpu_ops import padded  # noqa: F401  (the register tile's side; the custom ops' fakes use it too)

__all__ = ["MAX_N", "padded", "check_device", "check_sinkhorn", "check_hc_pre", "check_hc_post", "check_hc_head"]

# A token's n x n mixing matrix lives in registers, padded to a power of two; hc_mult is 4 in every preset.
MAX_N = 8
HALF = (torch.bfloat16, torch.float16)
_FIX = "Fix: run with --dtype bf16 on a GPU target, or choose --kernel-backend none (the PyTorch reference ops)"


def check_device(*tensors: torch.Tensor) -> None:
    """CUDA tensors, or any device under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, for debugging)."""
    if gpu_common.interpreting():
        return
    if not all(t.is_cuda for t in tensors):
        raise ValueError(f"the triton mHC kernels need CUDA tensors, got {[str(t.device) for t in tensors]}. {_FIX}")


def _check_n(n: int, what: str) -> None:
    if not 1 <= n <= MAX_N:
        raise ValueError(f"the triton {what} kernel keeps a token's {n}x{n} mixing matrix in registers and takes "
                         f"hc_mult 1..{MAX_N}; got {n}. Fix: choose --kernel-backend none for this model")


def _check_fp32(what: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise ValueError(f"the triton {what} kernel takes fp32 {name} (the mHC coefficients are kept in fp32); "
                             f"got {t.dtype}")


def _check_streams(x: torch.Tensor, what: str) -> None:
    if x.dim() < 3:
        raise ValueError(f"the triton {what} kernel takes streams [..., n, d]; got shape {tuple(x.shape)}")
    if x.dtype not in HALF:
        raise ValueError(f"the triton {what} kernel takes bf16/fp16 streams; got {x.dtype}. {_FIX}")
    _check_n(x.shape[-2], what)


def check_sinkhorn(logits: torch.Tensor, iters: int) -> None:
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"the triton sinkhorn kernel takes [..., n, n] logits; got shape {tuple(logits.shape)}")
    if logits.dtype not in HALF + (torch.float32,):
        raise ValueError(f"the triton sinkhorn kernel takes bf16/fp16/fp32 logits (fp32 math); got {logits.dtype}. "
                         f"Fix: choose --kernel-backend none for fp64")
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1; got {iters}")
    _check_n(logits.shape[-1], "sinkhorn")
    check_device(logits)


def _check_mapping(x, fn, scale, base, rows, n_scale, what):
    n, d = x.shape[-2:]
    _check_fp32(what, fn=fn, scale=scale, base=base)
    if fn.shape != (rows, n * d) or base.shape != (rows,) or scale.shape != (n_scale,):
        raise ValueError(f"the triton {what} kernel takes fn [{rows}, {n * d}], scale [{n_scale}], base [{rows}] "
                         f"for streams [..., {n}, {d}]; got {tuple(fn.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(base.shape)}")
    check_device(x, fn, scale, base)


def check_hc_pre(x, fn, scale, base, iters) -> None:
    _check_streams(x, "hc_pre")
    n = x.shape[-2]
    _check_mapping(x, fn, scale, base, (2 + n) * n, 3, "hc_pre")
    if iters < 1:
        raise ValueError(f"hc_pre needs sinkhorn_iters >= 1; got {iters}")


def check_hc_head(x, fn, scale, base) -> None:
    _check_streams(x, "hc_head")
    _check_mapping(x, fn, scale, base, x.shape[-2], 1, "hc_head")


def check_hc_post(f, x, post, comb) -> None:
    _check_streams(x, "hc_post")
    n, d = x.shape[-2:]
    lead = tuple(x.shape[:-2])
    if f.shape != lead + (d,) or post.shape != lead + (n,) or comb.shape != lead + (n, n):
        raise ValueError(f"the triton hc_post kernel takes f [..., {d}], x [..., {n}, {d}], post [..., {n}], "
                         f"comb [..., {n}, {n}] with one leading shape; got {tuple(f.shape)}, {tuple(x.shape)}, "
                         f"{tuple(post.shape)}, {tuple(comb.shape)}")
    if f.dtype not in HALF + (torch.float32,):
        raise ValueError(f"the triton hc_post kernel takes a bf16/fp16/fp32 sublayer output f; got {f.dtype}. {_FIX}")
    _check_fp32("hc_post", post=post, comb=comb)
    check_device(f, x, post, comb)
