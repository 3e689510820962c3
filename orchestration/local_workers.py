"""How this machine's worker processes start: ``spawn`` on GPUs, a preloaded ``forkserver`` on the CPU.

A spawned worker is a fresh interpreter: it imports torch, megatron-core and the trainer again, which on the CPU
target (gloo ranks sharing a few cores) is about 3.5 s of CPU per worker, most of a short run's cost (a
one-step two-rank run: 20 s of CPU with spawn, 12-14 s with the forkserver). A hardware target that declares
``local_worker_start = "forkserver"`` (the cpu target) has its workers forked from one server process that
imported its ``worker_preload`` modules and the worker function's module once; the server itself never ran a
torch op (one intra-op thread, so no OpenMP pool is forked). GPU targets keep ``spawn``: nothing CUDA-related
is ever forked.

The server is started by a process's first launch and serves its later ones, with the environment and working
directory it started with; each worker therefore takes its parent's, as they were at its launch, from
:func:`parent_state` (:func:`adopt`), keeping only the variables its launcher set for it.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Dict, Sequence

#: What torch.distributed's elastic agent sets for each worker (the rest of a worker's environment is its
#: parent's).
LAUNCHER_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})
_LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def start_method(target, modules: Sequence[str] = ()) -> str:
    """The start method for ``target``'s local workers; for the forkserver, also what it preloads: the
    target's ``worker_preload`` modules, then ``modules`` (the worker function's, for example)."""
    method = getattr(target, "local_worker_start", "spawn")
    if method == "forkserver":
        preload = [*getattr(target, "worker_preload", ()), *modules]
        multiprocessing.set_forkserver_preload(list(dict.fromkeys(preload)))
    return method


def parent_state() -> Dict[str, Any]:
    """This process's environment and working directory, for the workers it is about to start."""
    return {"env": dict(os.environ), "cwd": os.getcwd()}


def adopt(state: Dict[str, Any]) -> None:
    """In a worker: take the parent's environment and working directory from ``state``, keeping what the
    launcher set for this worker (its rank, world size, rendezvous)."""
    own = {k: v for k, v in os.environ.items() if k in LAUNCHER_KEYS or k.startswith(_LAUNCHER_PREFIXES)}
    if os.environ != {**state["env"], **own}:
        os.environ.clear()
        os.environ.update(state["env"])
        os.environ.update(own)
    if os.getcwd() != state["cwd"]:
        os.chdir(state["cwd"])


def start_processes(fn, args: tuple, nprocs: int, target, modules: Sequence[str] = ()) -> None:
    """``fn(rank, *args)`` on ``nprocs`` local processes (``torch.multiprocessing.start_processes``, joined),
    started as ``target`` asks, each in its parent's environment and folder; ``modules``: more to preload."""
    import torch.multiprocessing as mp

    method = start_method(target, [*modules, fn.__module__])
    mp.start_processes(_in_parent_state, args=(parent_state(), fn, *args), nprocs=nprocs, join=True,
                       start_method=method)


def _in_parent_state(rank: int, parent: Dict[str, Any], fn, *args) -> None:
    adopt(parent)
    fn(rank, *args)
