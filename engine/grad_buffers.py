"""megatron-core's ``DistributedDataParallel`` with the first gradient of a step copied into the fp32 buffer.

Why: megatron-core zeroes every fp32 gradient buffer at the start of a step and then *adds* each parameter's
bf16 gradient into it (a fill over the whole buffer, then a read-modify-write in mixed dtypes). On the
Flash-shaped model on one H200 that was 4.9 ms of zeroing and 18.3 ms of adding per step, 9% of the step
(bench/results/train-cli-h200-flash-shaped-seq4096-triton-adam.json). Here the first gradient a parameter receives
in a step is copied (read bf16, write fp32), later ones (more micro-batches, recomputed segments) are added, and
nothing is zeroed up front.

What stays true: a parameter that no backward reached since :meth:`CopyFirstDDP.zero_grad_buffer` holds the
previous step's gradient in the buffer, so :meth:`CopyFirstDDP.settle_grad_buffer` zeroes exactly those before
anything reads or reduces the buffer (``train.optim.MegatronOptimizer.step`` calls it first). Which buffers still
hold the last step's gradient is marked on each ``main_grad`` tensor (``kernels.wgrad.mark_last_step`` /
``claim``), so that a weight-gradient GEMM that writes the buffer itself (``wgrad_fusion``) knows to overwrite. The buffer's
padding is zeroed when the buffer is made and never written. Buckets with megatron-core's "extra main grads"
and overlapped reduction (which hooks the buffer per bucket as gradients arrive) keep megatron-core's own path.

The copy and the add (bf16 gradient into the fp32 buffer) are torch's mixed-dtype ``copy_`` / ``add_``, which
are not vectorized (14.5 ms of the Flash-shaped step). With a kernel backend that ships the Triton kernels
(``kernel_backend`` in :data:`TRITON_BACKENDS`) and tensors it takes (bf16 into fp32, contiguous, CUDA), they are
one Triton kernel each (``kernels.triton.grad_copy.cast_into``); otherwise the torch op, on purpose: the result is
bit-identical either way (bf16 -> fp32 is exact, and the add is the same fp32 addition), so this is a choice of
speed, not of semantics. ``kernel_casts`` / ``torch_casts`` count which one served.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.cuda_graphs import is_graph_capturing

from kernels.wgrad import claim, mark_last_step

__all__ = ["CopyFirstDDP", "TRITON_BACKENDS"]

# The kernel backends whose runs have Triton on CUDA (the cuda backend is the triton one plus a CUDA attention).
TRITON_BACKENDS = ("triton", "cuda")


class CopyFirstDDP(DistributedDataParallel):
    """See the module docstring. Same constructor as megatron-core's ``DistributedDataParallel``, plus the run's
    ``kernel_backend`` (its name: the Triton cast kernel serves the runs of :data:`TRITON_BACKENDS`)."""

    def __init__(self, *args, kernel_backend: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.cast_kernel = kernel_backend in TRITON_BACKENDS
        if self.cast_kernel:       # imported once here, not in the per-parameter backward hook
            from kernels.triton.grad_copy import cast_into, cast_into_refusal

            self._cast_into, self._cast_into_refusal = cast_into, cast_into_refusal
        self.kernel_casts = self.torch_casts = 0
        extra = any(bucket.params_with_extra_main_grads for buffer in self.buffers + self.expert_parallel_buffers
                    for bucket in buffer.buckets)
        self.copies_first = not (extra or self.ddp_config.overlap_grad_reduce)

    def _make_backward_post_hook(self, param):
        parent = super()._make_backward_post_hook(param)

        def hook(*unused):
            grad = param.grad
            if grad is None or getattr(param, "grad_added_to_main_grad", False):
                return parent(*unused)
            if not self.copies_first or param not in self.param_to_bucket_group:
                return parent(*unused)        # megatron-core's add (and, overlapped, its reduction)
            fresh = claim(param.main_grad)    # it still held the last step's gradient: copy over it
            if not fresh and (getattr(param, "zero_out_wgrad", False) or is_graph_capturing()):
                return parent(*unused)
            self._into_main_grad(param.main_grad, grad.data, accumulate=not fresh)
            param.grad = None

        return hook

    def _into_main_grad(self, main: torch.Tensor, grad: torch.Tensor, accumulate: bool) -> None:
        """``main.add_(grad)`` / ``main.copy_(grad)``: the Triton kernel where the run has it and it takes these
        tensors, else the torch op (bit-identical results; see the module docstring)."""
        if self.cast_kernel and not self._cast_into_refusal(main, grad):
            self._cast_into(main, grad, accumulate)
            self.kernel_casts += 1
            return
        if accumulate:
            main.add_(grad)
        else:
            main.copy_(grad)
        self.torch_casts += 1

    def zero_grad_buffer(self):
        if not self.copies_first:
            return super().zero_grad_buffer()
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()
        for param in self.param_to_bucket_group:
            mark_last_step(param.main_grad)

    def settle_grad_buffer(self) -> int:
        """Zero the buffer of every parameter no backward reached since :meth:`zero_grad_buffer`; returns how many."""
        if not self.copies_first:
            return 0
        stale = [param for param in self.param_to_bucket_group if claim(param.main_grad)]
        for param in stale:
            param.main_grad.zero_()
        return len(stale)
