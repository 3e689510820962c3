"""Worker of the context-parallel tests: one gloo rank of a cp=world run (tp 1).

Loads the official weights saved by the parent, scores the packed stream (THD), and for miles also
a BSHD batch split contiguously over the ranks; runs one loss / backward, all-reduces the gradients
over the CP group, and (rank 0) saves everything."""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, impl: str, weights_path: str, out_path: str,
        indexer_coeff: float | None = None) -> None:
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, cp=world, port=port)
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from ._common import build, cu_seqlens, grads_official, local_slice, packed_loss, stream

        official = torch.load(weights_path)
        cu, ids = cu_seqlens(), stream()
        fmt = "thd" if impl == "megatron" else None
        m = build(impl, official, cp=world, qkv_format=fmt, indexer_coeff=indexer_coeff)
        group = ps.get_context_parallel_group()
        out = {}
        with torch.no_grad():
            lp = m.logprobs(local_slice(ids, world, rank), cu)
            parts = [torch.empty_like(lp) for _ in range(world)]
            dist.all_gather(parts, lp.contiguous(), group=group)
            out["logprobs"] = torch.cat(parts)
            if impl == "miles":  # BSHD + CP (contiguous all-gather design)
                bshd = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(5))
                blp = m.logprobs(local_slice(bshd, world, rank))
                parts = [torch.empty_like(blp) for _ in range(world)]
                dist.all_gather(parts, blp.contiguous(), group=group)
                out["bshd_logprobs"] = torch.cat(parts, dim=1)
        loss = packed_loss(m, impl, ids, cu, world, rank)
        loss.backward()
        for p in m.parameters():  # a rank may route no token to an expert: its grad is None there
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        out["loss"] = total.item()
        out["grads"] = grads_official(m)
        if rank == 0:
            torch.save(out, out_path)
    finally:
        destroy_cpu_process_group()
