"""Gloo ranks on the CPU for multi-process tests, started the way the product starts the cpu target's local
ranks (``orchestration.local_workers``: forked from a server that imported the CPU shims and megatron-core once, each
rank in the test's environment and folder of its launch)."""


def spawn_cpu_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes, joined (``torch.multiprocessing.spawn``'s signature)."""
    from backends.cpu.target import CpuTarget
    from orchestration.local_workers import start_processes

    # torch._dynamo too: each rank builds a model, whose op table imports it (tests/cli_process.py's PRELOAD)
    start_processes(fn, tuple(args), nprocs, CpuTarget(), modules=("torch._dynamo",))
