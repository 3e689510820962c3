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

Moments: fp32, or bf16 (``adam_moments_dtype=bf16``: 22 bytes an element in place of 30, and 4 fewer bytes of
state per parameter; DeepSeek-V3 trained with bf16 moments). They are read into fp32, updated in fp32 and
rounded to their own dtype (round to nearest) as they are written; the master and the update stay fp32.

The math is torch's AdamW (``torch.optim.AdamW``, non-amsgrad): ``p *= 1 - lr * wd``; ``m = b1 m + (1 - b1) g``;
``v = b2 v + (1 - b2) g^2``; ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``, with the gradient
divided by ``grad_scale`` where clipping set one (``engine.fused_optim.clipped``), in fp32 (``b^t`` by
libdevice's ``pow``, as torch's fused kernel does).

Layout: the tensors are many (one per parameter shard, hundreds) and of any size, so the launch is a table of
chunks: program ``c`` updates elements ``[start_c, start_c + CHUNK)`` of tensor ``t_c``, found as an element
offset from its stream's base tensor (:class:`_Plan`). The tables are built once per set of tensors and reused
while the addresses stay (megatron-core's shards and the optimizer state live for the run).
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
NUM_WARPS = 8


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, idx, n, bad, has_out, decay, step_size, bc2_sqrt, inv_scale,
                 beta1, beta2, eps, HAS_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """One ``BLOCK`` of elements; ``MASKED`` only for a tensor's last chunk, so that every other chunk's loads
    and stores are unmasked (a mask against a loaded size would keep them from being vectorized)."""
    if MASKED:
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + idx)
        p = tl.load(p_ptr + idx)
        m = tl.load(m_ptr + idx).to(tl.float32)
        v = tl.load(v_ptr + idx).to(tl.float32)
    if HAS_SCALE:
        g = g * inv_scale
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    written = p
    if MASKED:
        tl.store(p_ptr + idx, p, mask=mask)
        tl.store(m_ptr + idx, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + idx, v.to(v_ptr.dtype.element_ty), mask=mask)
        if has_out != 0:
            q = p.to(tl.bfloat16)
            tl.store(out_ptr + idx, q, mask=mask)
            written = q.to(tl.float32)
        bad = tl.maximum(bad, ((written - written) != 0.0).to(tl.int32) * mask.to(tl.int32))
    else:
        tl.store(p_ptr + idx, p)
        tl.store(m_ptr + idx, m.to(m_ptr.dtype.element_ty))
        tl.store(v_ptr + idx, v.to(v_ptr.dtype.element_ty))
        if has_out != 0:
            q = p.to(tl.bfloat16)
            tl.store(out_ptr + idx, q)
            written = q.to(tl.float32)
        bad = tl.maximum(bad, ((written - written) != 0.0).to(tl.int32))
    return bad


@triton.jit
def _adamw_chunks(chunk_tensor, chunk_start, P, G, M, V, OUT, p_off, g_off, m_off, v_off, o_off, has_outs,
                  step_ptrs, numels, wds, grad_scale_ptr, flag_ptr, lr, beta1, beta2, eps,
                  HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr, MOMENT_VEC: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    start = tl.load(chunk_start + c)
    n = tl.load(numels + t)
    po = tl.load(p_off + t)
    go = tl.load(g_off + t)
    mo = tl.load(m_off + t)
    vo = tl.load(v_off + t)
    oo = tl.load(o_off + t)
    if ALIGNED:     # every tensor starts 16 bytes into its stream's base: 4 fp32 / 8 bf16 elements per access
        po = tl.multiple_of(po, 4)
        go = tl.multiple_of(go, 4)
        mo = tl.multiple_of(mo, MOMENT_VEC)
        vo = tl.multiple_of(vo, MOMENT_VEC)
        oo = tl.multiple_of(oo, 8)
        start = tl.multiple_of(start, CHUNK)
    has_out = tl.load(has_outs + t)
    step = tl.load(tl.load(step_ptrs + t).to(tl.pointer_type(tl.float32)))
    wd = tl.load(wds + t)
    bc1 = 1.0 - libdevice.pow(beta1, step)          # (exp2/log2 are approximate: 1 - beta2^t lost 1e-4)
    bc2_sqrt = tl.sqrt(1.0 - libdevice.pow(beta2, step))
    step_size = lr / bc1
    decay = 1.0 - lr * wd
    inv_scale = 1.0
    if HAS_SCALE:
        inv_scale = 1.0 / tl.load(grad_scale_ptr)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr = P + po, G + go, M + mo, V + vo, OUT + oo
    if start + CHUNK <= n:
        for off in range(0, CHUNK, BLOCK):
            bad = _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, start + off + tl.arange(0, BLOCK), n, bad,
                               has_out, decay, step_size, bc2_sqrt, inv_scale, beta1, beta2, eps,
                               HAS_SCALE=HAS_SCALE, MASKED=False)
    else:
        for off in range(0, CHUNK, BLOCK):
            bad = _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, start + off + tl.arange(0, BLOCK), n, bad,
                               has_out, decay, step_size, bc2_sqrt, inv_scale, beta1, beta2, eps,
                               HAS_SCALE=HAS_SCALE, MASKED=True)
    if tl.max(bad, axis=0) > 0:
        tl.atomic_max(flag_ptr, 1)


class _Plan:
    """The device tables of one set of tensors: per stream (master, gradient, two moments, bf16 weight) a base
    tensor (a kernel argument) and each tensor's element offset from it, plus sizes, weight decays and chunks.

    Offsets from a base argument, not raw addresses: the kernel then knows its pointers' alignment (``ALIGNED``:
    every tensor 16-byte aligned, as the caching allocator's and megatron-core's buffers are), and loads and
    stores 16 bytes per access instead of one element."""

    def __init__(self, rows: Sequence[Tuple[torch.Tensor, ...]], wds: Sequence[float], device):
        self.bases, self.offsets, aligned = [], [], True
        for col in range(5):                        # p, g, m, v, out (the last may be None per row)
            tensors = [row[col] for row in rows]
            base = next((x for x in tensors if x is not None), None)
            if base is None:                        # no bf16 weights at all: any tensor serves as the base
                base = rows[0][0]
            b = base.data_ptr()
            size = base.element_size()
            offs = []
            for x in tensors:
                d = 0 if x is None else x.data_ptr() - b
                aligned &= d % 16 == 0 and b % 16 == 0
                offs.append(d // size)
            self.bases.append(base)
            self.offsets.append(torch.tensor(offs, dtype=torch.int64, device=device))
        self.aligned = aligned
        self.has_out = torch.tensor([int(row[4] is not None) for row in rows], dtype=torch.int32, device=device)
        self.steps = torch.tensor([row[5].data_ptr() for row in rows], dtype=torch.int64, device=device)
        numels = [row[0].numel() for row in rows]
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
        moments = {t.dtype for t in (*exp_avgs, *exp_avg_sqs)}
        if len(moments) != 1 or not moments <= {torch.float32, torch.bfloat16}:
            raise ValueError(f"MultiTensorAdamW: the moments must be all fp32 or all bf16, not "
                             f"{sorted(map(str, moments))}")
        scale = grad_scale if grad_scale is not None else flag
        grid = (plan.chunk_tensor.numel(),)
        with torch.profiler.record_function("dsv4_triton::adamw"):      # a named op for the step's profile
            _adamw_chunks[grid](plan.chunk_tensor, plan.chunk_start, *plan.bases, *plan.offsets, plan.has_out,
                                plan.steps, plan.numels, plan.wds, scale, flag, float(lr), float(beta1),
                                float(beta2), float(eps), HAS_SCALE=grad_scale is not None, ALIGNED=plan.aligned,
                                MOMENT_VEC=16 // exp_avgs[0].element_size(), CHUNK=CHUNK, BLOCK=BLOCK,
                                num_warps=NUM_WARPS)
