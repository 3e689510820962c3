"""Ray's rules of the combination table (``orchestrator-*``, placement, weight transports, ``ray-colocate``),
beside the launcher they guard.

Why here: how engine actors are placed and how weights reach them are ``--orchestrator ray``'s limits
(:mod:`orchestration.ray_launch`, :mod:`orchestration.ray_transport`), so they live here and join the table through
the plugin hook ``dsv4_job_rules`` (:func:`core.combinations.table_rules`).
"""

from __future__ import annotations

from typing import Optional

from core.combinations import (GPU_WEIGHT_TRANSPORTS, HOST_WEIGHT_TRANSPORTS, Rule, Selection, join_choices,
                               join_ordered, layout_world, runnable_records)
from core.hookspecs import hookimpl
from core.records import ROLLOUT


def _orchestrator_options(sel: Selection, host) -> Optional[str]:
    """The placement and transport options describe Ray actors: the local orchestrator has none."""
    given = [opt for opt, value in (("--rollout-num-gpus", sel.rollout_num_gpus),
                                    ("--rollout-num-nodes", sel.rollout_num_nodes),
                                    ("--weight-transport", sel.weight_transport)) if value is not None]
    if sel.orchestrator == "ray" or not given:
        return None
    return (f"{' and '.join(given)} place{'s' if len(given) == 1 else ''} the run's Ray actors, and "
            f"--orchestrator {sel.orchestrator} starts none. Fix: add --orchestrator ray, or drop "
            f"{' and '.join(given)}.")


def _orchestrator_rollout(sel: Selection, host) -> Optional[str]:
    """Under Ray a server engine's actor forwards each bucket to its server through the server's update API (host
    tensors over HTTP): the object store hands the actor the bucket, and the re-sync of a restarted actor comes from
    the refs the proxy keeps. The direct transports feed an in-process engine's device memory and keep no copy."""
    engine, transport = sel.rollout, sel.weight_transport
    if sel.orchestrator != "ray" or engine is None or not engine.server or transport in (None, "objects"):
        return None
    inproc = [e.name for e in runnable_records(host, ROLLOUT) if not e.server]
    return (f"--weight-transport {transport} feeds an engine that runs inside its actor, and --rollout-engine "
            f"{engine.name} is a server the actor forwards each bucket to (its update API, host tensors over HTTP). "
            f"Fix: use --weight-transport objects (the default), or --rollout-engine {join_choices(inproc)}.")


def _rollout_num_gpus(sel: Selection, host) -> Optional[str]:
    """Disaggregated: each data-parallel leader owns one engine, each engine one device of its own."""
    if sel.orchestrator != "ray" or sel.rollout_num_gpus is None or sel.job != "train":
        return None
    world = layout_world(sel)
    mp = sel.tp * sel.cp
    if world % mp:
        return None   # (train-layout names that)
    dp = world // mp
    if sel.rollout_num_gpus == dp:
        return None
    return (f"--rollout-num-gpus {sel.rollout_num_gpus}: each of the run's {dp} data-parallel ranks owns one rollout "
            f"engine on a device of its own. Fix: use --rollout-num-gpus {dp}, or leave it out to colocate the "
            f"engines with the trainer's ranks.")


def _rollout_num_nodes(sel: Selection, host) -> Optional[str]:
    """The engines' devices spread evenly over the nodes: each node holds ``--rollout-num-gpus / nodes``."""
    nodes = sel.rollout_num_nodes
    if sel.orchestrator != "ray" or nodes is None:
        return None
    if sel.rollout_num_gpus is None:
        return (f"--rollout-num-nodes {nodes} spreads the engines' own devices over nodes, and without "
                f"--rollout-num-gpus the engines share the trainer's devices. Fix: add --rollout-num-gpus N (a "
                f"multiple of {nodes}), or drop --rollout-num-nodes.")
    if sel.rollout_num_gpus % nodes == 0:
        return None
    fits = [str(d) for d in range(1, sel.rollout_num_gpus + 1) if sel.rollout_num_gpus % d == 0]
    return (f"--rollout-num-nodes {nodes} does not divide --rollout-num-gpus {sel.rollout_num_gpus} (each node "
            f"holds the same number of engines). Fix: use --rollout-num-nodes {join_ordered(fits)}.")


def _weight_transport(sel: Selection, host) -> Optional[str]:
    """A transport moves the tensors of one kind of device: CUDA IPC and NCCL GPU memory, gloo host memory (the
    CLI names the backend that runs, so a CPU run never claims NCCL)."""
    transport, hw = sel.weight_transport, sel.hardware.name
    if transport in GPU_WEIGHT_TRANSPORTS and not sel.hardware.gpu:
        return (f"--weight-transport {transport} moves CUDA tensors (got --hardware {hw}). Fix: use "
                f"--weight-transport gloo (the same broadcast over host memory) or objects (Ray's object store), "
                f"or a GPU --hardware.")
    if transport in HOST_WEIGHT_TRANSPORTS and sel.hardware.gpu:
        return (f"--weight-transport {transport} broadcasts host tensors, and --hardware {hw} keeps the weights on "
                f"GPUs. Fix: use --weight-transport nccl (with --rollout-num-gpus) or cuda-ipc (colocated), or "
                f"objects.")
    return None


def _weight_transport_placement(sel: Selection, host) -> Optional[str]:
    """NCCL joins one rank per GPU, so an engine that shares its leader's GPU cannot be its peer; CUDA IPC
    opens memory of the same GPU only."""
    if sel.orchestrator != "ray" or not sel.hardware.gpu:
        return None
    if sel.weight_transport == "nccl" and sel.rollout_num_gpus is None:
        return ("--weight-transport nccl joins the trainer and each engine as NCCL ranks of their own GPUs, and "
                "colocated engines share their trainer rank's GPU (NCCL refuses two ranks on one GPU). Fix: use "
                "--weight-transport cuda-ipc, or give the engines GPUs of their own with --rollout-num-gpus N.")
    if sel.weight_transport == "cuda-ipc" and sel.rollout_num_gpus is not None:
        return (f"--weight-transport cuda-ipc hands each engine the trainer's GPU memory, and --rollout-num-gpus "
                f"{sel.rollout_num_gpus} puts the engines on GPUs of their own. Fix: use --weight-transport nccl, "
                f"or drop --rollout-num-gpus to colocate the engines.")
    return None


def _ray_colocate(sel: Selection, host) -> Optional[str]:
    """``colocate`` frees an engine's memory for the trainer on a shared device; disaggregated engines share
    none."""
    if not (sel.colocate and sel.orchestrator == "ray" and sel.rollout_num_gpus is not None):
        return None
    return (f"colocate=true releases each engine's memory for the trainer ranks it shares a device with, and "
            f"--rollout-num-gpus {sel.rollout_num_gpus} gives the engines devices of their own. Fix: drop "
            f"colocate=true, or drop --rollout-num-gpus (engines colocated with the trainer).")


RULES = (
    Rule("orchestrator-options", "Ray placement and transport options come with --orchestrator ray",
         _orchestrator_options),
    Rule("orchestrator-rollout", "under --orchestrator ray a server engine's actor gets its weights through the "
         "object store", _orchestrator_rollout),
    Rule("rollout-num-gpus", "disaggregated engines: one device per data-parallel rank", _rollout_num_gpus),
    Rule("rollout-num-nodes", "the engines' devices spread evenly over --rollout-num-nodes nodes", _rollout_num_nodes),
    Rule("weight-transport-hardware", "nccl and cuda-ipc need a GPU --hardware, gloo the CPU", _weight_transport),
    Rule("weight-transport-placement", "nccl needs engines on GPUs of their own, cuda-ipc on their trainer rank's GPU",
         _weight_transport_placement),
    Rule("ray-colocate", "colocate=true releases memory on a shared device, not with --rollout-num-gpus",
         _ray_colocate, train_option=True),
)


@hookimpl
def dsv4_job_rules():
    return list(RULES)
