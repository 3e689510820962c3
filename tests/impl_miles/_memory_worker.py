"""Worker for the memory-estimate test: one gloo rank of the miles model built under a tensor- or
expert-parallel layout; saves what this rank holds, counted on the model itself."""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, tp: int, ep: int, out_prefix: str) -> None:
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, tp=tp, ep=ep, port=port)
    try:
        from core.assembly import assemble
        from core.run_config import Choices, normalize
        from engine.loading import native_tensors
        from launchers.builtin_plugins import make_host

        from ._helpers import TINY

        run_config = normalize(Choices(impl="miles", tp=tp, ep=ep, model=TINY), make_host(third_party=False),
                               model_name="tiny")
        model = assemble(run_config).build_model(TINY, params_dtype=torch.bfloat16)
        held = native_tensors(model)
        torch.save({
            "parameters": sum(t.numel() for t in held.values()),
            "weights": sum(t.numel() * t.element_size() for t in held.values()),
            "trainable": sum(p.numel() for p in model.parameters() if p.is_floating_point()),
            "fp32_trainable": sum(p.numel() for p in model.parameters() if p.dtype == torch.float32),
        }, f"{out_prefix}.{rank}")
    finally:
        destroy_cpu_process_group()


def in_flight(rank: int, world: int, port: int, micro_batches: int, out_prefix: str) -> None:
    """One stage of ``world`` running megatron-core's 1F1B (``engine.pipeline.run_schedule``) over
    ``micro_batches`` toy micro-batches; saves the most micro-batches whose forward had run and whose backward
    had not, at any moment (what a stage keeps activations of)."""
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, pp=world, port=port)
    try:
        from engine.pipeline import run_schedule

        w = torch.nn.Parameter(torch.ones(()))
        live, most = [0], [0]

        def backward_done(grad):
            live[0] -= 1
            return grad

        def stage(mb, x):
            x = torch.ones(1, 4, 8) if x is None else x
            out = x * w
            live[0] += 1
            most[0] = max(most[0], live[0])
            out.register_hook(backward_done)
            return out

        run_schedule(list(range(micro_batches)), [(1, 4)] * micro_batches, 8, stage, lambda mb, out: out.sum())
        assert live[0] == 0, live
        torch.save(most[0], f"{out_prefix}.{rank}")
    finally:
        destroy_cpu_process_group()
