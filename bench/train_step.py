"""Training-throughput benchmark (issue #7): tokens/s and MFU of one training step on one GPU.

``python -m bench.train_step --out bench/results/train-h200.json``

Implementations, all on the same small DeepSeek-V4 config and the same token batch, in one process:

* ``miles``     -- ``backends.miles.impl.build_model`` (BSHD, ``model(ids[B, S]) -> logits``), triton kernels;
* ``megatron``  -- ``backends.megatron.impl.build_model`` (THD, ``model(ids[T], cu_seqlens) -> logits``), triton;
* ``transformers`` -- ``transformers.DeepseekV4ForCausalLM`` (eager attention, transformers' default experts
  implementation), config from ``tests.reference.hf_mapping.hf_config_from``.

One step = forward, next-token cross-entropy (fp32 logits), backward, AdamW step, zero_grad. Weights are
randomly initialized in bf16. megatron's indexer KL loss is off (``dsa_indexer_loss_coeff=None``, its
default), so like the others it trains on the language-model loss alone; ``--indexer-loss-coeff C`` turns it
on (the step's loss is then LM + C x summed indexer KL, and the indexer trains); CUDA graphs refuse such a
model (``engine.compile``), so pair it with ``--cuda-graph off``. Warm-up steps (triton and
torch.compile compilation, CUDA-graph recording, allocator) run before the timed steps;
``torch.cuda.synchronize()`` brackets the timed region.

Modes of miles / megatron (``--compile on|off|both``, ``--cuda-graph on|off``): eager; compiled
(``engine.compile.compile_blocks``: every block through ``torch.compile``, the kernel backend's kernels
left eager); compiled + CUDA graphs (Inductor's reduce-overhead mode, the default). transformers runs eager.

MFU = FLOPs per step / step time / 989e12, where 989 TFLOP/s is the H200's dense bf16 peak (the SXM data
sheet number, without sparsity). FLOPs per step = 6 x active params x tokens + attention FLOPs:

* active params: every parameter except the input embedding table, routed experts counted at
  ``n_activated / n_routed`` of their size (the LM head, mHC, compressors and indexer are counted);
* attention: ``12 x heads x head_dim x sum over layers and query tokens of the selected keys``
  (QK^T and PV, 2 FLOPs per MAC, forward + 2x backward). Selected keys for the query at position p:
  window layers ``min(p+1, window)``; CSA (ratio 4) layers ``min(p+1, window) + min(top-k, (p+1)//4)``;
  HCA (ratio 128) layers ``min(p+1, window) + (p+1)//128``. The indexer's own scoring is not counted.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback
from typing import Optional

import torch
import torch.nn.functional as F

H200_BF16_DENSE_TFLOPS = 989.0


def bench_config():
    from core.config import preset

    return preset("tiny").replace(
        vocab_size=32768, dim=1024, n_layers=6, n_mtp_layers=0, compress_ratios=(0, 0, 4, 128, 4, 128),
        n_heads=16, head_dim=512, rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512,
        window_size=128, index_n_heads=16, index_head_dim=128, index_topk=512,
        n_routed_experts=16, n_activated_experts=2, moe_inter_dim=512, n_shared_experts=1,
        hc_mult=4, n_hash_layers=2,
    )


def config_summary(c, seq, batch) -> dict:
    return dict(vocab=c.vocab_size, hidden=c.dim, layers=c.n_layers, compress_ratios=list(c.compress_ratios),
                heads=c.n_heads, head_dim=c.head_dim, rope_head_dim=c.rope_head_dim, q_lora=c.q_lora_rank,
                o_groups=c.o_groups, o_lora=c.o_lora_rank, window=c.window_size,
                indexer=f"{c.index_n_heads}x{c.index_head_dim} top-{c.index_topk}",
                experts=f"{c.n_routed_experts} routed top-{c.n_activated_experts} x {c.moe_inter_dim} "
                        f"+ {c.n_shared_experts} shared",
                hc_mult=c.hc_mult, hash_layers=c.n_hash_layers, mtp_layers=c.n_mtp_layers,
                seq=seq, batch=batch, dtype="bf16", optimizer="AdamW")


def selected_keys(c, seq: int) -> int:
    """Sum over trunk layers and query positions of the keys the sparse attention reads."""
    total = 0
    for r in c.compress_ratios[: c.n_layers]:
        for p in range(seq):
            k = min(p + 1, c.window_size)
            if r == 4:
                k += min(c.index_topk, (p + 1) // 4)
            elif r > 0:
                k += (p + 1) // r
            total += k
    return total


def active_params(c) -> int:
    """Analytic active parameter count (the embedding table excluded, routed experts at top-k / E)."""
    d, n = c.dim, c.hc_mult
    rd = c.rope_head_dim
    total = c.vocab_size * d + d + (n * d) * n + n + 1  # head, final norm, mHC head
    for i in range(c.n_layers):
        r = c.compress_ratios[i]
        attn = d + d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.n_heads * c.head_dim
        attn += d * c.head_dim + c.head_dim + c.n_heads  # wkv, kv_norm, sinks
        attn += (c.n_heads * c.head_dim // c.o_groups) * c.o_groups * c.o_lora_rank
        attn += c.o_groups * c.o_lora_rank * d
        if r:
            coff = 2 if r == 4 else 1
            attn += 2 * d * coff * c.head_dim + c.head_dim + r * coff * c.head_dim
            if r == 4:
                ih = c.index_head_dim
                attn += 2 * d * coff * ih + ih + r * coff * ih
                attn += c.q_lora_rank * c.index_n_heads * ih + d * c.index_n_heads
        hc = 2 * ((n * d) * (2 * n + n * n) + (2 * n + n * n) + 3)
        e = 3 * d * c.moe_inter_dim
        ffn = d + c.n_shared_experts * e + e * c.n_activated_experts
        ffn += c.n_routed_experts * d  # the router's weight: hash layers too (their expert weights are its scores)
        total += attn + hc + ffn
    del rd
    return total


def step_flops(c, seq: int, batch: int, n_active: int) -> dict:
    tokens = seq * batch
    dense = 6 * n_active * tokens
    attn = 12 * c.n_heads * c.head_dim * selected_keys(c, seq) * batch
    return dict(total=dense + attn, dense=dense, attention=attn)


# ------------------------------------------------------------------ models


def bench_run_config(impl, c, *, hardware: str = "nvidia", kernels: Optional[str] = None, **choices):
    """The normalized run configuration of a benchmark run: ``kernels`` (default triton on nvidia, the reference
    kernels on the CPU); ``choices``: further ``Choices`` fields (parallel sizes, qkv format)."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    kernels = kernels or ("triton" if hardware == "nvidia" else "none")
    return normalize(Choices(impl=impl, kernel_backend=kernels, hardware=hardware, model=c, **choices),
                     make_host(third_party=False), model_name="bench")


def make_miles(c, ids):
    from core.assembly import assemble

    torch.manual_seed(0)
    m = assemble(bench_run_config("miles", c)).build_model(c, params_dtype=torch.bfloat16).cuda()

    def loss_fn():
        logits = m(ids)  # [B, S, V]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    return m, loss_fn


def make_megatron(c, ids, indexer_loss_coeff=None):
    from core.assembly import assemble

    torch.manual_seed(0)
    m = assemble(bench_run_config("megatron", c)).build_model(c, params_dtype=torch.bfloat16,
                                                              dsa_indexer_loss_coeff=indexer_loss_coeff).cuda()
    flat = ids.reshape(-1)
    B, S = ids.shape
    cu = torch.arange(0, B + 1, device=ids.device, dtype=torch.int32) * S
    keep = torch.ones(B, S, dtype=torch.bool, device=ids.device)
    keep[:, -1] = False
    rows = keep.reshape(-1).nonzero().squeeze(1)  # index, not a boolean mask: no host sync in the step
    labels = torch.roll(flat, -1).index_select(0, rows)

    layout = m.layout_for(flat, cu)  # built once: its index tensors are reused by every step

    def loss_fn():
        logits, kl = m(flat, layout=layout, return_indexer_loss=True)  # [T, V]; kl None when the loss is off
        lm = F.cross_entropy(logits.index_select(0, rows).float(), labels)
        return lm if kl is None else lm + kl

    return m, loss_fn


def make_transformers(c, ids):
    import transformers
    from transformers import DeepseekV4ForCausalLM

    from tests.reference.hf_mapping import hf_config_from

    hc = hf_config_from(c)
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM._from_config(hc, attn_implementation="eager", dtype=torch.bfloat16)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    m.config.use_cache = False
    m.train()
    make_transformers.note = (f"transformers {transformers.__version__}, attn eager, experts "
                              f"{getattr(m.config, '_experts_implementation', None)}")

    def loss_fn():
        logits = m(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    return m, loss_fn


MAKERS = {"miles": make_miles, "megatron": make_megatron, "transformers": make_transformers}


def bench_one(impl, c, ids, warmup, steps, budget_s=None, profile=False, compile_blocks=False, cuda_graph=False,
              indexer_loss_coeff=None):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    extra = {"indexer_loss_coeff": indexer_loss_coeff} if impl == "megatron" else {}
    model, loss_fn = MAKERS[impl](c, ids, **extra)
    if compile_blocks:
        from engine.compile import compile_blocks as _compile

        _compile(model, cuda_graphs=cuda_graph)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    note = getattr(MAKERS[impl], "note", "")

    def step():
        if cuda_graph:
            torch.compiler.cudagraph_mark_step_begin()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    first_loss = float(loss.detach())
    # fit the timed steps into the budget, timing one step first (warm-up steps include compilation)
    n = steps
    if budget_s is not None:
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        per = time.perf_counter() - t1
        n = max(1, min(steps, int(budget_s / max(per, 1e-4))))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        with tprofile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.device_time for e in kernels) / 1e3 / 2
        print(f"--- {impl}: per step {len(kernels) / 2:.0f} GPU kernels, {busy_ms:.1f} ms GPU busy "
              f"(of {dt * 1e3:.1f} ms); top self-CUDA ops over 2 steps", flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60),
              flush=True)
    out = dict(step_ms=dt * 1e3, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30, timed_steps=n,
               warmup_steps=warmup, warmup_s=warm_s, loss_first=first_loss, loss_last=float(loss.detach()),
               trainable_params=sum(p.numel() for p in params),
               total_params=sum(p.numel() for p in model.parameters()), note=note)
    del model, opt, params, loss_fn
    gc.collect()
    torch.cuda.empty_cache()
    return out


def print_table(rows):
    base = next((r for r in rows if r["impl"] == "transformers" and r.get("tokens_per_s")), None)
    hdr = f"{'impl':<13} {'backend':<8} {'compiled':<8} {'tokens/s':>10} {'MFU':>7} {'step ms':>9} {'peak GB':>8} {'vs HF':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.get("tokens_per_s"):
            sp = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
            print(f"{r['impl']:<13} {r['kernel_backend']:<8} {str(r.get('compiled', False)):<8} {r['tokens_per_s']:>10.0f} {100 * r['mfu']:>6.2f}% "
                  f"{r['step_ms']:>9.1f} {r['peak_mem_gb']:>8.2f} {sp:>7}")
        else:
            print(f"{r['impl']:<13} {r['kernel_backend']:<8} {str(r.get('compiled', False)):<8} FAILED: {r.get('error', '')[:80]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/train-h200.json")
    ap.add_argument("--impls", default="miles,megatron,transformers")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", default="", help="comma list of impls to profile after timing (top CUDA ops)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds per implementation for the timed steps (after warm-up); fewer than --steps if short")
    ap.add_argument("--cuda-graph", choices=("on", "off"), default="on",
                    help="compiled blocks also as CUDA graphs (Inductor's reduce-overhead mode; engine.compile)")
    ap.add_argument("--compile", choices=("on", "off", "both"), default="on",
                    help="run miles / megatron with their blocks torch.compile'd (engine.compile), eagerly, or both")
    ap.add_argument("--preset", default=None,
                    help="a core.config preset (for example flash-shaped) instead of the small benchmark config")
    ap.add_argument("--indexer-loss-coeff", type=float, default=None,
                    help="megatron: train the indexer with its KL loss at this weight (default: off); needs --cuda-graph off")
    args = ap.parse_args(argv)

    from core.assembly import assemble

    if args.preset:
        from core.config import preset

        c = preset(args.preset)
    else:
        c = bench_config()
    assemble(bench_run_config("miles", c)).setup_process()
    seq, batch = args.seq, args.batch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (batch, seq), generator=g).cuda()
    n_act = active_params(c)
    fl = step_flops(c, seq, batch, n_act)
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    summary = config_summary(c, seq, batch)
    flop_note = (f"FLOPs/step = 6 x {n_act} active params (no input embedding; routed experts at top-k/E) x "
                 f"{seq * batch} tokens + 12 x heads x head_dim x selected keys = {fl['total']:.4e} "
                 f"(attention {fl['attention']:.4e}); MFU against 989 TFLOP/s (H200 dense bf16 peak)")
    print(flop_note, flush=True)
    rows = []
    runs = []
    for impl in [s for s in args.impls.split(",") if s]:
        modes = [False] if impl == "transformers" else {"on": [True], "off": [False], "both": [False, True]}[args.compile]
        runs += [(impl, m) for m in modes]
    for impl, compiled in runs:
        graphed = compiled and args.cuda_graph == "on"
        row = dict(impl=impl, kernel_backend="triton" if impl != "transformers" else "eager", compiled=compiled,
                   cuda_graph=graphed,
                   indexer_loss_coeff=args.indexer_loss_coeff if impl == "megatron" else None,
                   tokens_per_s=None, mfu=None, step_ms=None, peak_mem_gb=None, date=date, device=device,
                   config=summary, flops_per_step=fl["total"], flops_note=flop_note,
                   peak_tflops=H200_BF16_DENSE_TFLOPS)
        try:
            r = bench_one(impl, c, ids, args.warmup, args.steps, args.budget_s, impl in args.profile.split(","), compiled,
                          graphed, args.indexer_loss_coeff)
            row.update(r)
            row["tokens_per_s"] = seq * batch / (r["step_ms"] / 1e3)
            row["mfu"] = fl["total"] / (r["step_ms"] / 1e3) / (H200_BF16_DENSE_TFLOPS * 1e12)
        except Exception as e:  # record and keep the others
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-4000:]
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in row.items() if k not in ("config", "flops_note", "traceback")}),
              flush=True)
        rows.append(row)
    base = next((r for r in rows if r["impl"] == "transformers" and r.get("tokens_per_s")), None)
    for r in rows:
        r["speedup_vs_transformers"] = (r["tokens_per_s"] / base["tokens_per_s"]
                                        if base and r.get("tokens_per_s") else None)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
