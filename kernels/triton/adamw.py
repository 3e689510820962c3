"""One Triton kernel for the whole AdamW step of megatron-core's distributed optimizer: every fp32 master shard,
its gradient and both moments in one pass, writing the bf16 model weight beside the fp32 master and flagging any
non-finite weight it wrote.

Why: with torch's fused AdamW (``engine.fused_optim``) the step's optimizer still made three passes over the
parameters after the backward (measured on one H200, flash-shaped ``dsv4 train``, 2026-12-02, 290 ms step):
the AdamW kernel (57.5 ms, about 60% of the HBM bandwidth), megatron-core's copy of every master into the bf16
model weights (8.7 ms) and the trainer's check that no weight went non-finite (a max-abs pass over the bf16
weights, 4.9 ms). Here one kernel reads each element's master, gradient and moments once and writes master,
moments and the bf16 weight (30 bytes an element in place of 28 + 6 + 2), and the finite check of the weights
is one flag it raises as it writes them.

The math is torch's AdamW (``torch.optim.AdamW``, non-amsgrad): ``p *= 1 - lr * wd``; ``m = b1 m + (1 - b1) g``;
``v = b2 v + (1 - b2) g^2``; ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``, with the gradient
divided by ``grad_scale`` where clipping set one (``engine.fused_optim.clipped``), in fp32 (``b^t`` by
libdevice's ``pow``, as torch's fused kernel does).

Layout: the tensors are many (one per parameter shard, hundreds) and of any size, so the launch is a table of
chunks: program ``c`` updates elements ``[start_c, start_c + CHUNK)`` of tensor ``t_c``, whose addresses it reads
from per-tensor pointer tables (int64 addresses cast to typed pointers). The tables are built once per set of
tensors and reused while the addresses stay (megatron-core's shards and the optimizer state live for the run).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CHUNK = 65536          # elements per program
BLOCK = 2048           # elements per inner iteration
MAX_PLANS = 64         # device tables kept (one per parameter group of an optimizer)


@triton.jit
def _adamw_chunks(chunk_tensor, chunk_start, p_ptrs, g_ptrs, m_ptrs, v_ptrs, out_ptrs, step_ptrs, numels, wds,
                  grad_scale_ptr, flag_ptr, lr, beta1, beta2, eps,
                  HAS_SCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    start = tl.load(chunk_start + c)
    n = tl.load(numels + t)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
    out_addr = tl.load(out_ptrs + t)
    out_ptr = out_addr.to(tl.pointer_type(tl.bfloat16))
    step = tl.load(tl.load(step_ptrs + t).to(tl.pointer_type(tl.float32)))
    wd = tl.load(wds + t)
    bc1 = 1.0 - libdevice.pow(beta1, step)          # (exp2/log2 are approximate: 1 - beta2^t lost 1e-4)
    bc2_sqrt = tl.sqrt(1.0 - libdevice.pow(beta2, step))
    step_size = lr / bc1
    decay = 1.0 - lr * wd
    if HAS_SCALE:
        inv_scale = 1.0 / tl.load(grad_scale_ptr)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        if HAS_SCALE:
            g = g * inv_scale
        p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + idx, p, mask=mask)
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)
        written = p
        if out_addr != 0:
            q = p.to(tl.bfloat16)
            tl.store(out_ptr + idx, q, mask=mask)
            written = q.to(tl.float32)
        bad = tl.maximum(bad, ((written - written) != 0.0).to(tl.int32) * mask.to(tl.int32))
    if tl.max(bad, axis=0) > 0:
        tl.atomic_max(flag_ptr, 1)


class _Plan:
    """The device tables of one set of tensors (addresses, sizes, weight decays, chunks)."""

    def __init__(self, tensors: Sequence[Tuple[torch.Tensor, ...]], wds: Sequence[float], device):
        cols = list(zip(*[[(x.data_ptr() if x is not None else 0) for x in row] for row in tensors]))
        self.tables = [torch.tensor(col, dtype=torch.int64, device=device) for col in cols]
        numels = [row[0].numel() for row in tensors]
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.wds = torch.tensor(list(wds), dtype=torch.float32, device=device)
        chunks = [(i, s) for i, n in enumerate(numels) for s in range(0, n, CHUNK)]
        self.chunk_tensor = torch.tensor([i for i, _ in chunks], dtype=torch.int32, device=device)
        self.chunk_start = torch.tensor([s for _, s in chunks], dtype=torch.int64, device=device)


def _key(rows) -> tuple:
    return tuple((x.data_ptr() if x is not None else 0) for row in rows for x in row)


class MultiTensorAdamW:
    """AdamW over lists of fp32 tensors in one launch per hyper-parameter group; keeps the device tables of the
    last tensor sets it saw (see the module docstring)."""

    def __init__(self):
        self._plans: Dict[tuple, _Plan] = {}

    @staticmethod
    def check(params: Sequence[torch.Tensor], outs: Sequence[Optional[torch.Tensor]]) -> Optional[str]:
        """Why these tensors cannot be stepped by the kernel, or None."""
        for i, p in enumerate(params):
            if p.device.type != "cuda" or p.dtype != torch.float32 or not p.is_contiguous():
                return f"tensor {i}: {p.dtype} on {p.device.type}, contiguous={p.is_contiguous()} (needs fp32 CUDA)"
            o = outs[i]
            if o is not None and (o.dtype != torch.bfloat16 or o.numel() != p.numel() or not o.is_contiguous()):
                return f"model weight {i}: {o.dtype} x {o.numel()} for a master of {p.numel()} (needs bf16, same size)"
        return None

    def step(self, params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
             exp_avg_sqs: List[torch.Tensor], steps: List[torch.Tensor], outs: List[Optional[torch.Tensor]],
             wds: List[float], *, lr: float, beta1: float, beta2: float, eps: float,
             grad_scale: Optional[torch.Tensor], flag: torch.Tensor) -> None:
        """One AdamW step of every tensor (``steps`` already incremented); ``flag`` (int32 [1], on the device) is
        raised to 1 when a weight written is NaN/inf."""
        if not params:
            return
        rows = list(zip(params, grads, exp_avgs, exp_avg_sqs, outs, steps))
        key = _key(rows) + tuple(wds)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:          # the tensors moved (a rebuilt optimizer): start over
                self._plans.clear()
            plan = self._plans[key] = _Plan(rows, wds, params[0].device)   # one per parameter group
        if any(g.dtype != torch.float32 or not g.is_contiguous() for g in grads):
            raise ValueError("MultiTensorAdamW: gradients must be contiguous fp32 tensors")
        p_t, g_t, m_t, v_t, o_t, s_t = plan.tables
        scale = grad_scale if grad_scale is not None else flag
        grid = (plan.chunk_tensor.numel(),)
        with torch.profiler.record_function("dsv4_triton::adamw"):      # a named op for the step's profile
            _adamw_chunks[grid](plan.chunk_tensor, plan.chunk_start, p_t, g_t, m_t, v_t, o_t, s_t, plan.numels,
                                plan.wds, scale, flag, float(lr), float(beta1), float(beta2), float(eps),
                                HAS_SCALE=grad_scale is not None, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
