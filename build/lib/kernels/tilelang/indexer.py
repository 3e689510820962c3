"""TileLang Lightning-Indexer scores (reference_system.md §1.6; ``kernels.reference.indexer``).

    I[t, j] = sum_h w[t, h] * relu(<q[t, h, :], k[j, :]>)        fp32 accumulation, fp32 output

THD layout as in the Triton backend: ``q [T, H, D]``, ``k [N, D]``, ``w [T, H]``; optional per-query key
ranges ``ks [T]``, ``ke [T]`` (visible keys ``ks[t] <= j < ke[t]``), ``-inf`` outside the range.

One program = ``BT`` queries x ``BN`` keys: the key tile stays in shared memory, the loop over heads does one
``[BT, D] x [D, BN]`` ``T.gemm`` per head, then ReLU, the weight and an fp32 accumulation in registers.
bf16/fp16 inputs only; fp32/fp64 inputs (and CPU tensors) are computed by an fp32 torch einsum (the
tensor cores would round fp32 to tf32, which misses the 1e-4 bound of the tests). Top-k is the
reference's stable top-k (``kernels.reference.topk``).
"""

import functools
from typing import Optional

import torch

from kernels import gpu_common, gpu_ops

__all__ = ["indexer_scores", "indexer_scores_thd", "indexer_scores_launch", "indexer_topk", "INDEXER_CONFIG"]

INDEXER_CONFIG = dict(BT=64, BN=128, threads=128, num_stages=2)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=None)
def indexer_kernel(H: int, D: int, dtype: str, has_range: bool, BT: int = 64, BN: int = 128, threads: int = 128,
                   num_stages: int = 2):
    import tilelang.language as T

    from kernels.tilelang.attention import _compile

    accum = "float32"
    NT, N = T.dynamic("NT, N")

    @T.prim_func
    def indexer_scores_fwd(Q: T.Tensor([NT, H, D], dtype), Kt: T.Tensor([N, D], dtype), W: T.Tensor([NT, H], accum),
                           KS: T.Tensor([NT], "int32"), KE: T.Tensor([NT], "int32"), Out: T.Tensor([NT, N], accum)):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(NT, BT), threads=threads) as (bn, bt):
            k_s = T.alloc_shared([BN, D], dtype)
            q_s = T.alloc_shared([BT, D], dtype)
            w_s = T.alloc_shared([BT], accum)
            s = T.alloc_fragment([BT, BN], accum)
            acc = T.alloc_fragment([BT, BN], accum)

            for j, d in T.Parallel(BN, D):
                k_s[j, d] = T.if_then_else(bn * BN + j < N, Kt[T.min(bn * BN + j, N - 1), d], T.cast(0, dtype))
            T.fill(acc, 0)
            for h in T.Pipelined(H, num_stages=num_stages):
                for i, d in T.Parallel(BT, D):
                    q_s[i, d] = T.if_then_else(bt * BT + i < NT, Q[T.min(bt * BT + i, NT - 1), h, d],
                                               T.cast(0, dtype))
                for i in T.Parallel(BT):
                    w_s[i] = T.if_then_else(bt * BT + i < NT, W[T.min(bt * BT + i, NT - 1), h], 0.0)
                T.gemm(q_s, k_s, s, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BN):
                    acc[i, j] = acc[i, j] + T.max(s[i, j], 0.0) * w_s[i]
            for i, j in T.Parallel(BT, BN):
                if (bt * BT + i < NT) & (bn * BN + j < N):
                    if has_range:
                        Out[bt * BT + i, bn * BN + j] = T.if_then_else(
                            (bn * BN + j >= KS[bt * BT + i]) & (bn * BN + j < KE[bt * BT + i]), acc[i, j],
                            -T.infinity(accum))
                    else:
                        Out[bt * BT + i, bn * BN + j] = acc[i, j]

    return _compile(indexer_scores_fwd)


@gpu_ops.traceable
def indexer_scores_thd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                       ks: Optional[torch.Tensor] = None, ke: Optional[torch.Tensor] = None,
                       config: Optional[dict] = None) -> torch.Tensor:
    """``q [T,H,D]``, ``k [N,D]``, ``w [T,H]`` (+ optional ``ks, ke [T]``) -> fp32 scores ``[T, N]``.

    The checks run here, then the ``dsv4_tilelang::indexer_scores`` custom op (``kernels.gpu_ops``) launches
    :func:`indexer_scores_launch`; a ``config`` (launch settings, bench.py) calls the launcher directly."""
    T, H, D = q.shape
    if k.shape[1] != D or w.shape != (T, H):
        raise ValueError(f"expected q [T,H,D], k [N,D], w [T,H]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(w.shape)}")
    if (ks is None) != (ke is None):
        raise ValueError("give both ks and ke, or neither")
    dt = torch.promote_types(q.dtype, k.dtype)
    if dt not in _DTYPES or not q.is_cuda or D < 16 or D & (D - 1):
        raise ValueError(f"the tilelang indexer kernel takes bf16/fp16 CUDA tensors with a power-of-two head dim "
                         f">= 16; got {dt}, head dim {D}, on {q.device}. Fix: run with --dtype bf16 on a GPU "
                         f"target, or choose --kernel-backend none for this input")
    gpu_common.refuse_grad("tilelang", q, k, w)
    if config is not None:
        return indexer_scores_launch(q, k, w, ks, ke, config)
    return gpu_ops.TILELANG.indexer_scores(q, k, w, ks, ke)


def indexer_scores_launch(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: Optional[torch.Tensor],
                          ke: Optional[torch.Tensor], config: Optional[dict] = None) -> torch.Tensor:
    """The launcher of :func:`indexer_scores_thd` (inputs already checked)."""
    T, H, D = q.shape
    N = k.shape[0]
    dt = torch.promote_types(q.dtype, k.dtype)
    cfg = {**INDEXER_CONFIG, **(config or {})}
    q, k = q.to(dt).contiguous(), k.to(dt).contiguous()
    w = w.float().contiguous()
    out = torch.empty(T, N, dtype=torch.float32, device=q.device)
    if T == 0 or N == 0:
        return out
    has_range = ks is not None
    if has_range:
        ks = ks.to(torch.int32).contiguous()
        ke = ke.to(torch.int32).contiguous()
    else:
        ks = ke = torch.zeros(T, dtype=torch.int32, device=q.device)
    kern = indexer_kernel(H, D, _DTYPES[dt], has_range, cfg["BT"], cfg["BN"], cfg["threads"], cfg["num_stages"])
    kern(q, k, w, ks, ke, out)
    return out


@gpu_ops.traceable
def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.reference.indexer.indexer_scores``: ``q [B,S,H,D]``, ``k [B,N,D]``,
    ``w [B,S,H]`` -> ``[B,S,N]``, fp32 accumulation, returned in fp32."""
    return gpu_common.indexer_scores_batched(indexer_scores_thd, q, k, w)


indexer_topk = gpu_common.local_copy(gpu_common.indexer_topk, __name__)  # the stable top-k, shared by the GPU backends
