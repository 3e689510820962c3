"""torch.distributed's launcher environment, checked; and a rendezvous that says whom it waited for.

Why: ``WORLD_SIZE=2 RANK=5`` (a rank outside the world), or a world of 2 with one rank started, hung with
nothing printed (torch's default process-group timeout is 30 minutes, and its message names no rank); with
``RANK`` and ``WORLD_SIZE`` set but no ``MASTER_ADDR`` the variables were ignored and the run trained as one
rank. Here:

* :func:`launcher_env` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
  ``LOCAL_WORLD_SIZE`` when set): all five or none of the rank variables; integers in range
  (``0 <= RANK < WORLD_SIZE``, ``0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE``, a port 1..65535);
  a partial or inconsistent environment is a :class:`DistEnvError` naming the variables and the fix.
  ``MASTER_ADDR`` / ``MASTER_PORT`` alone (exported for other tools) do not make a rank.
* :func:`rendezvous` meets the other ranks on the c10d store at ``MASTER_ADDR:MASTER_PORT`` (hosted by rank 0,
  or by torchrun's agent when it shares its store, as torch's own ``env://`` does) before the process group
  is built: each rank registers, then waits at most ``timeout_s`` (the ``rendezvous_timeout_s`` key) for the
  others; on timeout each rank names the ranks it waited for. A second process with the same ``RANK`` and a
  taken ``MASTER_PORT`` are named as such. The store is then handed to the process group.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from typing import Dict, Optional

from core.errors import UserInputError
from core.ports import address_in_use

__all__ = ["ENV", "DistEnvError", "launcher_env", "rendezvous", "DEFAULT_TIMEOUT_S"]

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
DEFAULT_TIMEOUT_S = 300.0
MAX_WORLD = 1 << 20


class DistEnvError(UserInputError):
    """The launcher's environment is partial or inconsistent, or the ranks did not all meet."""


class MasterPortTaken(DistEnvError):
    """Rank 0 could not host the store: another process bound ``MASTER_PORT`` first. A launcher that picked the
    port itself starts the group again on another (:mod:`orchestration.ray_launch`)."""


def _int(env: Dict[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistEnvError(f"{key}={env[key]!r} is not an integer. Fix: start the ranks with torchrun or srun, "
                           f"which set torch.distributed's environment") from None


def launcher_env(environ=None) -> Optional[Dict[str, str]]:
    """torch.distributed's environment of this process (the five :data:`ENV` variables), checked; None when
    none of ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` is set (no launcher started this process)."""
    environ = os.environ if environ is None else environ
    if not any(k in environ for k in _RANK_VARS):
        return None
    missing = [k for k in ENV if k not in environ]
    if missing:
        given = ", ".join(f"{k}={environ[k]}" for k in ENV if k in environ)
        raise DistEnvError(f"torch.distributed's environment is partial: {given} but no {', '.join(missing)}; a "
                           f"rank needs all of {', '.join(ENV)}. Fix: start the ranks with torchrun (or srun with "
                           f"all five exported), or unset {', '.join(k for k in _RANK_VARS if k in environ)} to "
                           f"run without a launcher")
    env = {k: environ[k] for k in ENV}
    rank, world, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
    port = _int(env, "MASTER_PORT")
    if not 1 <= world <= MAX_WORLD:
        raise DistEnvError(f"WORLD_SIZE={world} is out of range: allowed 1 .. {MAX_WORLD:,}")
    if not 0 <= rank < world:
        raise DistEnvError(f"RANK={rank} is outside the world of WORLD_SIZE={world} ranks (0 .. {world - 1}); "
                           f"this rank would wait forever for a place in it. Fix: give each process a RANK from 0 "
                           f"to WORLD_SIZE - 1 (torchrun does)")
    local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else None
    if local_world is not None and not 1 <= local_world <= world:
        raise DistEnvError(f"LOCAL_WORLD_SIZE={local_world} is out of range for WORLD_SIZE={world}: allowed 1 .. "
                           f"{world}")
    top = local_world if local_world is not None else rank + 1
    if not 0 <= local < top:
        raise DistEnvError(f"LOCAL_RANK={local} is inconsistent with RANK={rank}"
                           + (f", LOCAL_WORLD_SIZE={local_world}" if local_world is not None else "")
                           + f": allowed 0 .. {top - 1}. Fix: give each process of a node a LOCAL_RANK from 0 to "
                             f"its number of ranks - 1 (torchrun does)")
    if not 1 <= port <= 65535:
        raise DistEnvError(f"MASTER_PORT={port} is not a port (1 .. 65535)")
    if not env["MASTER_ADDR"].strip():
        raise DistEnvError("MASTER_ADDR is empty. Fix: set it to rank 0's host name or address")
    return env


def _prefix() -> str:
    """Keys of this attempt of this job (torchrun's agent store outlives a restart)."""
    return f"dsv4-rdzv/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    shown = ", ".join(str(r) for r in ranks[:16])
    return shown + (f", ... ({len(ranks)} in all)" if len(ranks) > 16 else "")


def _wait_for_listener(rank: int, addr: str, port: int, deadline: float, fix: str) -> None:
    """Wait until something listens at ``addr:port`` (rank 0's store), or raise naming rank 0 at ``deadline``.
    Tried here with plain sockets: torch's store client, left to time out, prints its C++ stack to stderr."""
    started = time.monotonic()
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise DistEnvError(f"rank {rank} ({socket.gethostname()}) waited {time.monotonic() - started:.0f} s "
                                   f"for rank 0 at {addr}:{port} (waited for ranks: 0); no store answered there. "
                                   f"{fix}") from None
            time.sleep(0.1)


def _client_by(deadline: float, make):
    """``make()`` (the store client) if it returns by ``deadline``, else None; its exception re-raised. Why: a
    listener that takes the connection and never answers (a full backlog, another service) keeps torch's client
    waiting past its own timeout, so the rank hung past ``rendezvous_timeout_s``; the client is built on a daemon
    thread, left behind on the way out."""
    import threading

    got: dict = {}

    def build():
        try:
            got["store"] = make()
        except Exception as exc:      # handed to the caller
            got["error"] = exc

    worker = threading.Thread(target=build, name="dsv4-store-client", daemon=True)
    worker.start()
    worker.join(max(0.1, deadline - time.monotonic()))
    if "error" in got:
        raise got["error"]
    return got.get("store")


@contextlib.contextmanager
def _cpp_log_hidden():
    """Standard error (file descriptor 2) sent to /dev/null for the ``with`` block. Why: torch's store client logs a
    C++ warning with its whole stack there when what answers at the port is not a store (another service, or a
    port another run took), and the caller raises its own one-line error naming the fix instead. Yields a dict:
    where the block sets ``left_behind`` (a store client :func:`_client_by` gave up on, still running on its
    thread), descriptor 2 stays on /dev/null for the rest of the process and Python's ``sys.stderr`` writes to the
    real standard error: that client's warning came after the error line when it logged late (a loaded CI
    machine)."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    state = {"left_behind": False}
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield state
    finally:
        if state["left_behind"]:
            sys.stderr = os.fdopen(saved, "w", buffering=1, encoding=sys.stderr.encoding,
                                   errors=sys.stderr.errors)
        else:
            os.dup2(saved, 2)
            os.close(saved)


def rendezvous(rank: int, world: int, addr: str, port: int, *, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The store every rank of the world registered in within ``timeout_s`` seconds (module docstring)."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    hosts = rank == 0 and not agent
    fix = (f"Fix: start every rank 0 .. {world - 1} with the same MASTER_ADDR ({addr}) and MASTER_PORT ({port}), "
           f"or raise rendezvous_timeout_s (now {timeout_s:g} s) if they start slowly")
    started = time.monotonic()
    if not hosts:
        _wait_for_listener(rank, addr, port, started + timeout_s, fix)
    try:
        if hosts:
            store = dist.TCPStore(addr, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        else:
            with _cpp_log_hidden() as hidden:
                store = _client_by(started + timeout_s, lambda: dist.TCPStore(
                    addr, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False))
                hidden["left_behind"] = store is None
            if store is None:
                raise DistEnvError(f"rank {rank} ({socket.gethostname()}) waited {time.monotonic() - started:.0f} s "
                                   f"for rank 0 at {addr}:{port} (waited for ranks: 0); something listens there "
                                   f"but no store answered (another service?). {fix}")
    except DistEnvError:
        raise
    except Exception as exc:          # torch raises DistNetworkError / DistStoreError / RuntimeError
        if hosts and address_in_use(exc):
            raise MasterPortTaken(f"rank 0 cannot listen on MASTER_PORT {port} at {addr}: the port is taken by another "
                               f"process (another run?). Fix: choose a free MASTER_PORT") from None
        if hosts:
            raise DistEnvError(f"rank 0 cannot listen on {addr}:{port} ({type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). Fix: set "
                               f"MASTER_ADDR to this host's name or address and MASTER_PORT to a free port") from None
        raise DistEnvError(f"rank {rank} ({socket.gethostname()}) waited {time.monotonic() - started:.0f} s for rank 0 "
                           f"at {addr}:{port} (waited for ranks: 0); no store answered there. {fix}") from None
    store = dist.PrefixStore(_prefix(), store)
    if store.add(f"rank/{rank}", 1) > 1:
        raise DistEnvError(f"two processes started as RANK={rank} of this run (WORLD_SIZE={world}). Fix: give each "
                           f"process its own RANK from 0 to {world - 1}")
    keys = [f"rank/{r}" for r in range(world)]
    deadline = started + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if missing:
                raise DistEnvError(f"rank {rank} ({socket.gethostname()}) waited {timeout_s:g} s for the other ranks "
                                   f"of WORLD_SIZE={world}; ranks {_ranks(missing)} did not start (waited for "
                                   f"ranks: {_ranks(missing)}). {fix}")
            break
        time.sleep(0.05)
    return store


def check_local_ranks(n: int, *, gpu: bool) -> None:
    """Refuse starting more local ranks than this machine can hold: one GPU each on a GPU ``--hardware``
    (the GPUs torch sees), on the CPU at most four per core (every rank holds the model and forks its own
    threads; :data:`MAX_CPU_RANKS_PER_CORE`)."""
    cores = os.cpu_count() or 1
    if gpu:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else None
        if have is not None and n > have:
            raise DistEnvError(f"--nproc-per-node {n} asks for {n} local ranks, one GPU each, but this machine has "
                               f"{have} GPU(s). Fix: pass --nproc-per-node {have} or fewer (or start the ranks of "
                               f"several nodes with torchrun)")
        return
    limit = max(8, MAX_CPU_RANKS_PER_CORE * cores)
    if n > limit:
        raise DistEnvError(f"--nproc-per-node {n} asks for {n} local CPU ranks on a machine of {cores} core(s); at "
                           f"most {limit} (each rank holds the model and its own threads). Fix: pass "
                           f"--nproc-per-node {limit} or fewer")


MAX_CPU_RANKS_PER_CORE = 4
