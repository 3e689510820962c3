"""Regional ``torch.compile`` of a model's transformer blocks (the training option ``--compile``).

Why: one DeepSeek-V4 block issues hundreds of small element-wise kernels (mHC mixing and Sinkhorn, RMS
norms, RoPE, the compressors' pooling, SwiGLU, casts), so an eager step on a GPU is bound by kernel
launches, not by math. Compiling each block with TorchInductor fuses those into a few Triton kernels for
the forward and the backward (AOTAutograd) while the model code stays the readable reference math.

What is compiled: every block (``decoder.layers.N``, ``mtp.layers.K``), each in place (``Module.compile``),
so parameter names, ``state_dict`` keys and checkpoints are unchanged. The kernel backend's own
kernels (sparse attention, indexer scores, the triton backend's fused mHC ops) are ``torch.library``
custom ops (``kernels.gpu_ops``): each is one node of the block's graph, so a block compiles to one
forward and one backward graph with no graph break, and Inductor fuses the element-wise code around the
kernels (which it calls as they are, it does not generate them). An op-table entry without that mark
(:func:`opaque_kernel_ops`) runs eagerly, a graph break. Not compiled: the embedding, the head and the loss.

Shapes: a block is compiled for the first shape it sees; a new shape recompiles it once with dynamic
sizes (``dynamic=None``). Python-level layout objects of the packed (THD) path are guarded on, so packed
batches of changing layout recompile: the option pays off for fixed-shape steps (BSHD of one length,
the throughput benchmark) and is off by default.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["compile_blocks", "block_modules", "opaque_kernel_ops", "kernel_op_names"]


def _traceable(fn) -> bool:
    """A reference op, or an entry point marked ``traceable`` (``kernels.gpu_ops.traceable``)."""
    module = getattr(fn, "__module__", "") or ""
    return module.startswith("kernels.reference") or bool(getattr(fn, "traceable", False))


def kernel_op_names(ops) -> list[str]:
    """The ops of a table (:class:`core.kernel_ops.OpTable`) that ``torch.compile`` does not trace: the ones
    :func:`opaque_kernel_ops` leaves eager (a graph break each)."""
    return [name for name in ops.names() if not _traceable(getattr(ops, name))]


def opaque_kernel_ops(ops):
    """A copy of a kernel backend's op table (:class:`core.kernel_ops.OpTable`) in which every op that
    ``torch.compile`` cannot trace runs eagerly when called from compiled code (``torch.compiler.disable``, a
    graph break). Traceable, and kept as they are: the reference ops (``kernels.reference``) and the
    entry points marked ``traceable`` (``kernels.gpu_ops.traceable``: torch code around registered custom
    ops; every op of the triton and tilelang backends). An unmarked op, e.g. a third-party backend's raw
    launcher, is not traced into, where its Python would fail or be specialised wrongly."""

    def opaque(name, fn):
        return fn if _traceable(fn) else torch.compiler.disable(fn, recursive=True)

    return ops.map(opaque)


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: ``decoder.layers`` and, if present, ``mtp.layers`` (a pipeline stage's own
    only: another stage's are placeholders, ``engine.pipeline.OtherStage``)."""
    from .pipeline import OtherStage

    blocks = [b for b in model.decoder.layers if not isinstance(b, OtherStage)]
    mtp = getattr(model, "mtp", None)
    if mtp is not None and not isinstance(mtp, OtherStage):
        blocks += list(mtp.layers)
    return blocks


def compile_blocks(model: nn.Module, cuda_graphs: bool = False, backend: str = "inductor",
                   fullgraph: bool = False) -> nn.Module:
    """Compile ``model``'s blocks in place (see the module docstring) and return the model.

    ``cuda_graphs``: Inductor's ``reduce-overhead`` mode, which also records every compiled forward and
    backward graph as a CUDA graph and replays it (launch overhead of the fused kernels gone; graphs it
    cannot record run as plain compiled code). Call ``torch.compiler.cudagraph_mark_step_begin()`` at the
    start of each training step. A model that cannot be replayed as CUDA graphs says why in its
    ``cuda_graphs_refusal()``; then ``cuda_graphs=True`` raises with that reason instead of running slowly.
    ``backend``: the ``torch.compile`` backend; tests pass ``"eager"`` to check tracing (graph breaks,
    recompiles) without paying for code generation. ``fullgraph``: a graph break raises (with its reason)
    instead of splitting the block; tests use it to show that a backend's ops trace."""
    refusal = getattr(model, "cuda_graphs_refusal", lambda: None)() if cuda_graphs else None
    if refusal:
        raise ValueError(f"compile_blocks(cuda_graphs=True): {refusal}")
    ops = getattr(model, "ops", None)
    if ops is not None:
        opaque = opaque_kernel_ops(ops)
        for m in model.modules():
            if getattr(m, "ops", None) is ops:
                m.ops = opaque
    blocks = block_modules(model)
    # blocks share their code: a block's layer-specific constants (compress ratio, routing kind, layer id)
    # make one compiled variant per layer, and past dynamo's default limit of 8 the rest would run eagerly
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 2 * len(blocks) + 8)
    mode = {"mode": "reduce-overhead"} if cuda_graphs else {}
    for block in blocks:
        block.compile(dynamic=None, backend=backend, fullgraph=fullgraph, **mode)
    return model
