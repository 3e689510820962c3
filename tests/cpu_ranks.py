"""Gloo ranks on the CPU for multi-process tests, started the way the product starts the cpu target's local
ranks (``orchestration.local_workers``: forked from a server that imported the CPU shims and megatron-core once, each
rank in the test's environment and folder of its launch).

The rendezvous port is picked here, not by the caller: a port picked free can be taken by another test's process
before rank 0's store binds it (a CI run lost ``test_native_tp_chunks`` to ``EADDRINUSE`` that way), and only the
start knows to pick again (``core.ports.on_free_port``). Callers put :data:`PORT` where the worker takes its port."""

#: Stands for the rendezvous port in a worker's arguments; :func:`spawn_cpu_ranks` puts the port it picked there.
PORT = object()


def spawn_cpu_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes, joined (``torch.multiprocessing.spawn``'s signature), with
    :data:`PORT` in ``args`` replaced by a free port; started again on another when that port was taken first."""
    from backends.cpu.target import CpuTarget
    from core.ports import on_free_port
    from orchestration.local_workers import start_processes

    if sum(a is PORT for a in args) != 1:
        raise ValueError("spawn_cpu_ranks: put tests.cpu_ranks.PORT once in args, where the worker takes its port")

    def start(port: int) -> None:
        # torch._dynamo too: each rank builds a model, whose op table imports it (tests/cli_process.py's PRELOAD)
        start_processes(fn, tuple(port if a is PORT else a for a in args), nprocs, CpuTarget(),
                        modules=("torch._dynamo",))

    on_free_port(start, f"{fn.__module__}.{fn.__name__} on {nprocs} CPU ranks")
