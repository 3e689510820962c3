"""Multi-GPU training-throughput benchmark (issue #9): tokens/s and MFU per parallel layout, and the
weight-export bucket throughput, on the small DeepSeek-V4 config of ``bench.configs.bench_config``.

``python -m bench.parallel --layouts miles:tp1,miles:tp2,miles:cp2,megatron:cp1,megatron:cp2``

Every layout runs ``world = tp * cp * ep`` processes (``torch.multiprocessing.spawn``; on the CPU forked from
one preloaded server, as ``dsv4 train`` starts the cpu target's ranks), one GPU each, set up by the nvidia
hardware target (NCCL, megatron's parallel groups); one layout after the other, so the
numbers are side by side with the one-GPU run of the same code. Per step (eager, bf16, triton kernels):

* ``tp`` (miles, BSHD): every rank sees the whole sequence; heads, o-groups, vocabulary and expert ffn are
  split (``backends/miles``);
* ``cp`` (THD): the packed stream (one sequence of ``--seq`` tokens) is split contiguously; each rank's loss
  is its rows' share of the mean next-token NLL, and the replicated parameters' gradients are summed over the
  CP group (one coalesced all-reduce per dtype), which is part of the timed step;
* ``ep``: experts split over the ranks, each rank its own sequence (data parallel; see ``engine.moe``);
  gradients of the replicated parameters are averaged over the ranks.

tokens/s counts the tokens of one step over all ranks; MFU = FLOPs per step / step time / (world x 989 TFLOP/s),
FLOPs per step from ``bench.flops.step_flops`` (all ranks' tokens). Export: the trainer side of weight
sync (``engine.loading.full_native_state``, a TP all-gather) then ``core.export.export_buckets`` and
``converters.publish.publish_bucket`` (bf16 and fp8, after one untimed pass that compiles the quantization
kernels) on rank 0, 256 MiB buckets; GB/s of published bytes."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.grad_allreduce import all_reduce_grads

from bench.configs import bench_config, bench_run_config, config_summary
from bench.flops import H200_BF16_DENSE_TFLOPS, active_params, step_flops

DEFAULT_LAYOUTS = "miles:tp1,miles:tp2,miles:cp2,megatron:cp1,megatron:cp2"


def parse_layout(text: str) -> dict:
    """``impl:tp2`` / ``impl:cp2`` / ``impl:ep2`` / ``impl:tp1`` -> ``{impl, tp, cp, ep, world}``."""
    impl, _, spec = text.partition(":")
    sizes = {"tp": 1, "cp": 1, "ep": 1}
    for part in filter(None, spec.split("+")):
        kind, n = part[:2], part[2:]
        if kind not in sizes or not n.isdigit():
            raise ValueError(f"layout {text!r}: expected impl:tpN, impl:cpN or impl:epN (joined with +)")
        sizes[kind] = int(n)
    if impl not in ("miles", "megatron"):
        raise ValueError(f"layout {text!r}: impl must be miles or megatron")
    world = sizes["tp"] * sizes["cp"] * sizes["ep"]
    return {"impl": impl, **sizes, "world": world, "name": text}


def _loss_fn(m, layout, ids):
    """The step's loss closure for this rank (``ids [1, S]``: the sequence this rank's group trains on)."""
    impl, cp = layout["impl"], layout["cp"]
    S = ids.shape[1]
    if impl == "miles" and cp == 1:
        return lambda: F.cross_entropy(m(ids)[0, :-1].float(), ids[0, 1:])
    from engine.thd_attention import ThdContext, cp_group_info

    rank = cp_group_info()[1]
    flat = ids.reshape(-1)
    cu = torch.tensor([0, S], dtype=torch.int64, device=ids.device)
    n = S // cp
    local = flat[rank * n:(rank + 1) * n]
    rows = torch.arange(rank * n, (rank + 1) * n, device=ids.device)
    keep = (rows < S - 1).nonzero().squeeze(1)  # the last token has no label
    labels = flat[(rows + 1).clamp(max=S - 1)].index_select(0, keep)
    if impl == "miles":
        thd = ThdContext.build(cu, local_len=n) if cp > 1 else None

        def fwd():
            return m(local[None], thd=thd)[0] if thd is not None else m(local[None], cu_seqlens=cu)[0]
    else:
        layout_obj = m.layout_for(local, cu)

        def fwd():
            return m(local, layout=layout_obj)
    return lambda: F.cross_entropy(fwd().index_select(0, keep).float(), labels, reduction="sum") / (S - 1)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _export_throughput(m, c, rank: int, device) -> dict:
    """Seconds and GB/s of gather + export + publish (bf16, fp8) of the whole model on rank 0."""
    from converters.publish import publish_bucket
    from core.export import export_buckets, tensor_nbytes
    from engine.loading import full_native_state

    out = {}
    for scheme in ("fp8", "bf16", "fp8"):  # the first fp8 pass warms the quantization kernels (not kept)
        _sync(device)
        t0 = time.perf_counter()
        state = full_native_state(m)  # collective over TP
        n_bytes = n_buckets = 0
        if rank == 0:
            for bucket in export_buckets(state.items(), c, max_bucket_bytes=256 << 20, dtype=torch.bfloat16):
                published = publish_bucket(bucket, scheme)
                n_bytes += sum(tensor_nbytes(t) for _, t in published)
                n_buckets += 1
        _sync(device)
        dt = time.perf_counter() - t0
        out[scheme] = {"seconds": dt, "gb": n_bytes / 1e9, "gb_per_s": n_bytes / 1e9 / dt, "buckets": n_buckets}
        del state
    return out


def _worker(rank: int, layout: dict, port: int, seq: int, warmup: int, steps: int, out_path: str,
            hardware: str, model: str) -> None:
    from core.assembly import assemble

    c = model_config(model)
    fmt = "thd" if layout["cp"] > 1 or layout["impl"] == "megatron" else "bshd"
    rc = bench_run_config(layout["impl"], c, hardware=hardware, tp=layout["tp"], cp=layout["cp"],
                          ep=layout["ep"], qkv_format=fmt)
    parts = assemble(rc)
    target = parts.target
    if hardware == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // layout["world"]))
    ranks = target.init_process_group(rank, layout["world"], tp=layout["tp"], cp=layout["cp"], ep=layout["ep"],
                                      port=port)   # this rank's engine.layout.ParallelLayout
    try:
        device = parts.device()
        torch.manual_seed(0)
        m = parts.build_model(c).to(device).train()   # the run's dtype: bf16 on nvidia, fp32 on the CPU
        seed = ranks.ep_rank if layout["ep"] > 1 else 0  # ep: its own sequence per rank
        ids = torch.randint(0, c.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seed)).to(device)
        loss_fn = _loss_fn(m, layout, ids)
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
        if layout["cp"] > 1:
            sync = (ranks.group("cp"), False, params)
        elif layout["ep"] > 1:
            sync = (ranks.group("dp"), True, [p for p in params if not getattr(p, "expert_parallel", False)])
        else:
            sync = None

        def step():
            loss = loss_fn()
            loss.backward()
            if sync is not None:
                all_reduce_grads(sync[2], sync[0], sync[1])
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(warmup):
            loss = step()
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        _sync(device)
        dt = (time.perf_counter() - t0) / steps
        if layout["cp"] > 1:  # each CP rank holds its rows' share of the loss
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=ranks.group("cp"))
        export = _export_throughput(m, c, rank, device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        res = {"step_ms": dt * 1e3, "peak_mem_gb": peak,
               "loss_last": float(loss.detach()), "timed_steps": steps, "warmup_steps": warmup, "export": export}
        if rank == 0:
            torch.save(res, out_path)
    finally:
        target.destroy_process_group()


def model_config(name: str):
    """``bench``: the issue's benchmark config (``bench.configs.bench_config``); ``tiny``: the embedded
    test model (the CPU smoke run)."""
    if name == "bench":
        return bench_config()
    from core.config import preset

    return preset(name)


def run_layout(layout: dict, seq: int, warmup: int, steps: int, hardware: str = "nvidia",
               model: str = "bench") -> dict:
    import torch.multiprocessing as mp

    from core.ports import on_free_port

    if hardware == "nvidia" and layout["world"] > torch.cuda.device_count():
        raise RuntimeError(f"{layout['name']} needs {layout['world']} GPUs; {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.pt"

        def start(port: int) -> None:
            args = (layout, port, seq, warmup, steps, str(out), hardware, model)
            if hardware == "cpu":
                # the gloo ranks start as dsv4 train starts the cpu target's: forked from one server that imported
                # torch, megatron-core and this module once (orchestration.local_workers), not a fresh interpreter
                # per rank and layout; torch._dynamo too, which each rank's model build imports
                from backends.cpu.target import CpuTarget
                from orchestration.local_workers import start_processes

                start_processes(_worker, args, layout["world"], CpuTarget(), modules=("torch._dynamo",))
            else:
                mp.spawn(_worker, args=args, nprocs=layout["world"], join=True)

        # a port taken between the pick and rank 0's store (another job's, a parallel test's) starts the ranks
        # again on another, where it failed the layout (CI saw EADDRINUSE here)
        on_free_port(start, f"bench.parallel {layout['name']}")
        return torch.load(out)


def print_table(rows) -> None:
    hdr = (f"{'layout':<16} {'GPUs':>4} {'tokens/s':>10} {'MFU':>7} {'step ms':>9} {'peak GB':>8} "
           f"{'export bf16 GB/s':>17} {'export fp8 GB/s':>16}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.get("tokens_per_s"):
            e = r["export"]
            mfu = f"{100 * r['mfu']:>6.2f}%" if r.get("mfu") is not None else f"{'-':>7}"
            peak = f"{r['peak_mem_gb']:>8.2f}" if r.get("peak_mem_gb") is not None else f"{'-':>8}"
            print(f"{r['layout']:<16} {r['gpus']:>4} {r['tokens_per_s']:>10.0f} {mfu} "
                  f"{r['step_ms']:>9.1f} {peak} {e['bf16']['gb_per_s']:>17.2f} "
                  f"{e['fp8']['gb_per_s']:>16.2f}")
        else:
            print(f"{r['layout']:<16} {r['gpus']:>4} FAILED: {r.get('error', '')[:90]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma list of impl:tpN / impl:cpN / impl:epN")
    ap.add_argument("--out", default="bench/results/parallel-h200.json")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (one sequence per data-parallel rank)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hardware", choices=("nvidia", "cpu"), default="nvidia",
                    help="cpu: gloo processes, reference kernels, fp32 (a smoke run; MFU not reported)")
    ap.add_argument("--model", default="bench", help="bench (the issue's config) or a preset name (tiny)")
    args = ap.parse_args(argv)
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):  # no NVLink multicast (the lent machines' rule)
        os.environ.setdefault(var, value)
    c = model_config(args.model)
    layouts = [parse_layout(s) for s in args.layouts.split(",") if s]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gpu = args.hardware == "nvidia"
    device = torch.cuda.get_device_name() if gpu else "cpu"
    rows = []
    for layout in layouts:
        seqs = layout["ep"]  # data-parallel sequences per step (ep ranks each train their own)
        fl = step_flops(c, args.seq, seqs, active_params(c))["total"]
        row = {"layout": layout["name"], "impl": layout["impl"], "tp": layout["tp"], "cp": layout["cp"],
               "ep": layout["ep"], "gpus": layout["world"], "seq": args.seq, "sequences_per_step": seqs,
               "date": date, "device": device, "config": config_summary(c, args.seq, seqs), "flops_per_step": fl,
               "peak_tflops": H200_BF16_DENSE_TFLOPS if gpu else None, "compiled": False,
               "kernel_backend": "triton" if gpu else "none", "model": args.model}
        try:
            r = run_layout(layout, args.seq, args.warmup, args.steps, args.hardware, args.model)
            row.update(r)
            row["tokens_per_s"] = args.seq * seqs / (r["step_ms"] / 1e3)
            row["mfu"] = fl / (r["step_ms"] / 1e3) / (layout["world"] * H200_BF16_DENSE_TFLOPS * 1e12) if gpu else None
        except Exception as e:  # record and keep the others
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
            traceback.print_exc()
        print(json.dumps({k: v for k, v in row.items() if k not in ("config", "traceback")}), flush=True)
        rows.append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))  # after every layout: nothing lost on a crash
    print_table(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
