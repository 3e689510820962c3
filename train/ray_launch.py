"""``dsv4 train --orchestrator ray``: the trainer's ranks and the rollout engines as actors on a Ray cluster.

Why: past one machine, the ranks and engines run on an existing cluster manager rather than processes the
trainer starts by hand; Ray is what RL systems at this scale use (placement groups, actor restarts, an
object store for weights). The run's code is unchanged inside the actors:

* **Cluster**: ``--ray-address`` (else ``RAY_ADDRESS``) names a running cluster; without either, a local one is
  started for the run (no dashboard) and stopped at its end.
* **Placement**: one placement group (strategy PACK: as few nodes as fit) of one bundle per trainer rank
  (``{GPU: 1, CPU: 1}``; on the CPU ``{CPU: 1}``), plus, disaggregated (``--rollout-num-gpus N``), one bundle
  per engine. Colocated, engine ``j`` shares the bundle of its data-parallel leader (rank ``j x tp x cp``,
  megatron's rank order), each taking half of it.
* **Trainer group**: one :class:`TrainerRank` actor per rank sets torch.distributed's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` = rank 0's node, ``MASTER_PORT`` = a
  free port there) and runs the same rank entry point torchrun's ranks run (``train.trainer._rank_main``), so
  torch.distributed and megatron-core start exactly as under torchrun. On GPUs Ray gives each actor its GPU as
  ``CUDA_VISIBLE_DEVICES``, so ``LOCAL_RANK`` is 0 there.
* **Engines**: one :class:`train.ray_engines.EngineActor` per data-parallel rank, created here (they outlive a
  restarted trainer group) with ``max_restarts``; the trainer reaches them through
  :class:`train.ray_engines.RayEngineProxy`.
* **Faults**: an engine actor that dies is restarted by Ray and re-synced by its proxy. A trainer actor that
  dies ends the group; the group is started again with ``--resume`` (the last complete checkpoint; nothing is
  lost: the steps after it are trained again) up to ``--ray-max-restarts`` times. An error a rank raises is not
  retried: it is the run's error, one line, as under the local launcher.

``DSV4_*`` variables of the launching process (the cache folder, ``--debug``, the tests' kill hooks), the
trackers' ``WANDB_*`` / ``MLFLOW_*`` settings and its ``PYTHONWARNINGS`` are passed to every actor; a restarted
trainer group gets them without ``DSV4_TRAIN_KILL_AT`` (a test kills once).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from core.errors import UserInputError

from .launch import RankFailed

__all__ = ["run_on_ray", "TrainerRank", "DEFAULT_MAX_RESTARTS"]

DEFAULT_MAX_RESTARTS = 2
PLACEMENT_TIMEOUT_S = 120.0
_KILL_ONCE = ("DSV4_TRAIN_KILL_AT",)
_FORWARDED = ("DSV4_", "WANDB_", "MLFLOW_")      # environment prefixes every actor gets from the launcher


class TrainerRank:
    """One trainer rank inside a Ray actor (module docstring)."""

    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from core.ports import free_port

        return free_port()

    def run(self, env: Dict[str, str], engines: Sequence[Any], placement: Dict[str, Any], console_level: int,
            fn: Callable, args: tuple) -> Any:
        from core.known_warnings import filter_known_warnings

        from .ray_engines import set_rank_engines
        from .run_log import configure_console

        for key in [k for k in os.environ if k.startswith("DSV4_") and k not in env]:
            del os.environ[key]        # a worker inherits its node's environment: the run's DSV4_* win
        os.environ.update(env)
        configure_console(console_level)
        filter_known_warnings(show=console_level <= logging.DEBUG)
        set_rank_engines(engines, **placement)
        return fn(*args)


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _cannot_connect(address: str, why: str) -> UserInputError:
    return UserInputError(f"--ray-address {address}: cannot connect to a Ray cluster there ({why}). Fix: start one "
                          f"with `ray start --head` and pass its address, or leave --ray-address and RAY_ADDRESS "
                          f"unset to start a local one")


def _check_reachable(address: Optional[str]) -> None:
    """A ``HOST:PORT`` that nothing listens on fails here at once (Ray's own client waits minutes for it)."""
    import socket

    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return                       # "auto", ray://... : Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise _cannot_connect(address, f"{host}:{port}: {exc.strerror or exc}") from None


def _connect(address: Optional[str], bundles: int) -> None:
    """Connect to the cluster, or start a local one with at least one (logical) CPU per bundle: CPU ranks
    share this machine's cores as the local launcher's do."""
    import ray

    from .run_log import log

    address = address or os.environ.get("RAY_ADDRESS") or None
    local = {} if address else {"num_cpus": max(os.cpu_count() or 1, bundles)}
    _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=False, log_to_driver=True, **local)
    except ConnectionError as exc:
        raise _cannot_connect(address, _one_line(exc)) from None
    resources = ray.cluster_resources()
    where = f"Ray cluster at {address}" if address else "a local Ray cluster (started for this run)"
    log.info(f"orchestrator: ray: {where}: {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs")


def _bundles(run, world: int) -> List[Dict[str, float]]:
    gpu = run.selection.hardware.gpu
    one = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
    return [dict(one) for _ in range(world + (run.rollout_num_gpus or 0))]


def _placement_group(run, world: int):
    import ray
    from ray.util.placement_group import placement_group

    bundles = _bundles(run, world)
    pg = placement_group(bundles, strategy="PACK", name=f"dsv4-{os.getpid()}")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
        have = ray.cluster_resources()
        raise UserInputError(f"the Ray cluster cannot place the run within {PLACEMENT_TIMEOUT_S:.0f} s: it needs "
                             f"{len(bundles)} bundles ({need['CPU']:g} CPUs, {need['GPU']:g} GPUs), the cluster has "
                             f"{have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs. Fix: add nodes (`ray start "
                             f"--address HEAD:PORT` on each), or use fewer --trainer-num-gpus / --rollout-num-gpus"
                             ) from None
    return pg


def _actor_options(pg, bundle: int, share: float, gpu: bool, env: Dict[str, str]) -> Dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return dict(num_cpus=share, num_gpus=share if gpu else 0, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle))


def _dsv4_env(first_attempt: bool) -> Dict[str, str]:
    """What every actor gets of this process's environment (a Ray worker inherits its node's, not the
    launcher's): ``DSV4_*``, the trackers' settings (``WANDB_*``, ``MLFLOW_*``) and ``PYTHONWARNINGS`` (the
    library warnings the launcher hides unless ``-v``); a restarted group's without the kill-once test hooks."""
    return {k: v for k, v in os.environ.items()
            if (k.startswith(_FORWARDED) or k == "PYTHONWARNINGS") and (first_attempt or k not in _KILL_ONCE)}


def _start_engines(run, model_config, cfg, run_dir, pg, world: int, max_restarts: int) -> List[Any]:
    import ray

    from .ray_engines import EngineActor

    gpu, colocated = run.selection.hardware.gpu, run.rollout_num_gpus is None
    mp = run.tp * run.cp
    options = dict(settings=cfg, run_dir=run_dir, publish_format=run.selection.quant.publish_format)
    remote = ray.remote(max_restarts=max_restarts, max_task_retries=0)(EngineActor)
    actors = []
    for j in range(world // mp):
        bundle = j * mp if colocated else world + j
        opts = _actor_options(pg, bundle, 0.5 if colocated else 1.0, gpu, _dsv4_env(True))
        actors.append(remote.options(**opts).remote(run, model_config, options))
    try:
        where = ray.get([a.ready.remote() for a in actors])
    except Exception as exc:
        raise _engine_error(exc) from None
    from .run_log import log

    mode = "colocated" if colocated else f"disaggregated ({run.rollout_num_gpus} bundle(s) of their own)"
    log.info(f"orchestrator: ray: {len(actors)} rollout engine actor(s), {mode}, on "
             f"{', '.join(sorted({w['node'] for w in where}))}")
    return actors


def _engine_error(exc: BaseException) -> BaseException:
    from ray.exceptions import RayTaskError

    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, (UserInputError, ValueError)):
        return UserInputError(f"rollout engine actor: {_one_line(cause)}")
    return RankFailed(f"rollout engine actor failed: {type(cause).__name__}: {_one_line(cause)}")


def _rank_env(trainers: List[Any], gpu: bool) -> List[Dict[str, str]]:
    """torch.distributed's environment of each trainer actor (module docstring)."""
    import ray

    nodes = ray.get([t.node.remote() for t in trainers])
    port = ray.get(trainers[0].free_port.remote())
    envs = []
    for rank, node in enumerate(nodes):
        same = [r for r, n in enumerate(nodes) if n == node]
        envs.append({"RANK": str(rank), "WORLD_SIZE": str(len(trainers)), "MASTER_ADDR": nodes[0],
                     "MASTER_PORT": str(port), "LOCAL_RANK": "0" if gpu else str(same.index(rank)),
                     "LOCAL_WORLD_SIZE": str(len(same))})
    return envs


def _run_group(run, pg, world: int, engines, placement, fn, args, first_attempt: bool):
    """One trainer group: start it, run every rank, return rank 0's result. A dead actor is
    :class:`_GroupDied`; a rank's own error is re-raised as the launcher's one-line error."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    from .run_log import _console_handler

    gpu, colocated = run.selection.hardware.gpu, run.rollout_num_gpus is None
    remote = ray.remote(max_restarts=0, max_task_retries=0)(TrainerRank)
    env = _dsv4_env(first_attempt)
    trainers = [remote.options(**_actor_options(pg, r, 0.5 if colocated else 1.0, gpu, env)).remote()
                for r in range(world)]
    try:
        envs = [{**env, **e} for e in _rank_env(trainers, gpu)]
        console = _console_handler()        # the actors print what this process prints (-q, -v)
        level = console.level if console is not None else logging.INFO
        refs = [t.run.remote(e, engines, placement, level, fn, args) for t, e in zip(trainers, envs)]
        pending, first_error = list(refs), None
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayActorError as exc:
                raise _GroupDied(refs.index(done[0]), exc) from None
            except RayTaskError as exc:
                first_error = first_error or (refs.index(done[0]), exc)
                break
        if first_error is not None:
            rank, exc = first_error
            cause = exc.cause if exc.cause is not None else exc
            if isinstance(cause, (UserInputError, ValueError)):
                raise RankFailed(f"rank {rank}: {_one_line(cause)}") from None
            raise RankFailed(f"rank {rank} failed: {type(cause).__name__}: {_one_line(cause)} (rerun with --debug "
                             f"for its traceback)") from None
        return ray.get(refs[0])
    finally:
        for t in trainers:
            ray.kill(t, no_restart=True)


class _GroupDied(Exception):
    def __init__(self, rank: int, exc: BaseException):
        super().__init__(f"trainer rank {rank} died ({_one_line(exc)})")
        self.rank = rank


def run_on_ray(run, fn: Callable, *, model_config, model_source, mode: str, steps: int, run_dir, resume: bool, cfg,
               progress: bool, address: Optional[str], max_restarts: Optional[int]) -> Any:
    """Run ``fn(run, model_source, mode, steps, run_dir, resume, cfg, progress)`` (the trainer's rank entry
    point) on ``run.world`` trainer actors with their engines (built for ``model_config``); returns rank 0's
    result."""
    from .checkpointing import latest_checkpoint
    from .run_log import log

    try:
        import ray
    except ImportError:
        raise UserInputError("--orchestrator ray needs the `ray` package, which is not installed here. Fix: "
                             "pip install ray==2.60.0 (or `pip install '.[ray]'`), or use --orchestrator local"
                             ) from None
    if run.weight_transport not in (None, "objects"):
        from core.not_built import NotBuiltError

        raise NotBuiltError(f"--weight-transport {run.weight_transport} is not built yet (docs/ray.md). Fix: use "
                            f"--weight-transport objects (Ray's object store)")
    restarts = DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts
    world = run.world
    _connect(address, len(_bundles(run, world)))
    try:
        pg = _placement_group(run, world)
        engines = _start_engines(run, model_config, cfg, run_dir, pg, world, restarts) if mode == "grpo" else []
        placement = dict(max_restarts=restarts, colocated=run.rollout_num_gpus is None, model_parallel=run.tp * run.cp)
        log.info(f"orchestrator: ray: {world} trainer actor(s) in placement group {pg.id.hex()[:8]}")
        attempt = 0
        while True:
            args = (run, model_source, mode, steps, str(run_dir), resume or attempt > 0, cfg, progress)
            try:
                return _run_group(run, pg, world, engines, placement, fn, args, first_attempt=attempt == 0)
            except _GroupDied as died:
                attempt += 1
                if attempt > restarts:
                    raise RankFailed(f"{died} and the trainer group was restarted {restarts} times already "
                                     f"(--ray-max-restarts); the run's last complete checkpoint is kept: continue "
                                     f"with --resume") from None
                found = latest_checkpoint(run_dir)
                log.warning(f"{died}; restarting the trainer group from "
                            f"{f'checkpoint step {found[0]}' if found else 'the start'} "
                            f"(restart {attempt} of {restarts})")
    finally:
        ray.shutdown()
