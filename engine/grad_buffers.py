"""megatron-core's ``DistributedDataParallel`` with the first gradient of a step copied into the fp32 buffer.

Why: megatron-core zeroes every fp32 gradient buffer at the start of a step and then *adds* each parameter's
bf16 gradient into it (a fill over the whole buffer, then a read-modify-write in mixed dtypes). On the
Flash-shaped model on one H200 that was 4.9 ms of zeroing and 18.3 ms of adding per step, 9% of the step
(docs/kernels-and-benchmarks.md). Here the first gradient a parameter receives in a step is copied (read bf16,
write fp32), later ones (more micro-batches, recomputed segments) are added, and nothing is zeroed up front.

What stays true: a parameter that no backward reached since :meth:`CopyFirstDDP.zero_grad_buffer` holds the
previous step's gradient in the buffer, so :meth:`CopyFirstDDP.settle_grad_buffer` zeroes exactly those before
anything reads or reduces the buffer (``train.optim.MegatronOptimizer.step`` calls it first). The buffer's
padding is zeroed when the buffer is made and never written. Buckets with megatron-core's "extra main grads"
and overlapped reduction (which hooks the buffer per bucket as gradients arrive) keep megatron-core's own path.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel

__all__ = ["CopyFirstDDP"]


class CopyFirstDDP(DistributedDataParallel):
    """See the module docstring. Same constructor as megatron-core's ``DistributedDataParallel``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        extra = any(bucket.params_with_extra_main_grads for buffer in self.buffers + self.expert_parallel_buffers
                    for bucket in buffer.buckets)
        self.copies_first = not (extra or self.ddp_config.overlap_grad_reduce)
        self._fresh: set = set()             # parameters whose buffer still holds the last step's gradient

    def _make_backward_post_hook(self, param):
        parent = super()._make_backward_post_hook(param)

        def hook(*unused):
            if param in self._fresh and param.grad is not None \
                    and not getattr(param, "grad_added_to_main_grad", False):
                self._fresh.discard(param)
                param.main_grad.copy_(param.grad.data)
                param.grad = None
                return
            parent(*unused)                   # adds into the buffer (and, overlapped, reduces)

        return hook

    def zero_grad_buffer(self):
        if not self.copies_first:
            return super().zero_grad_buffer()
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()
        self._fresh = set(self.param_to_bucket_group)

    def settle_grad_buffer(self) -> int:
        """Zero the buffer of every parameter no backward reached since :meth:`zero_grad_buffer`; returns how many."""
        stale = self._fresh
        for param in stale:
            param.main_grad.zero_()
        self._fresh = set()
        return len(stale)
