"""Regional ``torch.compile`` of a model's transformer blocks (the training option ``--compile``).

Why: one DeepSeek-V4 block issues hundreds of small element-wise kernels (mHC mixing and Sinkhorn, RMS
norms, RoPE, the compressors' pooling, SwiGLU, casts), so an eager step on a GPU is bound by kernel
launches, not by math. Compiling each block with TorchInductor fuses those into a few Triton kernels for
the forward and the backward (AOTAutograd) while the model code stays the readable reference math.

What is compiled: every block (``decoder.layers.N``, ``mtp.layers.K``), each in place (``Module.compile``),
so parameter names, ``state_dict`` keys and checkpoints are unchanged. What is not: the kernel backend's
own kernels (sparse attention, indexer scores / top-k of ``triton`` / ``tilelang``) are called eagerly
from the compiled code (``torch.compiler.disable``), the embedding, the head and the loss.

Shapes: a block is compiled for the first shape it sees; a new shape recompiles it once with dynamic
sizes (``dynamic=None``). Python-level layout objects of the packed (THD) path are guarded on, so packed
batches of changing layout recompile: the option pays off for fixed-shape steps (BSHD of one length,
the throughput benchmark) and is off by default.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["compile_blocks", "block_modules", "opaque_kernel_ops"]


def opaque_kernel_ops(ops):
    """A copy of a kernel backend's op table (:class:`core.kernel_ops.OpTable`) whose own kernels (every op
    not taken from ``kernels.reference``) run eagerly when called from compiled code; reference ops stay
    traceable."""

    def opaque(name, fn):
        module = getattr(fn, "__module__", "") or ""
        return fn if module.startswith("kernels.reference") else torch.compiler.disable(fn, recursive=True)

    return ops.map(opaque)


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: ``decoder.layers`` and, if present, ``mtp.layers``."""
    blocks = list(model.decoder.layers)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks += list(mtp.layers)
    return blocks


def compile_blocks(model: nn.Module, cuda_graphs: bool = False, backend: str = "inductor") -> nn.Module:
    """Compile ``model``'s blocks in place (see the module docstring) and return the model.

    ``cuda_graphs``: Inductor's ``reduce-overhead`` mode, which also records every compiled forward and
    backward graph as a CUDA graph and replays it (launch overhead of the fused kernels gone; graphs it
    cannot record run as plain compiled code). Call ``torch.compiler.cudagraph_mark_step_begin()`` at the
    start of each training step. A model that cannot be replayed as CUDA graphs says why in its
    ``cuda_graphs_refusal()``; then ``cuda_graphs=True`` raises with that reason instead of running slowly.
    ``backend``: the ``torch.compile`` backend; tests pass ``"eager"`` to check tracing (graph breaks,
    recompiles) without paying for code generation."""
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
        block.compile(dynamic=None, backend=backend, **mode)
    return model
