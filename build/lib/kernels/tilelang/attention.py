"""TileLang sparse MQA attention with an attention sink (DeepSeek-V4 CSA/HCA/window layers).

Same math and layout as the Triton backend (``kernels/triton/attention.py``; reference:
``kernels.reference.attention.sparse_attention_with_sink``)::

    z_j   = scale * <q[t,h], kv[idx[t,j]]>           j over the K slots of row t, idx = -1 skipped
    m     = max(max_j z_j, sink[h]);  Z = sum_j exp(z_j - m) + exp(sink[h] - m)
    o     = sum_j exp(z_j - m) / Z * kv[idx[t,j]];     lse = m + log Z

    backward, Delta = <o, do>:  P_j = exp(z_j - lse);  dS_j = P_j (<do, kv_j> - Delta)
    dq = scale sum_j dS_j kv_j;  dkv_j += scale dS_j q + P_j do;  d_sink = -sum_t Delta exp(sink - lse)

Layout is flattened THD: ``q [T,H,D]``, ``kv [Tkv,D]`` (one shared K=V head), ``idx [T,K]`` int32 with
``-1`` for empty slots, ``sink [H]`` fp32; bf16/fp16 inputs, fp32 accumulation. ``T``, ``Tkv`` and ``K`` are
dynamic in the compiled kernels, ``scale`` is a runtime argument (one compile per (H, D, dtype, launch
config)).

Kernels (TileLang, one program = one query token x a block of ``BH`` heads, heads >= H masked):

* ``fwd``: gathers ``BK`` KV rows per step into shared memory (rows of ``-1`` slots are zeros and their
  logits ``-inf``), ``S = Q KV^T`` and ``acc += P KV`` with ``T.gemm``; the online softmax starts at the
  sink (running max = sink, running sum = 1), so all-invalid rows give ``o = 0``, ``lse = sink``.
* ``dq``: recomputes ``S`` and ``dP = dO KV^T`` per tile, ``dq += dS KV`` in fp32 fragments (deterministic)
  and writes ``P`` and ``scale*dS`` (``[T,H,K]``, input dtype) for the dkv pass.
* ``dkv``: one program = one token x one ``DC``-wide slice of D, over all (padded) heads:
  ``dkv[idx] += (scale dS)^T q + P^T do`` with fp32 atomics into an fp32 buffer (cast at the end), so
  dkv is not bitwise reproducible run to run; o, lse, dq and d_sink are.
* ``Delta`` and ``d_sink`` are torch reductions (fp32).
"""



import functools
from typing import Optional, Tuple

import torch

from kernels import gpu_common, gpu_ops
from kernels.gpu_common import LN2, LOG2E  # noqa: F401  (re-exported: bench.py uses A.LOG2E)

__all__ = [
    "sparse_attention_with_sink",
    "sparse_attention_with_sink_thd",
    "sparse_attention_fwd",
    "sparse_attention_bwd",
    "FWD_CONFIG",
    "BWD_CONFIG",
]

FWD_CONFIG = dict(BH=64, BK=64, threads=256, num_stages=1)  # num_stages=2 measured no faster
# (fastest of bench.py's sweep on the H200, 2026-11-29: BK=64 / DC=128 beat BK=32 / DC=64 by 7-23 %)
BWD_CONFIG = dict(BH=64, BK=64, threads=256, num_stages=1,    # dq pass
                  BK2=64, DC=128, threads2=128, num_stages2=1)  # dkv pass

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _target():
    """TileLang's target: ``DSV4_TILELANG_TARGET`` (a name or a JSON dict such as
    ``{"kind": "cuda", "arch": "sm_90a"}``, which also lets a machine without a GPU compile), else ``cuda``
    (the visible device's architecture)."""
    import json
    import os

    t = os.environ.get("DSV4_TILELANG_TARGET", "cuda")
    return json.loads(t) if t.lstrip().startswith("{") else t


def _compile(func):
    import tilelang

    return tilelang.compile(func, target=_target())


def _pow2_at_least(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


# ----------------------------------------------------------------------------------------------
# kernel programs
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def fwd_kernel(H: int, D: int, dtype: str, BH: int = 64, BK: int = 64, threads: int = 256,
               num_stages: int = 1):
    import tilelang.language as T

    accum = "float32"
    NT, NKV, K = T.dynamic("NT, NKV, K")

    @T.prim_func
    def sparse_attn_fwd(Q: T.Tensor([NT, H, D], dtype), KV: T.Tensor([NKV, D], dtype),
                        Idx: T.Tensor([NT, K], "int32"), Sink: T.Tensor([H], accum),
                        O: T.Tensor([NT, H, D], dtype), Lse2: T.Tensor([NT, H], accum), scale_log2: T.float32):
        with T.Kernel(T.ceildiv(H, BH), NT, threads=threads) as (hb, t):
            q_s = T.alloc_shared([BH, D], dtype)
            kv_s = T.alloc_shared([BK, D], dtype)
            p_s = T.alloc_shared([BH, BK], dtype)
            idx_s = T.alloc_shared([BK], "int32")
            s = T.alloc_fragment([BH, BK], accum)
            acc = T.alloc_fragment([BH, D], accum)
            m = T.alloc_fragment([BH], accum)
            m_prev = T.alloc_fragment([BH], accum)
            alpha = T.alloc_fragment([BH], accum)
            l = T.alloc_fragment([BH], accum)  # noqa: E741
            rsum = T.alloc_fragment([BH], accum)

            for i, d in T.Parallel(BH, D):
                q_s[i, d] = T.if_then_else(hb * BH + i < H, Q[t, hb * BH + i, d], T.cast(0, dtype))
            T.fill(acc, 0)
            # the sink is the first "key": running max = sink (log2 units), running sum = 1
            for i in T.Parallel(BH):
                m[i] = T.if_then_else(hb * BH + i < H, Sink[T.min(hb * BH + i, H - 1)] * LOG2E, 0.0)
                l[i] = 1.0
            for kt in T.Pipelined(T.ceildiv(K, BK), num_stages=num_stages):
                for j in T.Parallel(BK):
                    idx_s[j] = T.if_then_else(kt * BK + j < K, Idx[t, T.min(kt * BK + j, K - 1)], -1)
                for j, d in T.Parallel(BK, D):
                    kv_s[j, d] = T.if_then_else(idx_s[j] >= 0, KV[T.max(idx_s[j], 0), d], T.cast(0, dtype))
                T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BH, BK):
                    s[i, j] = T.if_then_else(idx_s[j] >= 0, s[i, j] * scale_log2, -T.infinity(accum))
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i in T.Parallel(BH):
                    alpha[i] = T.exp2(m_prev[i] - m[i])
                for i, j in T.Parallel(BH, BK):
                    s[i, j] = T.exp2(s[i, j] - m[i])
                T.reduce_sum(s, rsum, dim=1)
                for i in T.Parallel(BH):
                    l[i] = l[i] * alpha[i] + rsum[i]
                for i, d in T.Parallel(BH, D):
                    acc[i, d] = acc[i, d] * alpha[i]
                T.copy(s, p_s)
                T.gemm(p_s, kv_s, acc, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(BH, D):
                if hb * BH + i < H:
                    O[t, hb * BH + i, d] = T.cast(acc[i, d] / l[i], dtype)
            for i in T.Parallel(BH):
                if hb * BH + i < H:
                    Lse2[t, hb * BH + i] = m[i] + T.log2(l[i])

    return _compile(sparse_attn_fwd)


@functools.lru_cache(maxsize=None)
def dq_kernel(H: int, D: int, dtype: str, BH: int = 64, BK: int = 32, threads: int = 256,
              num_stages: int = 1):
    import tilelang.language as T

    accum = "float32"
    NT, NKV, K = T.dynamic("NT, NKV, K")

    @T.prim_func
    def sparse_attn_bwd_dq(Q: T.Tensor([NT, H, D], dtype), KV: T.Tensor([NKV, D], dtype),
                           Idx: T.Tensor([NT, K], "int32"), DO: T.Tensor([NT, H, D], dtype),
                           Lse2: T.Tensor([NT, H], accum), Delta: T.Tensor([NT, H], accum),
                           DQ: T.Tensor([NT, H, D], dtype), PT: T.Tensor([NT, H, K], dtype),
                           DST: T.Tensor([NT, H, K], dtype), scale: T.float32, scale_log2: T.float32):
        with T.Kernel(T.ceildiv(H, BH), NT, threads=threads) as (hb, t):
            q_s = T.alloc_shared([BH, D], dtype)
            do_s = T.alloc_shared([BH, D], dtype)
            kv_s = T.alloc_shared([BK, D], dtype)
            ds_s = T.alloc_shared([BH, BK], dtype)
            idx_s = T.alloc_shared([BK], "int32")
            lse_s = T.alloc_shared([BH], accum)
            delta_s = T.alloc_shared([BH], accum)
            s = T.alloc_fragment([BH, BK], accum)
            dp = T.alloc_fragment([BH, BK], accum)
            dq = T.alloc_fragment([BH, D], accum)

            for i, d in T.Parallel(BH, D):
                q_s[i, d] = T.if_then_else(hb * BH + i < H, Q[t, hb * BH + i, d], T.cast(0, dtype))
                do_s[i, d] = T.if_then_else(hb * BH + i < H, DO[t, hb * BH + i, d], T.cast(0, dtype))
            for i in T.Parallel(BH):
                lse_s[i] = T.if_then_else(hb * BH + i < H, Lse2[t, T.min(hb * BH + i, H - 1)], 0.0)
                delta_s[i] = T.if_then_else(hb * BH + i < H, Delta[t, T.min(hb * BH + i, H - 1)], 0.0)
            T.fill(dq, 0)
            for kt in T.Pipelined(T.ceildiv(K, BK), num_stages=num_stages):
                for j in T.Parallel(BK):
                    idx_s[j] = T.if_then_else(kt * BK + j < K, Idx[t, T.min(kt * BK + j, K - 1)], -1)
                for j, d in T.Parallel(BK, D):
                    kv_s[j, d] = T.if_then_else(idx_s[j] >= 0, KV[T.max(idx_s[j], 0), d], T.cast(0, dtype))
                T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, kv_s, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BH, BK):
                    s[i, j] = T.if_then_else((idx_s[j] >= 0) & (hb * BH + i < H),
                                             T.exp2(s[i, j] * scale_log2 - lse_s[i]), 0.0)
                for i, j in T.Parallel(BH, BK):
                    dp[i, j] = s[i, j] * (dp[i, j] - delta_s[i])
                T.copy(dp, ds_s)
                for i, j in T.Parallel(BH, BK):
                    if (hb * BH + i < H) & (kt * BK + j < K):
                        PT[t, hb * BH + i, kt * BK + j] = T.cast(s[i, j], dtype)
                        DST[t, hb * BH + i, kt * BK + j] = T.cast(dp[i, j] * scale, dtype)
                T.gemm(ds_s, kv_s, dq, policy=T.GemmWarpPolicy.FullRow)
            for i, d in T.Parallel(BH, D):
                if hb * BH + i < H:
                    DQ[t, hb * BH + i, d] = T.cast(dq[i, d] * scale, dtype)

    return _compile(sparse_attn_bwd_dq)


@functools.lru_cache(maxsize=None)
def dkv_kernel(H: int, D: int, dtype: str, BK: int = 64, DC: int = 64, threads: int = 128, num_stages: int = 1):
    import tilelang.language as T

    accum = "float32"
    HP = _pow2_at_least(H)
    NT, NKV, K = T.dynamic("NT, NKV, K")

    @T.prim_func
    def sparse_attn_bwd_dkv(Q: T.Tensor([NT, H, D], dtype), DO: T.Tensor([NT, H, D], dtype),
                            Idx: T.Tensor([NT, K], "int32"), PT: T.Tensor([NT, H, K], dtype),
                            DST: T.Tensor([NT, H, K], dtype), DKV: T.Tensor([NKV, D], accum)):
        with T.Kernel(D // DC, NT, threads=threads) as (c, t):
            q_s = T.alloc_shared([HP, DC], dtype)
            do_s = T.alloc_shared([HP, DC], dtype)
            p_s = T.alloc_shared([HP, BK], dtype)
            ds_s = T.alloc_shared([HP, BK], dtype)
            idx_s = T.alloc_shared([BK], "int32")
            acc = T.alloc_fragment([BK, DC], accum)

            for h, d in T.Parallel(HP, DC):
                q_s[h, d] = T.if_then_else(h < H, Q[t, T.min(h, H - 1), c * DC + d], T.cast(0, dtype))
                do_s[h, d] = T.if_then_else(h < H, DO[t, T.min(h, H - 1), c * DC + d], T.cast(0, dtype))
            for kt in T.Pipelined(T.ceildiv(K, BK), num_stages=num_stages):
                for j in T.Parallel(BK):
                    idx_s[j] = T.if_then_else(kt * BK + j < K, Idx[t, T.min(kt * BK + j, K - 1)], -1)
                for h, j in T.Parallel(HP, BK):
                    p_s[h, j] = T.if_then_else((h < H) & (kt * BK + j < K),
                                               PT[t, T.min(h, H - 1), T.min(kt * BK + j, K - 1)], T.cast(0, dtype))
                    ds_s[h, j] = T.if_then_else((h < H) & (kt * BK + j < K),
                                                DST[t, T.min(h, H - 1), T.min(kt * BK + j, K - 1)], T.cast(0, dtype))
                T.gemm(ds_s, q_s, acc, transpose_A=True, clear_accum=True)
                T.gemm(p_s, do_s, acc, transpose_A=True)
                for j, d in T.Parallel(BK, DC):
                    if idx_s[j] >= 0:
                        T.atomic_add(DKV[idx_s[j], c * DC + d], acc[j, d])

    return _compile(sparse_attn_bwd_dkv)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor) -> None:
    gpu_common.check_attention_inputs(q, kv, idx, sink, "tilelang")


def sparse_attention_fwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                         scale: float, config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward only. Returns ``o [T,H,D]`` (q.dtype) and ``lse2 [T,H]`` fp32 in log2 units."""
    _check(q, kv, idx, sink)
    cfg = {**FWD_CONFIG, **(config or {})}
    q, kv = q.contiguous(), kv.contiguous()
    idx = idx.to(torch.int32).contiguous()
    sink = sink.to(torch.float32).contiguous()
    T, H, D = q.shape
    o = torch.empty_like(q)
    lse2 = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return o, lse2
    if idx.shape[1] == 0:  # no slot at all: the sink alone
        o.zero_()
        lse2.copy_(sink[None, :].expand(T, H) * LOG2E)
        return o, lse2
    k = fwd_kernel(H, D, _DTYPES[q.dtype], cfg["BH"], cfg["BK"], cfg["threads"], cfg["num_stages"])
    k(q, kv, idx, sink, o, lse2, float(scale) * LOG2E)
    return o, lse2


def sparse_attention_bwd(q, kv, idx, sink, o, lse2, do, scale, config: Optional[dict] = None):
    """Backward. Returns ``dq [T,H,D]`` (q.dtype), ``dkv [Tkv,D]`` (kv.dtype), ``dsink [H]`` fp32."""
    cfg = {**BWD_CONFIG, **(config or {})}
    q, kv, o, do = q.contiguous(), kv.contiguous(), o.contiguous(), do.contiguous()
    idx = idx.to(torch.int32).contiguous()
    T, H, D = q.shape
    K = idx.shape[1]
    delta = (o.float() * do.float()).sum(-1)
    dq = torch.zeros_like(q)
    dkv32 = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if T > 0 and K > 0:
        dt = _DTYPES[q.dtype]
        pt = torch.empty(T, H, K, dtype=q.dtype, device=q.device)
        dst = torch.empty(T, H, K, dtype=q.dtype, device=q.device)
        dq_kernel(H, D, dt, cfg["BH"], cfg["BK"], cfg["threads"], cfg["num_stages"])(
            q, kv, idx, do, lse2.contiguous(), delta, dq, pt, dst, float(scale), float(scale) * LOG2E)
        DC = min(cfg["DC"], D)
        dkv_kernel(H, D, dt, cfg["BK2"], DC, cfg["threads2"], cfg["num_stages2"])(q, do, idx, pt, dst, dkv32)
    dsink = gpu_common.dsink_from_delta(delta, sink, lse2)
    return dq, dkv32.to(kv.dtype), dsink


def _kernel_supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    return gpu_common.half_pow2_head_dim(q, kv) and q.is_cuda


# THD and batched entry points over the dsv4_tilelang custom ops (kernels.gpu_ops: autograd, torch.compile);
# bf16/fp16 CUDA inputs with a power-of-two head dim >= 32 run the TileLang kernels; anything else, fp32/fp64,
# odd head dims, CPU tensors, is refused with the fix
sparse_attention_with_sink_thd, sparse_attention_with_sink = gpu_common.make_attention_api(
    gpu_ops.TILELANG, _check, _kernel_supports, __name__)
