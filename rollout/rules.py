"""The rollout side's rules of the combination table (``rollout-*``, ``async-rollout``), beside the engines they
guard.

Why here: where an engine runs, which servers it connects to, which published weights it loads and whether it may
generate beside the trainer are the rollout side's limits, so they live here and join the table through the plugin
hook ``dsv4_job_rules`` (:func:`core.combinations.table_rules`).
"""

from __future__ import annotations

from typing import Optional

from core.combinations import Rule, Selection, accepts, join_choices, layout_world, runnable_records
from core.hookspecs import hookimpl
from core.records import QUANT, ROLLOUT


def _rollout_hardware(sel: Selection, host) -> Optional[str]:
    engine = sel.rollout
    if engine is None or not engine.gpu or sel.hardware.gpu:
        return None
    if engine.server and sel.rollout_url is not None:
        return None  # the server runs elsewhere: nothing of the engine runs on this target
    options = [e.name for e in host.records(ROLLOUT) if not e.gpu and e.not_runnable is None]
    connect = f"connect to a running {engine.name} server with --rollout-url URL, " if engine.server else ""
    return (f"--rollout-engine {engine.name} needs a GPU (got --hardware {sel.hardware.name}). "
            f"Fix: use a GPU --hardware, {connect}or --rollout-engine {join_choices(options)}.")


def _rollout_url(sel: Selection, host) -> Optional[str]:
    """``--rollout-url`` names running servers: only a server engine connects to them, and each rollout engine (one
    per data-parallel rank of the trainer) pushes its weights into a server of its own: the local orchestrator's one
    engine into one URL, Ray's engine actors into one URL each (a comma-separated list, in engine order)."""
    engine, url = sel.rollout, sel.rollout_url
    if engine is None or url is None:
        return None
    if not engine.server:
        servers = [e.name for e in runnable_records(host, ROLLOUT) if e.server]
        fix = "drop --rollout-url" + (f", or use --rollout-engine {join_choices(servers)}" if servers else "")
        return (f"--rollout-engine {engine.name} runs in the trainer's process and cannot connect to --rollout-url "
                f"{url}. Fix: {fix}.")
    urls = len(url.split(","))
    mp = sel.tp * sel.cp
    world = layout_world(sel)
    if sel.orchestrator == "ray":
        if sel.job != "train" or world % mp or world // mp == urls:
            return None
        dp = world // mp
        return (f"--rollout-url lists {urls} server{'s' if urls > 1 else ''}, and --orchestrator ray starts {dp} "
                f"rollout engine actor{'s' if dp > 1 else ''} (one per data-parallel rank), each connecting to one "
                f"server of its own. Fix: give {dp} comma-separated URLs (http://HOST:PORT,...), or leave "
                f"--rollout-url out to start one server per engine actor (a GPU --hardware).")
    if urls > 1:
        return (f"--rollout-url lists {urls} servers, and --orchestrator {sel.orchestrator} connects its rollout "
                f"engine to one. Fix: give one URL, or use --orchestrator ray (one engine actor per URL).")
    if sel.job != "train" or world % mp or world // mp <= 1:
        return None
    ranks = f"{mp} rank{'s' if mp > 1 else ''}: --tp x --cp"
    return (f"--rollout-url {url} is one server, and the run's {world // mp} data-parallel ranks each own a rollout "
            f"engine (each would push its weights into it). Fix: run one data-parallel rank ({ranks}), use "
            f"--orchestrator ray with one URL per data-parallel rank, or leave --rollout-url out to start one "
            f"server per data-parallel rank.")


def _rollout_publish(sel: Selection, host) -> Optional[str]:
    engine, fmt = sel.rollout, sel.quant.publish_format
    if engine is None or accepts(engine.publish_formats, fmt):
        return None
    options = [q.name for q in host.records(QUANT) if accepts(engine.publish_formats, q.publish_format)]
    return (f"--rollout-engine {engine.name} loads {join_choices(engine.publish_formats)} weights, and --quant "
            f"{sel.quant.name} publishes {fmt}. Fix: choose --quant {join_choices(options)}, or another --rollout-engine.")


def _async_rollout(sel: Selection, host) -> Optional[str]:
    """``async_rollout`` generates while the trainer trains. Under Ray the engine is an actor of its own and a server
    engine is a process of its own; under the local orchestrator an in-process engine runs in a thread of the
    trainer's process, which is safe and overlaps on the CPU, but on a GPU it would share the trainer's CUDA stream
    (no overlap of device work) and capture its decode CUDA graphs next to training (not safe)."""
    engine = sel.rollout
    if not sel.async_rollout or sel.orchestrator != "local" or engine is None or engine.server or not sel.hardware.gpu:
        return None
    servers = [e.name for e in runnable_records(host, ROLLOUT) if e.server] if host is not None else []
    fix = f", --rollout-engine {join_choices(servers)} (a server process)" if servers else ""
    return (f"async_rollout=true with --orchestrator local runs --rollout-engine {engine.name} in a thread of the "
            f"trainer's process: on --hardware {sel.hardware.name} it would share the trainer's CUDA stream (no "
            f"overlap) and capture CUDA graphs next to training. Fix: use --orchestrator ray (each engine in an actor "
            f"of its own){fix}, or drop async_rollout.")


RULES = (
    Rule("rollout-hardware", "the rollout engine runs on the hardware target (a server at --rollout-url runs "
         "elsewhere)", _rollout_hardware),
    Rule("rollout-url", "--rollout-url names a server engine's servers, one per rollout engine (data-parallel rank)",
         _rollout_url),
    Rule("rollout-publish-format", "the rollout engine loads the scheme's published weights", _rollout_publish),
    Rule("async-rollout", "async_rollout=true on a GPU runs the engine in an actor or a server, not in the trainer's "
         "process", _async_rollout, train_option=True),
)


@hookimpl
def dsv4_job_rules():
    return list(RULES)
