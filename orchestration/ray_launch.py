"""``dsv4 train --orchestrator ray``: the trainer's ranks and the rollout engines as actors on a Ray cluster.

Why: past one machine, the ranks and engines run on an existing cluster manager rather than processes the
trainer starts by hand; Ray is what RL systems at this scale use (placement groups, actor restarts, an
object store for weights). The run's code is unchanged inside the actors:

* **Cluster**: ``--ray-address`` (else ``RAY_ADDRESS``) names a running cluster; without either, a local one is
  started for the run (no dashboard) and stopped at its end.
* **Placement** (:func:`placement_plan`): one placement group (strategy PACK: as few nodes as fit) of one
  bundle per trainer rank (``{GPU: 1, CPU: 1}``; on the CPU ``{CPU: 1}``), plus, disaggregated
  (``--rollout-num-gpus N``), one bundle per engine. Colocated, engine ``j`` shares the bundle of its
  data-parallel leader (rank ``j x tp x cp``, megatron's rank order), each taking half of it. With
  ``--rollout-num-nodes M`` the engines get a placement group of their own, created first: M bundles of
  ``N / M`` GPUs, strategy STRICT_SPREAD (each bundle on another node), engines ``j`` in bundle ``j // (N / M)``.
* **Weights** (``--weight-transport``): Ray's object store, or directly (:mod:`orchestration.ray_transport`); the
  launcher logs which.
* **Trainer group**: one :class:`TrainerRank` actor per rank sets torch.distributed's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` = rank 0's node, ``MASTER_PORT`` = a
  free port there) and runs the same rank entry point torchrun's ranks run (``orchestration.training._rank_main``), so
  torch.distributed and megatron-core start exactly as under torchrun. On GPUs Ray gives each actor its GPU as
  ``CUDA_VISIBLE_DEVICES``, so ``LOCAL_RANK`` is 0 there.
* **Engines**: one :class:`orchestration.ray_engines.EngineActor` per data-parallel rank, created here (they outlive a
  restarted trainer group) with ``max_restarts``; the trainer reaches them through
  :class:`orchestration.ray_engines.RayEngineProxy`.
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
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from core.errors import UserInputError

from .dist_env import MasterPortTaken
from .launch import RankFailed

__all__ = ["run_on_ray", "TrainerRank", "Placement", "placement_plan", "DEFAULT_MAX_RESTARTS"]

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
        from reporting.run_log import configure_console

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


def _connect(address: Optional[str], cpus: int) -> None:
    """Connect to the cluster, or start a local one with at least the logical CPUs the bundles hold: CPU ranks
    share this machine's cores as the local launcher's do."""
    import ray

    from reporting.run_log import log

    address = address or os.environ.get("RAY_ADDRESS") or None
    local = {} if address else {"num_cpus": max(os.cpu_count() or 1, cpus)}
    _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=False, log_to_driver=True, **local)
    except ConnectionError as exc:
        raise _cannot_connect(address, _one_line(exc)) from None
    resources = ray.cluster_resources()
    where = f"Ray cluster at {address}" if address else "a local Ray cluster (started for this run)"
    log.info(f"orchestrator: ray: {where}: {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs")


@dataclass(frozen=True)
class Placement:
    """Where a run's actors go: ``groups`` (strategy, bundles) in creation order; ``trainers[r]`` and
    ``engines[j]`` are ``(group, bundle, share)``: the group's index, the bundle's and the share of the bundle's
    resources the actor takes."""

    groups: Tuple[Tuple[str, Tuple[Dict[str, float], ...]], ...]
    trainers: Tuple[Tuple[int, int, float], ...]
    engines: Tuple[Tuple[int, int, float], ...]

    @property
    def bundles(self) -> int:
        return sum(len(b) for _, b in self.groups)

    @property
    def cpus(self) -> int:
        """The logical CPUs the groups hold (what a local cluster started for the run needs at least)."""
        return int(sum(b["CPU"] for _, bundles in self.groups for b in bundles))


def placement_plan(*, gpu: bool, world: int, model_parallel: int, rollout_num_gpus: Optional[int],
                   rollout_num_nodes: Optional[int]) -> Placement:
    """The placement of ``world`` trainer ranks and their engines (module docstring); a pure function of the run's
    numbers, which the combination table has checked (``rollout-num-gpus``, ``rollout-num-nodes``)."""
    def one(n: int = 1) -> Dict[str, float]:
        return {"CPU": float(n), **({"GPU": float(n)} if gpu else {})}

    dp = world // model_parallel
    if rollout_num_gpus is None:            # colocated: engine j in its leader's bundle, half each
        return Placement(groups=(("PACK", tuple(one() for _ in range(world))),),
                         trainers=tuple((0, r, 0.5) for r in range(world)),
                         engines=tuple((0, j * model_parallel, 0.5) for j in range(dp)))
    if not rollout_num_nodes:               # disaggregated, one group: the engines' bundles after the trainer's
        return Placement(groups=(("PACK", tuple(one() for _ in range(world + rollout_num_gpus))),),
                         trainers=tuple((0, r, 1.0) for r in range(world)),
                         engines=tuple((0, world + j, 1.0) for j in range(rollout_num_gpus)))
    per = rollout_num_gpus // rollout_num_nodes   # engines per node; their group first (the stricter one)
    return Placement(groups=(("STRICT_SPREAD", tuple(one(per) for _ in range(rollout_num_nodes))),
                             ("PACK", tuple(one() for _ in range(world)))),
                     trainers=tuple((1, r, 1.0) for r in range(world)),
                     engines=tuple((0, j // per, 1.0) for j in range(rollout_num_gpus)))


def _plan(run, world: int) -> Placement:
    return placement_plan(gpu=run.selection.hardware.gpu, world=world, model_parallel=run.tp * run.cp,
                          rollout_num_gpus=run.rollout_num_gpus, rollout_num_nodes=run.rollout_num_nodes)


def _check_nodes(plan: Placement) -> None:
    """A STRICT_SPREAD group needs as many nodes as bundles: fewer is one line now, not a placement timeout."""
    import ray

    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    for strategy, bundles in plan.groups:
        if strategy == "STRICT_SPREAD" and len(bundles) > alive:
            raise UserInputError(f"--rollout-num-nodes {len(bundles)}: the Ray cluster has {alive} node(s). Fix: add "
                                 f"nodes (`ray start --address HEAD:PORT` on each), or use --rollout-num-nodes "
                                 f"{alive} or fewer")


def _placement_groups(plan: Placement) -> List[Any]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    _check_nodes(plan)
    groups = []
    try:
        for i, (strategy, bundles) in enumerate(plan.groups):
            groups.append(placement_group(list(bundles), strategy=strategy, name=f"dsv4-{os.getpid()}-{i}"))
            ray.get(groups[-1].ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for pg in groups:
            remove_placement_group(pg)
        every = [b for _, bundles in plan.groups for b in bundles]
        need = {k: sum(b.get(k, 0) for b in every) for k in ("CPU", "GPU")}
        have = ray.cluster_resources()
        spread = f", the engines over {len(plan.groups[0][1])} nodes" if len(plan.groups) > 1 else ""
        raise UserInputError(f"the Ray cluster cannot place the run within {PLACEMENT_TIMEOUT_S:.0f} s: it needs "
                             f"{plan.bundles} bundles ({need['CPU']:g} CPUs, {need['GPU']:g} GPUs{spread}), "
                             f"the cluster has {have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs. Fix: add "
                             f"nodes (`ray start --address HEAD:PORT` on each), or use fewer --trainer-num-gpus / "
                             f"--rollout-num-gpus") from None
    return groups


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


def _start_engines(run, model_config, cfg, run_dir, groups, plan: Placement, max_restarts: int) -> List[Any]:
    import ray

    from .ray_engines import EngineActor, server_options

    gpu, colocated = run.selection.hardware.gpu, run.rollout_num_gpus is None
    options = dict(settings=cfg, run_dir=run_dir, publish_format=run.selection.quant.publish_format)
    remote = ray.remote(max_restarts=max_restarts, max_task_retries=0)(EngineActor)
    actors = []
    for j, (group, bundle, share) in enumerate(plan.engines):
        opts = _actor_options(groups[group], bundle, share, gpu, _dsv4_env(True))
        own = server_options(run, cfg, run_dir, j) if run.selection.rollout.server else {}
        actors.append(remote.options(**opts).remote(run, model_config, {**options, **own}, j))
    try:
        where = ray.get([a.ready.remote() for a in actors])
    except Exception as exc:
        raise _engine_error(exc) from None
    from reporting.run_log import log

    mode = "colocated" if colocated else f"disaggregated ({run.rollout_num_gpus} bundle(s) of their own)"
    nodes = len({w["node_id"] for w in where})
    log.info(f"orchestrator: ray: {len(actors)} rollout engine actor(s), {mode}, on {nodes} node(s) "
             f"({', '.join(sorted({w['node'] for w in where}))})")
    if run.selection.rollout.server:
        name = run.selection.rollout.name
        how = (f"connected to {run.rollout_url.replace(',', ', ')}" if run.rollout_url else
               f"each starting its server on its own GPU at its first weight update (RUN_DIR/{name}_init)")
        log.info(f"orchestrator: ray: --rollout-engine {name}: one server per engine actor, {how}")
    transport = run.weight_transport or "objects"
    how = {"objects": "Ray's object store", "gloo": "a torch.distributed broadcast, backend gloo (host memory)",
           "nccl": "a torch.distributed broadcast, backend nccl", "cuda-ipc": "CUDA IPC handles (the same GPU)"}
    log.info(f"orchestrator: ray: weight transport {transport}: each step's weights reach the engine actors "
             f"through {how[transport]}")
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


def _run_group(run, groups, plan: Placement, engines, placement, fn, args, first_attempt: bool):
    """One trainer group: start it, run every rank, return rank 0's result. A dead actor, or an engine actor
    lost under a direct weight transport (:class:`orchestration.ray_engines.EngineLost`), is :class:`_GroupDied`; a
    rank's own error is re-raised as the launcher's one-line error."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    from .ray_engines import EngineLost
    from reporting.run_log import _console_handler

    gpu = run.selection.hardware.gpu
    remote = ray.remote(max_restarts=0, max_task_retries=0)(TrainerRank)
    env = _dsv4_env(first_attempt)
    trainers = [remote.options(**_actor_options(groups[group], bundle, share, gpu, env)).remote()
                for group, bundle, share in plan.trainers]
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
                if isinstance(exc.cause, EngineLost):
                    raise _GroupDied(refs.index(done[0]), exc.cause, what="lost its rollout engine") from None
                first_error = first_error or (refs.index(done[0]), exc)
                break
        if first_error is not None:
            raise _rank_error(*first_error, port=envs[0]["MASTER_PORT"]) from None
        return ray.get(refs[0])
    finally:
        for t in trainers:
            ray.kill(t, no_restart=True)


def _rank_error(rank: int, exc: BaseException, port: str) -> Exception:
    """A trainer rank's own error (``exc``: Ray's task error around it) as the launcher raises it: rank 0's
    rendezvous port taken before it bound it is :class:`_PortTaken` (the group starts again on another); a user's
    or a value error is one line; anything else names its type."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, MasterPortTaken):
        return _PortTaken(f"rank 0 could not listen on its rendezvous port {port}: another process bound it first")
    if isinstance(cause, (UserInputError, ValueError)):
        return RankFailed(f"rank {rank}: {_one_line(cause)}")
    return RankFailed(f"rank {rank} failed: {type(cause).__name__}: {_one_line(cause)} (rerun with --debug for its "
                      f"traceback)")


def _stop_servers(run, engines) -> None:
    """A server engine's actors stop the servers they started (a connected server is left running); the actors
    themselves end with the job."""
    import ray

    from reporting.run_log import log

    if not engines or not run.selection.rollout.server or run.rollout_url is not None:
        return
    try:
        ray.get([a.shutdown.remote() for a in engines], timeout=120)
    except Exception as exc:      # the run's result stands; say what may be left running
        log.warning(f"orchestrator: ray: stopping the rollout servers failed ({_one_line(exc)}); check the engine "
                    f"nodes for leftover sglang.launch_server processes")


class _PortTaken(Exception):
    """Rank 0's rendezvous port, picked free on its node, was bound by another process (a Ray worker's gRPC
    server, say) before rank 0 bound it; nothing ran yet, so the group starts again on a newly picked port."""


class _GroupDied(Exception):
    def __init__(self, rank: int, exc: BaseException, what: str = "died"):
        super().__init__(f"trainer rank {rank} {what} ({_one_line(exc)})")
        self.rank = rank


def run_on_ray(run, fn: Callable, *, model_config, model_source, mode: str, steps: int, run_dir, resume: bool, cfg,
               progress: bool, address: Optional[str], max_restarts: Optional[int]) -> Any:
    """Run ``fn(run, model_source, mode, steps, run_dir, resume, cfg, progress)`` (the trainer's rank entry
    point) on ``run.world`` trainer actors with their engines (built for ``model_config``); returns rank 0's
    result."""
    from train.checkpointing import latest_checkpoint
    from reporting.run_log import log

    try:
        import ray
    except ImportError:
        raise UserInputError("--orchestrator ray needs the `ray` package, which is not installed here. Fix: "
                             "pip install ray==2.60.0 (or `pip install '.[ray]'`), or use --orchestrator local"
                             ) from None
    restarts = DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts
    world = run.world
    plan = _plan(run, world)
    _connect(address, plan.cpus)
    engines: List[Any] = []
    try:
        groups = _placement_groups(plan)
        engines = _start_engines(run, model_config, cfg, run_dir, groups, plan, restarts) if mode == "grpo" else []
        placement = dict(max_restarts=restarts, colocated=run.rollout_num_gpus is None, model_parallel=run.tp * run.cp,
                         transport=run.weight_transport or "objects")
        log.info(f"orchestrator: ray: {world} trainer actor(s) in placement group "
                 f"{groups[plan.trainers[0][0]].id.hex()[:8]}")
        return _run_with_restarts(
            lambda attempt: _run_group(run, groups, plan, engines, placement, fn,
                                       (run, model_source, mode, steps, str(run_dir), resume or attempt > 0, cfg,
                                        progress), first_attempt=attempt == 0),
            restarts, lambda: latest_checkpoint(run_dir))
    finally:
        _stop_servers(run, engines)
        ray.shutdown()


def _run_with_restarts(run_group: Callable[[int], Any], restarts: int, latest: Callable[[], Any]) -> Any:
    """``run_group(attempt)`` until it returns: a group that died (:class:`_GroupDied`) starts again from the last
    checkpoint, ``restarts`` times at most (``attempt`` counts those); a group whose rendezvous port was taken
    (:class:`_PortTaken`) starts again at once on another, :data:`core.ports.PORT_ATTEMPTS` times in all."""
    from core.ports import PORT_ATTEMPTS
    from reporting.run_log import log

    attempt, port_tries = 0, 0
    while True:
        try:
            return run_group(attempt)
        except _PortTaken as taken:
            port_tries += 1
            if port_tries >= PORT_ATTEMPTS:
                raise RankFailed(f"{taken}, and so did the {PORT_ATTEMPTS - 1} port(s) picked before it. Fix: find "
                                 f"what binds ports on the trainers' first node so fast (`ss -ltnp`) and stop it, or "
                                 f"run again") from None
            log.warning(f"{taken}; starting the trainer group again on another free port (attempt "
                        f"{port_tries + 1} of {PORT_ATTEMPTS})")
        except _GroupDied as died:
            attempt += 1
            if attempt > restarts:
                raise RankFailed(f"{died} and the trainer group was restarted {restarts} times already "
                                 f"(--ray-max-restarts); the run's last complete checkpoint is kept: continue "
                                 f"with --resume") from None
            found = latest()
            log.warning(f"{died}; restarting the trainer group from "
                        f"{f'checkpoint step {found[0]}' if found else 'the start'} "
                        f"(restart {attempt} of {restarts})")
