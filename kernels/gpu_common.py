"""Torch-side glue shared by the GPU kernel backends (``kernels/triton``, ``kernels/tilelang``).

The triton and tilelang backends never import each other (the cuda backend is the triton backend with a CUDA
C++ attention forward, and imports it on purpose); each one passes its raw kernel launchers to the helpers here:

* :func:`check_attention_inputs`: the shape / dtype / device checks of the THD attention launchers;
* :func:`dsink_from_delta`: ``d_sink[h] = -sum_t Delta * exp(sink - lse)`` (``lse2`` in log2 units);
* :func:`make_attention_api`: the THD entry point and the batched entry point (same contract as
  ``kernels.reference.attention.sparse_attention_with_sink``) over a backend's ``sparse_attention_fwd`` /
  ``sparse_attention_bwd`` custom ops (``kernels.gpu_ops``, which also gives them their autograd);
* :func:`indexer_scores_batched`, :func:`indexer_topk`: the indexer's batched entry point and top-k;
* :func:`make_ops`: the op table of a backend (its kernels + the reference ops it names for the rest).

Only torch is imported here (no triton, no tilelang).
"""

import contextlib
import os
import threading
import types
from typing import Callable, Optional

import torch

from core.kernel_ops import OpTable
from kernels.gpu_ops import traceable
from kernels.reference.topk import stable_topk

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

HALF_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# sparse attention with sink
# ----------------------------------------------------------------------------------------------


def check_attention_inputs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                           backend: str, need_cuda: bool = True, cuda_hint: str = "") -> None:
    """Raise ``ValueError`` unless ``q [T,H,D]``, ``kv [Tkv,D]``, ``idx [T,K]``, ``sink [H]`` suit the
    ``backend`` kernels (bf16/fp16 q and kv of one dtype, power-of-two head dim >= 32, CUDA tensors when
    ``need_cuda``; ``cuda_hint`` is appended to that message)."""
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or sink.dim() != 1:
        raise ValueError(f"expected q [T,H,D], kv [Tkv,D], idx [T,K], sink [H]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(idx.shape)}, {tuple(sink.shape)}")
    T, H, D = q.shape
    if kv.shape[1] != D or idx.shape[0] != T or sink.shape[0] != H:
        raise ValueError("shape mismatch between q, kv, idx and sink")
    if D < 32 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 32 for the {backend} kernels")
    if q.dtype not in HALF_DTYPES or kv.dtype != q.dtype:
        raise ValueError(f"the {backend} kernels take bf16/fp16 q and kv of one dtype, got {q.dtype}, {kv.dtype}")
    if need_cuda and not (q.is_cuda and kv.is_cuda and idx.is_cuda and sink.is_cuda):
        raise ValueError(f"the {backend} kernels need CUDA tensors{cuda_hint}")


_DEPENDENT = threading.local()


@contextlib.contextmanager
def dependent_launches():
    """Within it the triton decode kernels launch with programmatic dependent launch where the GPU has it
    (``kernels/triton/pdl.py``): the rollout engine's decode step (``rollout.slot_decoder``), its kernels a chain of
    short launches that each wait on the one before. Outside it (training, prefill) they launch as always."""
    before = getattr(_DEPENDENT, "on", False)
    _DEPENDENT.on = True
    try:
        yield
    finally:
        _DEPENDENT.on = before


def dependent_launches_on() -> bool:
    """Whether this thread is inside :func:`dependent_launches`."""
    return getattr(_DEPENDENT, "on", False)


def count_dependent_launch() -> None:
    """Note that a kernel launch of this thread asked for PDL (``kernels/triton/pdl.py``'s ``launch``)."""
    _DEPENDENT.count = getattr(_DEPENDENT, "count", 0) + 1


def dependent_launch_count() -> int:
    """How many kernel launches of this thread have asked for PDL so far: whether a failed step launched any
    (``rollout.slot_decoder`` then names ``DSV4_PDL=0`` in its error)."""
    return getattr(_DEPENDENT, "count", 0)


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``: CPU tensors allowed, for debugging)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def op_refusal(op: str, why: str) -> ValueError:
    """The one-line refusal of a triton elementwise op (``apply_rope``, ``rms_normalize``, ``rms_norm``,
    ``weighted_swiglu``)."""
    return ValueError(f"triton {op}: {why}; run with --kernel-backend none for this input")


def check_op_input(op: str, t: torch.Tensor, name: str, dtypes=(torch.bfloat16, torch.float16, torch.float32)):
    """Refuse (with :func:`op_refusal`) a tensor off CUDA (outside the interpreter) or of another dtype."""
    if not t.is_cuda and not interpreting():
        raise op_refusal(op, f"{name} is on {t.device}, the kernel runs on CUDA tensors (or TRITON_INTERPRET=1 "
                             f"for CPU debugging)")
    if t.dtype not in dtypes:
        takes = [str(d).removeprefix("torch.") for d in dtypes]
        raise op_refusal(op, f"{name} is {t.dtype}; the kernel takes "
                             f"{' or '.join(filter(None, (', '.join(takes[:-1]), takes[-1])))}")


def dsink_from_delta(delta: torch.Tensor, sink: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """``d_sink[h] = -sum_t Delta * exp(sink - lse)``; lse2 is in log2 units, exp(x) = exp2(x*log2e)."""
    return -(delta * torch.exp2(sink.float()[None, :] * LOG2E - lse2)).sum(0)


def local_copy(fn: Callable, module: str) -> Callable:
    """A copy of the function ``fn`` whose ``__module__`` is ``module`` (the backend module that exports it)."""
    f = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__kwdefaults__, f.__doc__, f.__qualname__ = fn.__kwdefaults__, fn.__doc__, fn.__name__
    f.__dict__.update(fn.__dict__)
    f.__module__ = module
    return f


def make_attention_api(ops, check: Callable, kernel_supports: Callable, module: str):
    """Entry points over one backend's attention custom ops (``ops``: its namespace of
    :mod:`kernels.gpu_ops`, whose ``sparse_attention_fwd`` carries the backward through
    ``sparse_attention_bwd``).

    ``check(q, kv, idx, sink)`` raises for THD inputs the kernels do not take (it runs before the op, so also
    while ``torch.compile`` traces); ``kernel_supports(q, kv)`` says whether batched inputs run the kernels
    (else they are refused); ``module`` (the backend module's ``__name__``) becomes the ``__module__`` of what
    is returned. Returns ``(sparse_attention_with_sink_thd, sparse_attention_with_sink)``, both
    :func:`kernels.gpu_ops.traceable`."""
    backend = module.split(".")[1] if module.startswith("kernels.") else module

    def sparse_attention_with_sink_thd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                                       scale: Optional[float] = None, return_lse: bool = False):
        """THD entry point: ``q [T,H,D]``, ``kv [Tkv,D]``, ``idx [T,K]`` (int32/int64, ``-1`` = empty),
        ``sink [H]`` -> ``o [T,H,D]`` (and ``lse [T,H]`` fp32, natural log, not differentiable, when
        ``return_lse``)."""
        check(q, kv, idx, sink)
        if scale is None:
            scale = q.shape[-1] ** -0.5
        o, lse2 = ops.sparse_attention_fwd(q, kv, idx, sink, float(scale))
        return (o, lse2.detach() * LN2) if return_lse else o

    def sparse_attention_with_sink(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                   sink: torch.Tensor, scale: float) -> torch.Tensor:
        """Same contract as ``kernels.reference.attention.sparse_attention_with_sink``:
        ``q [B,S,H,D]``, ``kv [B,N,D]``, ``indices [B,S,K]`` or ``[S,K]`` (``-1`` = ignore), ``sink [H]``.

        Inputs the kernels take (bf16/fp16, power-of-two head dim >= 32; the backend says which) run them,
        batch flattened to THD with row ids offset by ``b*N``; anything else is refused (:func:`refusal`):
        the reference op is a backend of its own (``--kernel-backend none``), never a silent stand-in."""
        B, S, H, D = q.shape
        N = kv.shape[1]
        if not kernel_supports(q, kv):
            raise refusal(backend, "sparse attention", q, kv)
        if indices.dim() == 2:
            indices = indices.unsqueeze(0).expand(B, -1, -1)
        idx = indices.to(torch.int64)
        if B > 1:
            # batch b's rows start at b*N; -1 stays -1 (a scalar, not a filled tensor: one kernel fewer per call).
            # One batch's ids are the rows as they are, and the kernels take int64: a decode step of one
            # sequence made these four launches and a cast in every layer
            offs = torch.arange(0, B * N, N, device=idx.device, dtype=torch.int64).view(B, 1, 1)
            idx = torch.where(idx >= 0, idx + offs, -1)
        o = sparse_attention_with_sink_thd(q.reshape(B * S, H, D), kv.reshape(B * N, D),
                                           idx.reshape(B * S, -1), sink, scale)
        return o.view(B, S, H, D)

    for obj in (sparse_attention_with_sink_thd, sparse_attention_with_sink):
        obj.__module__ = module
        obj.__qualname__ = obj.__name__
        traceable(obj)
    return sparse_attention_with_sink_thd, sparse_attention_with_sink


def refusal(backend: str, what: str, q: torch.Tensor, kv: torch.Tensor) -> ValueError:
    """The error a GPU backend raises for inputs its kernels do not take (instead of handing them on)."""
    return ValueError(
        f"the {backend} {what} kernels take bf16/fp16 CUDA tensors with a power-of-two head dim >= 32; got "
        f"{q.dtype} / {kv.dtype}, head dim {q.shape[-1]}, on {q.device}. Fix: run with --dtype bf16 on a GPU "
        f"target, or choose --kernel-backend none (the PyTorch reference ops) for this input")


def half_pow2_head_dim(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """bf16/fp16 q and kv of one dtype with a power-of-two head dim >= 32."""
    D = q.shape[-1]
    return q.dtype in HALF_DTYPES and kv.dtype == q.dtype and not (D < 32 or D & (D - 1))


# ----------------------------------------------------------------------------------------------
# indexer
# ----------------------------------------------------------------------------------------------


def indexer_scores_batched(scores_thd: Callable, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``q [B,S,H,D]``, ``k [B,N,D]``, ``w [B,S,H]`` -> fp32 ``[B,S,N]``, one ``scores_thd`` call per batch."""
    B, S, H, D = q.shape
    return torch.stack([scores_thd(q[b], k[b], w[b]) for b in range(B)]) if B else \
        q.new_empty(0, S, k.shape[1], dtype=torch.float32)


def refuse_grad(backend: str, *tensors: torch.Tensor) -> None:
    """The indexer kernels have no backward: refuse inputs that want a gradient rather than drop it."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(f"the {backend} indexer kernel has no backward, and its inputs require a gradient (a "
                         f"trained indexer: megatron's indexer KL loss). Fix: train the indexer with "
                         f"--kernel-backend none, or keep it frozen (no indexer KL loss)")


@traceable
def indexer_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The reference model's stable top-k (``kernels.reference.topk.stable_topk``: ties -> lowest id,
    ids ascending, ``-1`` padding last where fewer scores are finite) over the last dim of the kernel's
    fp32 scores, so a GPU backend picks the entries the reference picks. Returns int32 ``[..., min(topk, N)]``."""
    return stable_topk(scores, topk).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# op table
# ----------------------------------------------------------------------------------------------

GPU_DTYPES = ("bf16", "fp16")

#: the most tokens the triton ``hc_pre_norm`` serves in one launch (``kernels/triton/mhc_decode.py``: its last program
#: reads every token's streams alone); here, torch-only, for ``bench.decode_launches``' count of that op's launches.
#: On one H100 a Flash-shaped site took 10.8 us in one launch against 16.6 in the four kernels at one token, 13.7
#: against 16.6 at two, 19.7 against 17.7 at four (bench/results/kernels-decode-sweep-h100-mhc.json); the decode
#: step's graphs hold 1, 2, 4, ... slots
PRE_NORM_MAX_TOKENS = 2


#: mean rows an expert above which the triton expert GEMMs take their many-rows settings (:func:`experts_wide`)
EXPERTS_WIDE_FROM = 8


def experts_wide(rows: int, experts: int) -> bool:
    """Whether the triton expert GEMMs take their many-rows settings for ``rows`` rows over ``experts``: more than
    :data:`EXPERTS_WIDE_FROM` rows an expert on average (``kernels/triton/experts.py``'s ``launch_settings``; there
    ``experts_swiglu_scatter_mm`` also runs the activation's own kernel first). Torch-only, so that
    ``bench.decode_launches`` counts those launches too."""
    return -(-rows // max(experts, 1)) > EXPERTS_WIDE_FROM


MHC_OPS = ("sinkhorn", "hc_pre", "hc_post", "hc_head")


def make_ops(backend: str, attention, indexer, mhc=None, rope=None, norm=None, swiglu=None,
             logprobs=None, experts=None, hadamard=None, sampling=None, routing=None, compress=None,
             norm_rope=None, topk=None, index_query=None, linear_group=None, mhc_decode=None,
             decode_attention=None) -> OpTable:
    """The op table of a GPU backend: its ``attention`` / ``indexer`` modules' kernels under the reference
    op names plus the THD extras, the mHC ops (``MHC_OPS``) of its ``mhc`` module, ``apply_rope`` of its
    ``rope`` module, ``rms_normalize`` and ``rms_norm`` of its ``norm`` module, ``weighted_swiglu`` of its
    ``swiglu`` module, ``head_logprobs`` of its ``logprobs`` module and ``hadamard_transform`` of its ``hadamard``
    module when it has them; the reference ops (backend ``none``) for every op it has no kernel for.
    ``experts``: a module whose ``experts_grouped_mm``, ``expert_order``, ``experts_gather_mm``,
    ``experts_scatter_mm``, ``experts_swiglu_scatter_mm`` and ``moe_combine`` become extra ops (the decode step's
    routed experts, the order of their rows, the GEMMs through that order, the second with the activation in its
    operand load, and the pairs' sum, ``kernels.reference.slots``; without it that step runs
    ``torch._grouped_mm`` and torch's counting); ``sampling``: a module whose
    ``draw_tokens`` and ``draw_record`` become extra ops (the rollout engine's sampler at top-p 1, and in a decode
    step that draw with the engine's records of it, ``rollout.reference_engine``);
    ``routing``: a module whose ``route_experts`` becomes an extra op (the eager decode step's router);
    ``compress``: a module whose ``compressor_step`` becomes an extra op (the eager decode step's compressors after
    their GEMMs, ``kernels.reference.slots._compress_masked``); ``norm_rope``: a module whose ``norm_rope`` becomes
    an extra op (the eager decode step's query and key norms and rotations, ``kernels.reference.decode._attend``);
    ``topk``: a module whose ``decode_topk`` and ``attention_rows`` become extra ops (the eager decode step's
    indexer picks, and a window or HCA layer's attention rows);
    ``index_query``: a module whose ``index_query`` becomes an extra op (its indexer query's rotation and
    transform); ``linear_group``: a module whose ``linear_group``, ``grouped_projection`` and ``linear_post`` become extra
    ops (the projections of a layer's attention input in one launch, ``kernels.reference.decode.layer_projections``,
    the attention's grouped ``wo_a``, and its ``wo_b`` with the site's mHC post in the epilogue); ``mhc_decode``: a module
    whose ``hc_pre_norm``, ``hc_head_norm`` and ``moe_combine_post`` become extra ops (a site's mHC pre and its
    sublayer's norm, the head's collapse and the final norm, one launch each at a few tokens; the MoE's pairs summed
    inside its mHC post, ``kernels.reference.slots``); ``decode_attention``: a
    module whose ``attention_inverse_rope`` becomes an extra op (the eager decode step's attention with its output's
    inverse rotation in one launch, ``kernels.reference.decode._attend``)."""
    from kernels.reference.backend import NAME as REFERENCE, reference_functions

    own = dict(
        sparse_attention_with_sink=attention.sparse_attention_with_sink,
        indexer_scores=indexer.indexer_scores,
        sparse_attention_with_sink_thd=attention.sparse_attention_with_sink_thd,
        indexer_scores_thd=indexer.indexer_scores_thd,
        indexer_topk=indexer.indexer_topk,
    )
    for module, names in ((mhc, MHC_OPS), (rope, ("apply_rope",)),
                          (norm, ("rms_normalize", "rms_norm")),
                          (swiglu, ("weighted_swiglu",)), (logprobs, ("head_logprobs",)),
                          (experts, ("experts_grouped_mm", "expert_order", "experts_gather_mm", "experts_scatter_mm",
                                     "experts_swiglu_scatter_mm", "moe_combine")), (hadamard, ("hadamard_transform",)),
                          (sampling, ("draw_tokens", "draw_record")), (routing, ("route_experts",)),
                          (compress, ("compressor_step",)), (norm_rope, ("norm_rope",)),
                          (topk, ("decode_topk", "attention_rows")),
                          (index_query, ("index_query",)), (linear_group, ("linear_group", "grouped_projection", "linear_post")),
                          (mhc_decode, ("hc_pre_norm", "hc_head_norm", "moe_combine_post")),
                          (decode_attention, ("attention_inverse_rope",))):
        if module is not None:
            own.update({name: getattr(module, name) for name in names})
    delegated = {name: (REFERENCE, fn) for name, fn in reference_functions().items() if name not in own}
    # the indexer kernels take bf16/fp16 q and k (fp32 accumulation): callers pass the activation dtype
    return OpTable(backend, own, delegated=delegated, dtypes=GPU_DTYPES, indexer_inputs="activation")
