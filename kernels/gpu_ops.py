"""The GPU kernel backends' launchers as ``torch.library`` custom ops, so ``torch.compile`` traces through them.

Why: a kernel launcher is Python that ``torch.compile`` cannot trace (Triton's JIT, TileLang's JIT, raw data
pointers), and an opaque call (``torch.compiler.disable``) splits every compiled block into many small graphs
that Inductor cannot fuse across. A custom op is one node of the graph instead: Dynamo, AOTAutograd and
Inductor see only its schema and its *fake* implementation (the output shapes and dtypes), the real launcher
runs when the compiled graph runs. The backward of an op with a gradient is a custom op of its own, wired
with ``register_autograd``, so AOTAutograd puts it in the compiled backward graph.

Ops, per namespace (``dsv4_triton``, ``dsv4_tilelang``, ``dsv4_cuda``; :data:`TRITON`, :data:`TILELANG`,
:data:`CUDA`), all on flattened contiguous layouts (the entry points reshape; outputs are fresh contiguous
tensors):

* ``sparse_attention_fwd(q [T,H,D], kv [Tkv,D], idx [T,K], sink [H], scale) -> (o [T,H,D] q.dtype,
  lse2 [T,H] fp32 log2 units)``, with autograd through ``sparse_attention_bwd(q, kv, idx, sink, o, lse2, do,
  scale) -> (dq, dkv, dsink [H] fp32)``;
  (``dsv4_cuda`` has only these two: its forward is the CUDA C++ kernel, its backward the Triton one);
* ``indexer_scores(q [T,H,D], k [N,D], w [T,H], ks?, ke?) -> [T,N] fp32``, or for triton a batch
  ``(q [B,S,H,D], k [B,N,D], w [B,S,H]) -> [B,S,N]`` in one launch (no backward: the entry point
  refuses inputs that require a gradient before the op is reached);
* triton only, the fused mHC kernels (``x [T,n,d]``, fp32 mapping weights): ``hc_pre -> (u [T,d], post [T,n],
  comb [T,n,n], pre [T,NP], mix [T,MP], rho [T])`` (the last three are what its backward reads),
  ``hc_head -> (y [T,d], pre, mix, rho)``, ``hc_post(f [T,d], x, post, comb) -> [T,n,d]``,
  ``sinkhorn(logits [T,n,n], iters, eps) -> [T,n,n]``, each with a ``<name>_bwd`` op;
* triton only, ``rope(x [R,D], cos [N,r/2] fp32, sin, heads, inverse) -> [R,D]``: its backward is the same op
  with ``not inverse`` (a rotation's inverse); ``rms_normalize(x [R,D], eps, out_dtype) -> [R,D]`` with
  ``rms_normalize_bwd(x, dy, eps) -> dx``; ``rms_norm(x [R,D], w [D], eps) -> [R,D]`` (x's dtype) with
  ``rms_norm_bwd(x, w, dy, eps) -> (dx, dw)``; ``weighted_swiglu(h [N,2F], w [N], limit, out_dtype) -> [N,F]`` with
  ``weighted_swiglu_bwd(h, w, da, limit) -> (dh, dw)``; ``logprob_stats(logits [N,V] fp32, labels [N], temperature)
  -> (lp [N], lse [N])`` and ``logprob_grad(logits, labels, lse, g [N], temperature, out_dtype) -> [N,V]`` (the
  output head's log-prob passes, called by ``kernels.triton.logprobs``'s autograd function);
  ``experts_grouped_mm(x [R,K], w [E,N,K], offs [E] int32) -> [R,N]`` (the decode step's routed experts, rows
  sorted by expert; no backward); ``hadamard(x [R,n]) -> [R,n]`` (the Walsh-Hadamard transform; its backward is
  the same op).

The real implementations are bound lazily (``kernels.<backend>.<module>`` is imported on the first real call),
so this module imports only torch: the schemas and fake implementations load, and can be tested, on a machine
without triton or tilelang. The input checks (refusals with the fix) stay in the backends' entry points, which
run before an op is called, so they also run while ``torch.compile`` traces. The entry points that call only
torch code and these ops carry ``traceable = True`` (:func:`traceable`); ``engine.compile`` keeps them in the
compiled graph.

``custom_op``, not ``triton_op``: one registration serves both backends (TileLang's launchers are not Triton),
and Inductor could not fuse into these hand-written kernels anyway; it fuses the torch code around them.
"""

import importlib
import types
from typing import Callable, Optional

import torch

__all__ = ["TRITON", "TILELANG", "CUDA", "traceable", "padded", "mix_width"]


def traceable(fn: Callable) -> Callable:
    """Mark ``fn`` (an op-table entry point) as built from torch code and registered custom ops only, so
    ``torch.compile`` traces it without a graph break (``engine.compile.opaque_kernel_ops`` reads the mark)."""
    fn.traceable = True
    return fn


def padded(n: int) -> int:
    """``n`` rounded up to a power of two (the side of a token's mHC register tile, ``NP``); a loop of
    comparisons, so a fake implementation may pass a symbolic size."""
    p = 1
    while p < n:
        p *= 2
    return p


def mix_width(m: int) -> int:
    """The mHC mixing GEMM's padded width ``MP``: a power of two >= 16 (``tl.dot``'s smallest)."""
    return max(16, padded(m))


def _launcher(module: str, name: str) -> Callable:
    """``kernels.<backend>.<module>.<name>``, imported on the first real call (not when tracing)."""
    return getattr(importlib.import_module(module), name)


def _empty(like: torch.Tensor, *shape, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)


# ----------------------------------------------------------------------------------------------
# sparse attention with sink
# ----------------------------------------------------------------------------------------------


def _attention_ops(ns: str, module: str) -> dict:
    @torch.library.custom_op(f"{ns}::sparse_attention_fwd", mutates_args=())
    def fwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _launcher(module, "sparse_attention_fwd")(q, kv, idx, sink, scale)

    @fwd.register_fake
    def _(q, kv, idx, sink, scale):
        T, H, _ = q.shape
        return _empty(q, *q.shape), _empty(q, T, H, dtype=torch.float32)

    @torch.library.custom_op(f"{ns}::sparse_attention_bwd", mutates_args=())
    def bwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, o: torch.Tensor,
            lse2: torch.Tensor, do: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launcher(module, "sparse_attention_bwd")(q, kv, idx, sink, o, lse2, do, scale)

    @bwd.register_fake
    def _(q, kv, idx, sink, o, lse2, do, scale):
        return _empty(q, *q.shape), _empty(kv, *kv.shape), _empty(q, q.shape[1], dtype=torch.float32)

    def setup(ctx, inputs, output):
        q, kv, idx, sink, scale = inputs
        ctx.save_for_backward(q, kv, idx, sink, *output)
        ctx.scale = scale

    def backward(ctx, do, _dlse2):  # lse2 is not differentiable: the entry points hand it on detached
        q, kv, idx, sink, o, lse2 = ctx.saved_tensors
        dq, dkv, dsink = bwd(q, kv, idx, sink, o, lse2, _grad(do, torch.zeros_like, o), ctx.scale)
        return dq, dkv, None, dsink.to(sink.dtype), None

    fwd.register_autograd(backward, setup_context=setup)
    return dict(sparse_attention_fwd=fwd, sparse_attention_bwd=bwd)


def _grad(g: Optional[torch.Tensor], zeros: Callable, *args, **kwargs) -> torch.Tensor:
    """An output's incoming gradient, ``zeros(*args, **kwargs)`` where autograd passes none."""
    return zeros(*args, **kwargs) if g is None else g


# ----------------------------------------------------------------------------------------------
# indexer
# ----------------------------------------------------------------------------------------------


def _indexer_ops(ns: str, module: str) -> dict:
    @torch.library.custom_op(f"{ns}::indexer_scores", mutates_args=())
    def scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: Optional[torch.Tensor],
               ke: Optional[torch.Tensor]) -> torch.Tensor:
        return _launcher(module, "indexer_scores_launch")(q, k, w, ks, ke)

    @scores.register_fake
    def _(q, k, w, ks, ke):     # THD [T,H,D] x [N,D] -> [T,N]; a batch [B,S,H,D] x [B,N,D] -> [B,S,N] (triton)
        return _empty(q, *q.shape[:-2], k.shape[-2], dtype=torch.float32)

    return dict(indexer_scores=scores)


# ----------------------------------------------------------------------------------------------
# mHC (triton): hc_pre / hc_head share the mixing GEMM + coefficient kernels (``kernels/triton/mhc.py``)
# ----------------------------------------------------------------------------------------------


def _coef_fake(x, fn, has_res):
    T, n, d = x.shape
    f32 = torch.float32
    saved = (_empty(x, T, padded(n), dtype=f32), _empty(x, T, mix_width(fn.shape[0]), dtype=f32),
             _empty(x, T, dtype=f32))
    u = _empty(x, T, d)
    return (u, _empty(x, T, n, dtype=f32), _empty(x, T, n, n, dtype=f32), *saved) if has_res else (u, *saved)


def _mhc_ops(ns: str, module: str) -> dict:
    mhc, sink_mod = f"{module}.mhc", f"{module}.sinkhorn"
    T6 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    T4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

    @torch.library.custom_op(f"{ns}::hc_pre", mutates_args=())
    def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
               hc_eps: float, iters: int) -> T6:
        return _launcher(mhc, "hc_pre_fwd")(x, fn, scale, base, norm_eps, hc_eps, iters)

    hc_pre.register_fake(lambda x, fn, scale, base, norm_eps, hc_eps, iters: _coef_fake(x, fn, True))

    @torch.library.custom_op(f"{ns}::hc_pre_bwd", mutates_args=())
    def hc_pre_bwd(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, pre: torch.Tensor,
                   mix: torch.Tensor, rho: torch.Tensor, du: torch.Tensor, dpost: torch.Tensor, dcomb: torch.Tensor,
                   hc_eps: float, iters: int) -> T4:
        return _launcher(mhc, "hc_pre_bwd")(x, fn, scale, base, pre, mix, rho, du, dpost, dcomb, hc_eps, iters)

    @torch.library.custom_op(f"{ns}::hc_head", mutates_args=())
    def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                hc_eps: float) -> T4:
        return _launcher(mhc, "hc_head_fwd")(x, fn, scale, base, norm_eps, hc_eps)

    hc_head.register_fake(lambda x, fn, scale, base, norm_eps, hc_eps: _coef_fake(x, fn, False))

    @torch.library.custom_op(f"{ns}::hc_head_bwd", mutates_args=())
    def hc_head_bwd(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, pre: torch.Tensor,
                    mix: torch.Tensor, rho: torch.Tensor, dy: torch.Tensor, hc_eps: float) -> T4:
        return _launcher(mhc, "hc_head_bwd")(x, fn, scale, base, pre, mix, rho, dy, hc_eps)

    def coef_bwd_fake(x, fn, scale, base, *rest):
        return _empty(x, *x.shape), _empty(fn, *fn.shape), _empty(scale, *scale.shape), _empty(base, *base.shape)

    hc_pre_bwd.register_fake(coef_bwd_fake)
    hc_head_bwd.register_fake(coef_bwd_fake)

    def pre_setup(ctx, inputs, output):
        x, fn, scale, base, _, hc_eps, iters = inputs
        ctx.save_for_backward(x, fn, scale, base, *output[3:])
        ctx.hc_eps, ctx.iters = hc_eps, iters

    def pre_backward(ctx, du, dpost, dcomb, *_saved):
        x, fn, scale, base, pre, mix, rho = ctx.saved_tensors
        T, n, d = x.shape
        f32 = torch.float32
        grads = hc_pre_bwd(x, fn, scale, base, pre, mix, rho, _grad(du, x.new_zeros, T, d),
                           _grad(dpost, x.new_zeros, T, n, dtype=f32), _grad(dcomb, x.new_zeros, T, n, n, dtype=f32),
                           ctx.hc_eps, ctx.iters)
        return (*grads, None, None, None)

    def head_setup(ctx, inputs, output):
        x, fn, scale, base, _, hc_eps = inputs
        ctx.save_for_backward(x, fn, scale, base, *output[1:])
        ctx.hc_eps = hc_eps

    def head_backward(ctx, dy, *_saved):
        x, fn, scale, base, pre, mix, rho = ctx.saved_tensors
        dy = _grad(dy, x.new_zeros, x.shape[0], x.shape[2])
        return (*hc_head_bwd(x, fn, scale, base, pre, mix, rho, dy, ctx.hc_eps), None, None)

    hc_pre.register_autograd(pre_backward, setup_context=pre_setup)
    hc_head.register_autograd(head_backward, setup_context=head_setup)

    @torch.library.custom_op(f"{ns}::hc_post", mutates_args=())
    def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return _launcher(mhc, "hc_post_fwd")(f, x, post, comb)

    hc_post.register_fake(lambda f, x, post, comb: _empty(x, *x.shape))

    @torch.library.custom_op(f"{ns}::hc_post_bwd", mutates_args=())
    def hc_post_bwd(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    g: torch.Tensor) -> T4:
        return _launcher(mhc, "hc_post_bwd")(f, x, post, comb, g)

    hc_post_bwd.register_fake(lambda f, x, post, comb, g: tuple(_empty(t, *t.shape) for t in (f, x, post, comb)))

    def post_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def post_backward(ctx, g):
        f, x, post, comb = ctx.saved_tensors
        return hc_post_bwd(f, x, post, comb, _grad(g, torch.zeros_like, x))

    hc_post.register_autograd(post_backward, setup_context=post_setup)

    @torch.library.custom_op(f"{ns}::sinkhorn", mutates_args=())
    def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return _launcher(sink_mod, "sinkhorn_fwd")(logits, iters, eps)

    sinkhorn.register_fake(lambda logits, iters, eps: _empty(logits, *logits.shape))

    @torch.library.custom_op(f"{ns}::sinkhorn_bwd", mutates_args=())
    def sinkhorn_bwd(logits: torch.Tensor, g: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return _launcher(sink_mod, "sinkhorn_bwd")(logits, g, iters, eps)

    sinkhorn_bwd.register_fake(lambda logits, g, iters, eps: _empty(logits, *logits.shape))

    def sinkhorn_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.iters, ctx.eps = inputs[1], inputs[2]

    def sinkhorn_backward(ctx, g):
        (logits,) = ctx.saved_tensors
        return sinkhorn_bwd(logits, _grad(g, torch.zeros_like, logits), ctx.iters, ctx.eps), None, None

    sinkhorn.register_autograd(sinkhorn_backward, setup_context=sinkhorn_setup)
    return dict(hc_pre=hc_pre, hc_pre_bwd=hc_pre_bwd, hc_head=hc_head, hc_head_bwd=hc_head_bwd, hc_post=hc_post,
                hc_post_bwd=hc_post_bwd, sinkhorn=sinkhorn, sinkhorn_bwd=sinkhorn_bwd)


# ----------------------------------------------------------------------------------------------
# rotary position embedding (triton): the backward is the inverse rotation, the same kernel
# ----------------------------------------------------------------------------------------------


def _rope_ops(ns: str, module: str) -> dict:
    @torch.library.custom_op(f"{ns}::rope", mutates_args=())
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, inverse: bool) -> torch.Tensor:
        return _launcher(module, "rope_launch")(x, cos, sin, heads, inverse)

    rope.register_fake(lambda x, cos, sin, heads, inverse: torch.empty_like(x))

    def setup(ctx, inputs, output):
        _, cos, sin, ctx.heads, ctx.inverse = inputs
        ctx.save_for_backward(cos, sin)

    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return rope(g.contiguous(), cos, sin, ctx.heads, not ctx.inverse), None, None, None, None

    rope.register_autograd(backward, setup_context=setup)
    return dict(rope=rope)


def _norm_ops(ns: str, module: str) -> dict:
    @torch.library.custom_op(f"{ns}::rms_normalize", mutates_args=())
    def rms_normalize(x: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        return _launcher(module, "rms_normalize_launch")(x, eps, out_dtype)

    rms_normalize.register_fake(lambda x, eps, out_dtype: x.new_empty(x.shape, dtype=out_dtype))

    @torch.library.custom_op(f"{ns}::rms_normalize_bwd", mutates_args=())
    def rms_normalize_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
        return _launcher(module, "rms_normalize_bwd_launch")(x, dy, eps)

    rms_normalize_bwd.register_fake(lambda x, dy, eps: torch.empty_like(x))

    def setup(ctx, inputs, output):
        x, ctx.eps, _ = inputs
        ctx.save_for_backward(x)

    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return rms_normalize_bwd(x, dy.contiguous(), ctx.eps), None, None

    rms_normalize.register_autograd(backward, setup_context=setup)
    return dict(rms_normalize=rms_normalize, rms_normalize_bwd=rms_normalize_bwd, **_weighted_norm_ops(ns, module))


def _weighted_norm_ops(ns: str, module: str) -> dict:
    @torch.library.custom_op(f"{ns}::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return _launcher(module, "rms_norm_launch")(x, w, eps)

    rms_norm.register_fake(lambda x, w, eps: torch.empty_like(x))

    @torch.library.custom_op(f"{ns}::rms_norm_bwd", mutates_args=())
    def rms_norm_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return _launcher(module, "rms_norm_bwd_launch")(x, w, dy, eps)

    rms_norm_bwd.register_fake(lambda x, w, dy, eps: (torch.empty_like(x), torch.empty_like(w)))

    def setup(ctx, inputs, output):
        x, w, ctx.eps = inputs
        ctx.save_for_backward(x, w)

    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = rms_norm_bwd(x, w, dy.contiguous(), ctx.eps)
        return dx, dw, None

    rms_norm.register_autograd(backward, setup_context=setup)
    return dict(rms_norm=rms_norm, rms_norm_bwd=rms_norm_bwd)


def _swiglu_ops(ns: str, module: str) -> dict:
    @torch.library.custom_op(f"{ns}::weighted_swiglu", mutates_args=())
    def weighted_swiglu(h: torch.Tensor, w: torch.Tensor, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
        return _launcher(module, "weighted_swiglu_launch")(h, w, limit, out_dtype)

    weighted_swiglu.register_fake(
        lambda h, w, limit, out_dtype: h.new_empty((h.shape[0], h.shape[1] // 2), dtype=out_dtype))

    @torch.library.custom_op(f"{ns}::weighted_swiglu_bwd", mutates_args=())
    def weighted_swiglu_bwd(h: torch.Tensor, w: torch.Tensor, da: torch.Tensor, limit: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return _launcher(module, "weighted_swiglu_bwd_launch")(h, w, da, limit)

    weighted_swiglu_bwd.register_fake(lambda h, w, da, limit: (torch.empty_like(h), torch.empty_like(w)))

    def setup(ctx, inputs, output):
        h, w, ctx.limit, _ = inputs
        ctx.save_for_backward(h, w)

    def backward(ctx, da):
        h, w = ctx.saved_tensors
        dh, dw = weighted_swiglu_bwd(h, w, da.contiguous(), ctx.limit)
        return dh, dw, None, None

    weighted_swiglu.register_autograd(backward, setup_context=setup)
    return dict(weighted_swiglu=weighted_swiglu, weighted_swiglu_bwd=weighted_swiglu_bwd)


def _hadamard_ops(ns: str, module: str) -> dict:
    """The Walsh-Hadamard transform (``kernels.triton.hadamard``): symmetric and its own inverse, so its backward
    is the same op on the upstream gradient."""
    @torch.library.custom_op(f"{ns}::hadamard", mutates_args=())
    def hadamard(x: torch.Tensor) -> torch.Tensor:
        return _launcher(module, "hadamard_launch")(x)

    hadamard.register_fake(lambda x: torch.empty_like(x))

    def backward(ctx, g):
        return hadamard(g.contiguous())

    hadamard.register_autograd(backward)
    return dict(hadamard=hadamard)


def _experts_ops(ns: str, module: str) -> dict:
    """The routed experts' grouped GEMM for few rows per expert (``kernels.triton.experts``; decode only, so no
    gradient)."""
    @torch.library.custom_op(f"{ns}::experts_grouped_mm", mutates_args=())
    def experts_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return _launcher(module, "experts_grouped_mm_launch")(x, w, offs)

    experts_grouped_mm.register_fake(lambda x, w, offs: x.new_empty((x.shape[0], w.shape[1])))
    return dict(experts_grouped_mm=experts_grouped_mm)


def _logprob_ops(ns: str, module: str) -> dict:
    """The output head's log-prob passes (``kernels.triton.logprobs``; its autograd function runs the GEMMs and
    calls these two, so neither registers a gradient)."""
    @torch.library.custom_op(f"{ns}::logprob_stats", mutates_args=())
    def logprob_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return _launcher(module, "logprob_stats_launch")(logits, labels, temperature)

    logprob_stats.register_fake(lambda logits, labels, temperature: (
        _empty(logits, logits.shape[0], dtype=torch.float32), _empty(logits, logits.shape[0], dtype=torch.float32)))

    @torch.library.custom_op(f"{ns}::logprob_grad", mutates_args=())
    def logprob_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                     temperature: float, out_dtype: torch.dtype) -> torch.Tensor:
        return _launcher(module, "logprob_grad_launch")(logits, labels, lse, g, temperature, out_dtype)

    logprob_grad.register_fake(
        lambda logits, labels, lse, g, temperature, out_dtype: _empty(logits, *logits.shape, dtype=out_dtype))
    return dict(logprob_stats=logprob_stats, logprob_grad=logprob_grad)


def _register(ns: str, package: str, mhc: bool, indexer: bool = True, attention: Optional[str] = None,
              elementwise: bool = False) -> types.SimpleNamespace:
    """Register the namespace's ops; returns them as ``torch.ops.<ns>.<name>.default`` (the plain
    ``OpOverload`` every torch version's dynamo traces as a graph node). ``attention``: the module with the
    attention launchers (default ``<package>.attention``)."""
    ops = dict(_attention_ops(ns, attention or f"{package}.attention"))
    if indexer:
        ops.update(_indexer_ops(ns, f"{package}.indexer"))
    if mhc:
        ops.update(_mhc_ops(ns, package))
    if elementwise:              # the fused elementwise kernels: RoPE, the RMS norms, the experts' SwiGLU
        ops.update(_rope_ops(ns, f"{package}.rope"))
        ops.update(_norm_ops(ns, f"{package}.norm"))
        ops.update(_swiglu_ops(ns, f"{package}.swiglu"))
        ops.update(_logprob_ops(ns, f"{package}.logprobs"))
        ops.update(_experts_ops(ns, f"{package}.experts"))
        ops.update(_hadamard_ops(ns, f"{package}.hadamard"))
    library = getattr(torch.ops, ns)
    return types.SimpleNamespace(namespace=ns, **{name: getattr(library, name).default for name in ops})


# registered once per process, when this module is first imported
TRITON = _register("dsv4_triton", "kernels.triton", mhc=True, elementwise=True)
TILELANG = _register("dsv4_tilelang", "kernels.tilelang", mhc=False)
CUDA = _register("dsv4_cuda", "kernels.cuda", mhc=False, indexer=False, attention="kernels.cuda.ops")
