"""Starting and joining the trainer's ranks.

Two ways in, one code path:

* **torchrun / Slurm**: ``torchrun --nnodes N --nproc-per-node G -m launchers.dsv4 train ...`` (or ``srun`` with
  the same variables exported) starts every rank itself. Each process finds torch.distributed's standard
  environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins it
  (:func:`init_rank`): the run's hardware target starts the process group (NCCL on GPUs, gloo on the CPU) and
  megatron-core's parallel state for the run's ``--tp/--cp/--ep``.
* **one command on one machine**: without that environment, a run of several ranks (``--nproc-per-node G``,
  or ``tp x cp x ep`` by default) starts them as local workers through torch.distributed's elastic launcher
  (:func:`launch_local_ranks`, what torchrun itself uses), which gives each worker the same environment;
  they start as the hardware target asks (``orchestration.local_workers``: spawned on GPUs, forked from a preloaded
  server on the CPU).

A failing rank stops the others (the elastic agent's job); the error that reaches the user is the first
failing rank's, as one line (:class:`RankFailed`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from core.errors import UserInputError

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankFailed(UserInputError):
    """A local rank failed; the message (one line) is that rank's error or how it died."""


def launched_env() -> Optional[dict]:
    """torch.distributed's environment when this process was started by torchrun, srun or the elastic
    launcher; None otherwise; a partial or inconsistent one is refused (:func:`orchestration.dist_env.launcher_env`)."""
    from orchestration.dist_env import launcher_env

    return launcher_env()


def env_world_size() -> Optional[int]:
    """``WORLD_SIZE`` of the launcher that started this process, if any."""
    env = launched_env()
    return int(env["WORLD_SIZE"]) if env is not None else None


def joined_ranks() -> bool:
    """True when this process is already one rank of a several-rank run (a launcher's environment or a process
    group of more than one rank; the one-rank group a single-process job starts does not count)."""
    return launched_env() is not None or (dist.is_available() and dist.is_initialized()
                                          and dist.get_world_size() > 1)


def init_rank(run, parts, *, rendezvous_timeout_s: Optional[float] = None):
    """Join the run's process groups from the launcher's environment (idempotent), after every rank met within
    ``rendezvous_timeout_s`` (:func:`orchestration.dist_env.rendezvous`; None: its default); returns this rank's layout
    (``engine.layout.ParallelLayout``, built by the hardware target). ``parts``: the run's assembly."""
    from engine.layout import current

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != run.world:
            raise UserInputError(f"this process group has {dist.get_world_size()} ranks, the run's layout "
                                 f"{run.world}")
        return current()
    env = launched_env()
    if env is None:
        raise UserInputError(f"a run of {run.world} ranks needs torch.distributed's environment ({', '.join(ENV)}); "
                             f"start it with torchrun, or without a launcher and dsv4 starts local ranks")
    world = int(env["WORLD_SIZE"])
    if world != run.world:
        raise UserInputError(f"this process is one of {world} ranks (WORLD_SIZE), but the run's layout asks for "
                             f"{run.world}. Fix: pass --nproc-per-node to match the launcher, or leave it out "
                             f"under torchrun")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not parts.selection.hardware.gpu:     # CPU ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    from orchestration.dist_env import DEFAULT_TIMEOUT_S, rendezvous

    store = rendezvous(int(env["RANK"]), world, env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                       timeout_s=rendezvous_timeout_s or DEFAULT_TIMEOUT_S)
    return parts.target.init_process_group(int(env["RANK"]), world, tp=run.tp, cp=run.cp, ep=run.ep, pp=run.pp,
                                           port=int(env["MASTER_PORT"]), master_addr=env["MASTER_ADDR"],
                                           local_rank=int(env["LOCAL_RANK"]), store=store)


def launch_local_ranks(run, fn: Callable, args: Sequence[Any]) -> Any:
    """Run ``fn(*args)`` on ``run.world`` local workers (torch.distributed's elastic launcher, no restarts);
    returns rank 0's result. A failure is re-raised as the first failing rank's one-line error.

    The rendezvous store binds port 0 (the system picks a port as it binds; ``is_host``: this process hosts it,
    and a failure to listen is an error, not a client's wait for whatever answers there): a port picked free and
    bound later could be taken in between. The workers' own store is torch's, on a port of its own the same way."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from core.assembly import assemble

    from .local_workers import parent_state, start_method

    method = start_method(assemble(run).target, ["core.assembly", __name__, fn.__module__])
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are reported below, once
    with tempfile.TemporaryDirectory(prefix="dsv4-ranks-") as errors:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=run.world, run_id=f"dsv4-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"is_host": True},
                              max_restarts=0, monitor_interval=0.1, start_method=method)
        try:
            results = elastic_launch(config, _worker)(fn, tuple(args), errors, parent_state())
        except ChildFailedError as exc:
            raise _first_failure(Path(errors), exc) from None
    return results[0]


def _worker(fn: Callable, args: tuple, errors: str, parent: dict) -> Any:
    """One local rank: ``fn(*args)`` in its parent's environment (``orchestration.local_workers.adopt``); a failure is
    written for the parent before it propagates (with its traceback on stderr under ``--debug``)."""
    from .local_workers import adopt

    adopt(parent)
    try:
        return fn(*args)
    except BaseException as exc:
        if os.environ.get("DSV4_DEBUG", "") not in ("", "0"):
            import traceback

            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        record = {"rank": int(os.environ.get("RANK", -1)), "time": time.time(), "type": type(exc).__name__,
                  "message": first, "expected": isinstance(exc, (UserInputError, ValueError))}
        Path(errors, f"rank{record['rank']}.json").write_text(json.dumps(record))
        raise


def _first_failure(errors: Path, exc: BaseException) -> BaseException:
    records = []
    for p in errors.glob("rank*.json"):
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        failures = getattr(exc, "failures", None) or {}
        how = []
        for rank, failure in sorted(failures.items()):
            code = getattr(failure, "exitcode", None)
            how.append(f"rank {rank} was killed by {failure.signal_name()}" if code is not None and code < 0
                       else f"rank {rank} exited with code {code}")
        return RankFailed(f"{'; '.join(how) or 'a rank died'} (out of memory, or stopped from outside); the run's "
                          f"last complete checkpoint is kept: continue with --resume")
    first = min(records, key=lambda r: r["time"])
    if first["expected"]:
        return RankFailed(f"rank {first['rank']}: {first['message']}")
    return RankFailed(f"rank {first['rank']} failed: {first['type']}: {first['message']} (rerun with --debug for "
                      f"its traceback)")
