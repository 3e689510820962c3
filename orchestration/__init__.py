"""The orchestration side: who starts a run's ranks and rollout engines, and how weights reach remote engines.

* :mod:`.training` - :func:`run_training`, the entry point of ``dsv4 train``: this process, local workers or Ray.
* :mod:`.launch` - joining torchrun's ranks, or starting local ranks through torch.distributed's elastic launcher;
  :mod:`.local_workers` - how those ranks start on the run's hardware target (forked from a preloaded server on
  the CPU, spawned on GPUs).
* :mod:`.ray_launch`, :mod:`.ray_engines`, :mod:`.ray_transport` - ``--orchestrator ray``: trainer and engine
  actors, the engine proxy a trainer rank talks to, the direct weight transports (docs/ray.md).
* :mod:`.rules` - the combination table's Ray rules.

It sits above the trainer (:mod:`train`) and the rollout side (:mod:`rollout`): it may import both, and neither
imports it. Importing this package imports nothing heavy.
"""

from __future__ import annotations


def run_training(*args, **kwargs):
    from .training import run_training as _run

    return _run(*args, **kwargs)


__all__ = ["run_training"]
