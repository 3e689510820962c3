"""Rollout engines as Ray actors (``--orchestrator ray``), reached through the engine protocol.

Why a proxy: the trainer loop talks to its engine through the protocol of :mod:`rollout.reference_engine` (``generate``,
``begin_update`` / ``load_bucket`` / ``finish_update``, ``held_weights``, ``shutdown``). Under Ray each
data-parallel leader's engine lives in an actor of its own (:class:`EngineActor`, created by
:mod:`orchestration.ray_launch`), and :class:`RayEngineProxy` speaks the same protocol in the trainer's process, so the
loop and the weight sync (:func:`rollout.weight_sync.sync_weights`) are unchanged.

* **Weights** (``--weight-transport``): ``objects`` (the default) puts each published bucket (the weight
  contract's atomic groups, in the run's publish format) in Ray's object store once and hands the actor the
  ref; the proxy keeps the refs of the last complete update, so it can load them again into a restarted actor
  without the trainer. ``gloo`` / ``nccl`` broadcast each bucket's bytes from the leader to its engine actor
  over a process group of their own, and ``cuda-ipc`` hands a colocated actor an IPC handle to them
  (:mod:`orchestration.ray_transport`); the actor loads them through the same ``load_bucket``.
* **Faults**: the actor is created with ``max_restarts``; a call that finds it dead waits for Ray to restart it
  (a new process, the engine built again without weights), loads the last complete update into it and sends
  the call again. A restarted engine that has not been re-synced refuses to generate
  (:class:`EngineNotSynced`), so it never samples from the wrong weights. The direct transports keep no copy
  of the weights to load: there the proxy raises :class:`EngineLost`, and the launcher restarts the trainer
  group from its last checkpoint (its first step syncs every engine again).
* **Asynchronous rollout** (``async_rollout=true``, :mod:`rollout.async_rollout`): :meth:`RayEngineProxy.generate_async`
  sends the actor call and returns at once; the trainer resolves it (``result()``) at the next step, before the
  next weight update, so the actor generates while the trainer trains. A dead actor is re-synced then and asked
  again, as for a synchronous call.
* **Colocated** with a trainer rank (sharing its GPU), ``colocate=true`` makes the trainer call
  ``release_memory`` after each rollout, which the proxy forwards: the engine frees its weights and KV cache in
  its actor until the next update (docs/rollout.md, "Colocated mode").

:func:`rank_engine` is the engine source :func:`orchestration.training._rank_main` gives the trainer under Ray: the proxy of this
data-parallel rank's engine, from the handles the trainer actor was given (:func:`set_rank_engines`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Dict, List, Optional, Sequence

from core.errors import UserInputError

__all__ = ["EngineActor", "EngineLost", "EngineNotSynced", "PendingGenerate", "RayEngineProxy", "set_rank_engines",
           "rank_engine", "server_options", "ENGINE_KILL_ENV"]

# Test hook: "CALL:N" SIGKILLs an engine actor at its N-th ``CALL`` (generate, begin_update, ...), once per
# run: a restarted actor (a new process) never fires it again. "CALL:N@I" fires in engine actor I only: with
# several actors, "every actor at its N-th call" races (one may die before another's N-th call comes, which
# then comes after the restart), while one named actor dies at one known point.
ENGINE_KILL_ENV = "DSV4_RAY_ENGINE_KILL_AT"
# seconds a dead engine actor has to come back (Ray restarts it) before the run fails
RESTART_TIMEOUT_S = 300.0


class EngineNotSynced(RuntimeError):
    """The engine actor holds no weights of the version the trainer last sent (it was restarted)."""


class EngineLost(RuntimeError):
    """An engine actor died under a weight transport that keeps no copy of the weights to re-sync it with: the
    launcher restarts the trainer group from its last checkpoint (:mod:`orchestration.ray_launch`)."""


class EngineActor:
    """One rollout engine inside a Ray actor: the run's engine factory (``core.assembly``) builds it here, on the
    device Ray gave this actor, with ``options`` (this engine's own: a server engine's URL, port, log).

    A server engine (``--rollout-engine sglang``) is one server per actor: connected to at once (its
    ``--rollout-url``), or, in launch mode, started at the first weight update, when the trainer has written the
    run's starting weights (``RUN_DIR/<engine>_init``) for it to load. A restarted actor builds its engine at its
    re-sync: a started server comes up again from those weights; a connected one must still be there (the run
    cannot restart a server it did not start)."""

    def __init__(self, run_config, model_config, options: Dict[str, Any], index: int = 0):
        import ray

        from core.assembly import assemble

        parts = assemble(run_config)
        parts.target.setup()     # this process's set-up for the run's target (megatron-core's CPU shims, TF32 off)
        self.index = index
        self.url = options.get("url")
        self.server = bool(parts.selection.rollout.server)
        self._build = lambda: parts.rollout_engine(model_config, dtype=run_config.torch_dtype, **options)
        self.version: Optional[int] = None
        self.pending: Optional[int] = None
        self.calls: Dict[str, int] = {}
        self.group, self.backend = None, None      # gloo / nccl: this actor's group with its leader
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        deferred = self.server and (self.url is None or self.restarted)
        self.engine = None if deferred else self._build()

    def _engine(self):
        """The engine, built now if it was deferred (class docstring)."""
        if self.engine is None:
            try:
                self.engine = self._build()
            except UserInputError as exc:
                if self.url is None or not self.restarted:
                    raise
                raise UserInputError(
                    f"rollout engine actor {self.index} was restarted and cannot reach its server at {self.url} "
                    f"({str(exc).split('. Fix:')[0]}): a server given by --rollout-url is not one the run can "
                    f"restart. Fix: start it again there, then continue the run with --resume") from None
        return self.engine

    def _count(self, call: str) -> None:
        """The call counter behind the kill hook (:data:`ENGINE_KILL_ENV`)."""
        self.calls[call] = self.calls.get(call, 0) + 1
        hook = os.environ.get(ENGINE_KILL_ENV, "")
        point, _, actor = hook.partition("@")
        if not self.restarted and point == f"{call}:{self.calls[call]}" and actor in ("", str(self.index)):
            os.kill(os.getpid(), signal.SIGKILL)

    def ready(self) -> dict:
        """Where the actor runs (for the launcher's log) and whether it is a restarted one."""
        import ray

        return {"node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "restarted": self.restarted}

    def begin_update(self, version: int) -> None:
        self._count("begin_update")
        self.pending = version
        self._engine().begin_update(version)

    def assume_released(self) -> None:
        """Re-sync of a restarted actor whose last process had released its engine's memory: a connected server
        outlived that process and is released still (resumed at the next update); anything this process
        started holds nothing released."""
        if self.server and self.url is not None:
            engine = self._engine()
            if callable(getattr(engine, "assume_released", None)):
                engine.assume_released()

    def load_bucket(self, bucket) -> None:
        self._engine().load_bucket(bucket)

    def join_group(self, backend: str, host: str, port: int, rank: int, world: int) -> None:
        """``--weight-transport gloo|nccl``: join the leader's group (a new one replaces the last: a restarted
        trainer group brings new leaders)."""
        from .ray_transport import join_group

        self.group, self.backend = None, None
        self.group, self.backend = join_group(backend, host, port, rank, world), backend

    def receive_bucket(self, meta) -> None:
        """``--weight-transport gloo|nccl``: one bucket, broadcast by the leader, into the engine."""
        from .ray_transport import receive_bucket

        if self.group is None:
            raise RuntimeError("receive_bucket before join_group")
        self._engine().load_bucket(receive_bucket(self.group, self.backend, meta))

    def load_shared_bucket(self, meta, handle) -> None:
        """``--weight-transport cuda-ipc``: one bucket in the leader's GPU memory, copied before this returns
        (the leader frees it then)."""
        import torch

        from .ray_transport import open_shared, unpack_bucket

        shared = open_shared(handle)
        own = shared.clone()
        torch.cuda.current_stream(own.device).synchronize()
        del shared
        self._engine().load_bucket(unpack_bucket(meta, own))

    def finish_update(self) -> None:
        self._count("finish_update")
        self._engine().finish_update()
        self.version, self.pending = self.pending, None

    def held_weights(self):
        held = self.engine.held_weights() if self.engine is not None else None
        return None if held is None else {n: t.detach().cpu() for n, t in held.items()}

    def generate(self, version: int, prompts, params, n: int, seed: int, first_prompt: int = 0):
        self._count("generate")
        if self.version != version:
            raise EngineNotSynced(f"engine holds weights {self.version}, the trainer sent {version}")
        return self._engine().generate(prompts, params, n=n, seed=seed, first_prompt=first_prompt)

    def release_memory(self) -> None:
        if self.engine is not None:        # a server not started yet holds nothing
            self.engine.release_memory()

    def reports_held_bytes(self) -> bool:
        return callable(getattr(self.engine, "held_bytes", None))

    def held_bytes(self) -> int:
        return int(self.engine.held_bytes())

    def generate_timing(self):
        """The engine's last generate by phase (the built-in engine's ``generate_timing``), or None."""
        timing = getattr(self.engine, "generate_timing", None)
        return None if timing is None else timing()

    def shutdown(self) -> None:
        """Stop what the engine started (a launched server); a connected server is left running."""
        if self.engine is not None:
            self.engine.shutdown()


def _dead(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def _not_synced(exc: BaseException) -> bool:
    from ray.exceptions import RayTaskError

    return isinstance(exc, RayTaskError) and isinstance(exc.cause, EngineNotSynced)


def _errors(refs) -> list:
    """The errors of ``refs``' calls, in call order (empty when all succeeded)."""
    import ray

    try:
        ray.get(refs)
        return []
    except Exception:
        pass
    out = []
    for ref in refs:
        try:
            ray.get(ref)
        except Exception as exc:
            out.append(exc)
    return out


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)


def _raise_cause(exc: BaseException):
    """An error the engine raised, as itself (one line at the launcher), not wrapped in Ray's task error."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        raise exc.cause from None
    raise exc


class RayEngineProxy:
    """The engine protocol in the trainer's process, for one :class:`EngineActor` (module docstring)."""

    def __init__(self, actor, *, index: int, max_restarts: int, transport: str = "objects"):
        from .ray_transport import COLLECTIVE_TRANSPORTS, CollectiveSender

        self.actor, self.index, self.max_restarts, self.transport = actor, index, max_restarts, transport
        self._sender = CollectiveSender(transport, [actor]) if transport in COLLECTIVE_TRANSPORTS else None
        self.restarts = 0                  # re-syncs after the actor died (for the log and the tests)
        self._version: Optional[int] = None
        self._refs: List[Any] = []         # the last complete update's buckets (object refs)
        self._pending: Optional[List[Any]] = None
        self._calls: List[Any] = []
        self._reports_bytes: Optional[bool] = None
        self._released = False             # release_memory since the last complete update (a re-sync resumes it)

    # -- weights -----------------------------------------------------------
    def begin_update(self, version: int) -> None:
        self._pending, self._next = [], version
        self._calls = [self.actor.begin_update.remote(version)]

    def load_bucket(self, bucket) -> None:
        import ray

        if self._pending is None:
            raise RuntimeError("load_bucket before begin_update")
        if self.transport == "objects":
            ref = ray.put([(n, t.detach().cpu()) for n, t in bucket])   # the object store holds host memory
            self._pending.append(ref)
            self._calls.append(self.actor.load_bucket.remote(ref))
        elif self._sender is not None:
            try:
                self._calls += self._sender.send(bucket)
            except Exception as exc:        # the broadcast failed: the engine's error, or its death, says why
                self._direct_failure(exc)
        else:
            self._calls.append(self._share(bucket))

    def _share(self, bucket):
        """``cuda-ipc``: the bucket packed in one CUDA buffer, shared with the actor, freed once it copied it."""
        import torch

        from .ray_transport import pack_bucket, share_cuda

        meta, buffer = pack_bucket(bucket, torch.device("cuda", torch.cuda.current_device()))
        call = self.actor.load_shared_bucket.remote(meta, share_cuda(buffer))
        errors = _errors([call])         # the acknowledgement: the actor holds its own copy now
        del buffer
        torch.cuda.ipc_collect()          # the IPC block goes back to the allocator once the actor let go
        if errors:
            self._direct_failure(errors[0])
        return call

    def _direct_failure(self, exc: BaseException):
        """A direct transport's call failed: :class:`EngineLost` if the actor died (now or earlier in the update),
        else the engine's own error."""
        errors = _errors(self._calls) + [exc]
        dead = [e for e in errors if _dead(e)]
        if dead:
            self._lost(dead[0])
        not_transport = [e for e in errors if e is not exc]
        _raise_cause(not_transport[0] if not_transport else exc)

    def _lost(self, cause: BaseException):
        raise EngineLost(f"rollout engine actor {self.index} died ({_first_line(cause)}), and --weight-transport "
                         f"{self.transport} keeps no copy of the weights to re-sync a restarted one") from None

    def finish_update(self) -> None:
        if self._pending is None:
            raise RuntimeError("finish_update before begin_update")
        refs, version = self._pending, self._next
        calls, self._pending, self._calls = self._calls + [self.actor.finish_update.remote()], None, []
        errors = _errors(calls)
        if errors and not _errors(calls[:1]):
            self._released = False      # this update's begin_update ran: it resumed the engine's memory
        dead = [e for e in errors if _dead(e)]
        if dead:      # the actor died during the update (its later calls may have reached the restarted one)
            self._resync(refs, version, dead[0])
        elif errors:
            _raise_cause(errors[0])
        self._refs, self._version, self._released = refs, version, False

    def held_weights(self) -> Optional[Dict]:
        return self._call(lambda: self.actor.held_weights.remote())

    def release_memory(self) -> None:
        """Colocated mode (``colocate=true``): the engine actor frees its device memory until the next update."""
        self._call(lambda: self.actor.release_memory.remote())
        self._released = True

    @property
    def held_bytes(self):
        """What the engine actor holds on its device (the trainer's ``engine_memory_gib``), as the local engine's
        method; None when the actor's engine cannot say (the trainer then reports nothing)."""
        if self._reports_bytes is None:
            self._reports_bytes = self._call(lambda: self.actor.reports_held_bytes.remote())
        if not self._reports_bytes:
            return None
        return lambda: self._call(lambda: self.actor.held_bytes.remote())

    def generate_timing(self):
        """The actor's engine's last generate by phase (the trainer's ``time_rollout_decode`` ...), or None."""
        return self._call(lambda: self.actor.generate_timing.remote())

    # -- generation ----------------------------------------------------------
    def generate(self, prompts, params, *, n: int, seed: int, first_prompt: int = 0):
        if self._version is None:
            raise RuntimeError(f"rollout engine actor {self.index} has no weights yet (sync weights first)")
        prompts = [list(map(int, p)) for p in prompts]
        return self._call(lambda: self.actor.generate.remote(self._version, prompts, params, n, seed, first_prompt))

    def generate_async(self, prompts, params, *, n: int, seed: int, first_prompt: int = 0) -> "PendingGenerate":
        """:meth:`generate`, sent now and resolved by the handle's ``result()`` (async rollout), which the trainer
        calls before its next weight update: a dead actor is then re-synced with the update it generated from."""
        if self._version is None:
            raise RuntimeError(f"rollout engine actor {self.index} has no weights yet (sync weights first)")
        prompts = [list(map(int, p)) for p in prompts]
        version = self._version

        def submit():
            return self.actor.generate.remote(version, prompts, params, n, seed, first_prompt)

        return PendingGenerate(self, submit(), submit)

    def shutdown(self) -> None:
        """Nothing to stop here: the launcher owns the actor (it outlives a restarted trainer group)."""

    # -- faults ----------------------------------------------------------------
    def _call(self, submit, sent=None):
        """``ray.get(submit())`` (or of ``sent``, a call already sent); a dead or restarted actor is re-synced and the
        call sent again."""
        import ray

        for _attempt in range(self.max_restarts + 2):
            try:
                ref, sent = (submit() if sent is None else sent), None
                return ray.get(ref)
            except Exception as exc:
                if not (_dead(exc) or _not_synced(exc)):
                    _raise_cause(exc)
                self._resync(self._refs, self._version, exc)
        raise UserInputError(f"rollout engine actor {self.index} kept failing after {self.max_restarts} restarts")

    def _resync(self, refs: Sequence[Any], version: Optional[int], cause: BaseException) -> None:
        """Wait for the restarted actor and load ``refs`` (update ``version``) into it."""
        import ray
        from ray.exceptions import RayActorError

        from reporting.run_log import log

        if self.transport != "objects":
            self._lost(cause)
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise UserInputError(f"rollout engine actor {self.index} died {self.restarts} times (--ray-max-restarts "
                                 f"{self.max_restarts}): {_first_line(cause)}")
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                ray.get(self.actor.ready.remote(), timeout=30)
                break
            except (RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise UserInputError(f"rollout engine actor {self.index} did not come back within "
                                         f"{RESTART_TIMEOUT_S:.0f} s of dying") from None
                time.sleep(0.5)
        log.warning(f"rollout engine actor {self.index} was restarted; loading weights version {version} into it")
        if version is None:
            return
        calls = [self.actor.assume_released.remote()] if self._released else []
        calls.append(self.actor.begin_update.remote(version))
        calls += [self.actor.load_bucket.remote(ref) for ref in refs]
        calls.append(self.actor.finish_update.remote())
        errors = _errors(calls)
        if errors:            # e.g. a connected server that is gone: the engine's one line
            _raise_cause(errors[0])


class PendingGenerate:
    """A generate call sent to an engine actor (:meth:`RayEngineProxy.generate_async`); ``result()`` waits for it."""

    def __init__(self, proxy: RayEngineProxy, ref, submit):
        self.proxy, self.ref, self.submit = proxy, ref, submit

    def result(self):
        return self.proxy._call(self.submit, sent=self.ref)


def server_options(run, settings, run_dir, index: int) -> Dict[str, Any]:
    """A server engine's own factory options for engine actor ``index``: its URL of the ``--rollout-url`` list
    (connect mode), or, launch mode, the run's starting weights (``RUN_DIR/<engine>_init``, written by the
    trainer before its first update) and files and a port of its own, so servers on one node do not collide:
    ``RUN_DIR/<engine>_server_<index>.log``, ``RUN_DIR/<engine>_weights_<index>`` (``sglang_weight_sync=disk``),
    port ``sglang_port + index`` (a free one when ``sglang_port`` is 0)."""
    from pathlib import Path

    from core.run_config import rollout_urls

    if run.rollout_url is not None:
        return {"url": rollout_urls(run.rollout_url)[index]}
    name, folder = run.selection.rollout.name, Path(run_dir)
    base = int(getattr(settings, f"{name}_port", 0) or 0)
    return {"model_path": str(folder / f"{name}_init"), "port": base + index if base else None,
            "log_file": str(folder / f"{name}_server_{index}.log"), "disk_dir": str(folder / f"{name}_weights_{index}")}


# -- the trainer actor's side -------------------------------------------------------
_RANK_ENGINES: Dict[str, Any] = {}


def set_rank_engines(actors: Sequence[Any], *, max_restarts: int, colocated: bool, model_parallel: int,
                     transport: str = "objects") -> None:
    """What a trainer actor was given by the launcher: the engine actors (one per data-parallel rank, in rank
    order), how they are placed and how weights reach them. Read by :func:`rank_engine`."""
    _RANK_ENGINES.clear()
    _RANK_ENGINES.update(actors=list(actors), max_restarts=max_restarts, colocated=colocated,
                         model_parallel=model_parallel, transport=transport)


def rank_engine() -> RayEngineProxy:
    """This data-parallel leader's engine proxy (the trainer's engine under ``--orchestrator ray``)."""
    from train.distributed import ParallelGroups

    if not _RANK_ENGINES:
        raise RuntimeError("--orchestrator ray: this process is not a trainer actor of orchestration.ray_launch (no engines)")
    groups = ParallelGroups.current()
    actors = _RANK_ENGINES["actors"]
    if len(actors) != groups.dp:
        raise RuntimeError(f"{len(actors)} engine actors for {groups.dp} data-parallel ranks")
    if _RANK_ENGINES["colocated"] and groups.rank != groups.dp_rank * _RANK_ENGINES["model_parallel"]:
        raise RuntimeError(f"colocated engine {groups.dp_rank} was placed with rank "
                           f"{groups.dp_rank * _RANK_ENGINES['model_parallel']}, but its leader is rank {groups.rank}")
    return RayEngineProxy(actors[groups.dp_rank], index=groups.dp_rank, max_restarts=_RANK_ENGINES["max_restarts"],
                          transport=_RANK_ENGINES["transport"])
