"""Worker for the tensor-parallel test: one gloo rank of a tp=world run of the miles model.

Loads the official weights saved by the parent, computes log-probs (S=37 and 140), one
loss / backward / Adam step, gathers full gradients over TP and (rank 0) saves the results."""

from __future__ import annotations

import torch


def run(rank: int, world: int, port: int, weights_path: str, out_path: str) -> None:
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, tp=world, port=port)
    try:
        from ._helpers import miles_model, miles_step, token_ids

        official = torch.load(weights_path)
        m = miles_model(official, tp=world)
        local_shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
        with torch.no_grad():
            lps = {S: m.logprobs(token_ids(2, S, 200 + S)) for S in (37, 140)}
        loss, grads, after = miles_step(m, token_ids(2, 140, 11))
        if rank == 0:
            torch.save({"logprobs": lps, "loss": loss, "grads": grads, "after": after,
                        "local_shapes": local_shapes}, out_path)
    finally:
        destroy_cpu_process_group()


def run_native(rank: int, world: int, port: int, native_in: str, native_out: str, out_path: str) -> None:
    """tp=world rank: load a native checkpoint written at tp=1 (resharding on load), score, then
    gather the full native state and (rank 0) save it as a new native checkpoint."""
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, tp=world, port=port)
    try:
        from core.assembly import assemble
        from core.native_checkpoint import load_native, save_native
        from engine.loading import full_native_state, load_native_tensors

        from ._helpers import TINY, run_config, token_ids

        state, _ = load_native(native_in, impl="miles", config=TINY)
        m = assemble(run_config(world)).build_model(TINY)
        load_native_tensors(m, state.items())
        with torch.no_grad():
            lps = {S: m.logprobs(token_ids(2, S, 300 + S)) for S in (37, 140)}
        full = full_native_state(m)  # collective over the TP group
        if rank == 0:
            save_native(native_out, full, impl="miles", config=TINY)
            torch.save({"logprobs": lps}, out_path)
    finally:
        destroy_cpu_process_group()
