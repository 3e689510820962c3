"""transformers' eager DeepseekV4 training step on one GPU: the reference that bench.train_cli compares
``dsv4 train`` with (the "per GPU vs transformers" column).

The model is ``transformers.DeepseekV4ForCausalLM`` (eager attention, transformers' default experts
implementation) built from the same core config (``tests.reference.hf_mapping.hf_config_from``), with random
bf16 weights. One step = forward, next-token cross-entropy (fp32 logits), backward, fused AdamW step (bf16
states: no fp32 master weights, unlike ``dsv4 train``), zero_grad. Warm-up steps run before the timed steps;
``torch.cuda.synchronize()`` brackets the timed region. It needs CUDA and transformers.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn.functional as F


def build_transformers(c, ids):
    """transformers' model of config ``c`` on the current GPU, its loss on the batch ``ids`` ``[B, S]``, and a
    note naming the version and the attention and experts implementations (they decide its speed)."""
    import transformers
    from transformers import DeepseekV4ForCausalLM

    from tests.reference.hf_mapping import hf_config_from

    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM._from_config(hf_config_from(c), attn_implementation="eager", dtype=torch.bfloat16)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.config.use_cache = False
    m.train()
    note = (f"transformers {transformers.__version__}, attn eager, experts "
            f"{getattr(m.config, '_experts_implementation', None)}")

    def loss_fn():
        logits = m(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    return m, loss_fn, note


def time_step(c, seq: int, warmup: int, timed: int) -> dict:
    """Times ``timed`` steps on one sequence of ``seq`` random tokens after ``warmup`` steps: ``step_ms``,
    ``peak_mem_gb`` (the CUDA allocator's peak), ``timed_steps``, ``loss_first`` (after the warm-up),
    ``loss_last``, ``note``.

    The process is first set up as ``dsv4 train`` sets up a one-GPU run on the nvidia target (TF32 off, the
    device, a one-rank group), so both steps run under the same matmul settings."""
    from bench.configs import bench_run_config
    from core.assembly import assemble

    assemble(bench_run_config("miles", c)).setup_process()
    ids = torch.randint(0, c.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).cuda()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, loss_fn, note = build_transformers(c, ids)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    first_loss = float(loss.detach()) if warmup else None
    t0 = time.perf_counter()
    for _ in range(timed):
        loss = step()
    torch.cuda.synchronize()
    out = dict(step_ms=(time.perf_counter() - t0) / timed * 1e3, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30,
               timed_steps=timed, loss_first=first_loss, loss_last=float(loss.detach()), note=note)
    del model, opt, params, loss_fn
    gc.collect()
    torch.cuda.empty_cache()
    return out
