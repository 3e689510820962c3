"""Where a training run's ranks run (``dsv4 train``): this process, local workers, or Ray actors.

Why here: starting ranks and engines is the orchestration side's work, and the trainer (:mod:`train.trainer`)
sits below it: it runs one rank in process groups already joined (:func:`train.trainer.train_rank`) and never
imports a launcher. :func:`run_training` picks the launcher for the run's orchestrator and layout; every launcher
runs the same rank entry point, :func:`_rank_main`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Optional

from train.config_checks import check_mode, check_train_options
from train.distributed import check_divisible, check_virtual_stages
from orchestration.run_claim import claimed_run_folder
from train.trainer import TrainConfig, resolve_model_config, train_rank

__all__ = ["run_training"]


def run_training(run_config, model_source, *, mode: str, steps: int, run_dir, resume: bool = False,
                 config: Optional[TrainConfig] = None, progress: bool = True, ray_address: Optional[str] = None,
                 ray_max_restarts: Optional[int] = None, **overrides) -> Dict[str, Any]:
    """Train for ``steps`` steps (in total, counting the steps of a resumed run).

    ``run_config``: the run's :class:`core.run_config.RunConfig` (``core.run_config.normalize``); ``model_source``: an HF-format
    checkpoint folder, a preset name (random init) or a ModelConfig; ``mode``: "sft" | "grpo";
    ``config``: a :class:`train.trainer.TrainConfig`, with ``overrides`` (field=value) applied on top. Returns a
    dict with the run folder, the start step and the last metrics row.

    Ranks (:mod:`orchestration.launch`): inside torchrun / srun (torch.distributed's environment) this process is
    one rank of ``run_config.world``; otherwise a run of several ranks starts them here as local workers through
    torch.distributed's elastic launcher and returns rank 0's result. ``run_config.orchestrator == "ray"``: the
    ranks and rollout engines are actors on the Ray cluster at ``ray_address`` (:mod:`orchestration.ray_launch`).
    """
    from reporting.trackers import check_available

    from .launch import joined_ranks, launch_local_ranks

    if run_config is None:
        raise TypeError("run_training needs the run's configuration (a core.run_config.RunConfig: "
                        "core.run_config.normalize)")
    cfg = dataclasses.replace(config or TrainConfig(), **overrides)
    check_available(cfg.tracker)                   # a tracker's missing library: one line, before any work
    check_mode(mode, cfg)
    check_divisible(run_config, mode, cfg)         # before any rank starts
    check_virtual_stages(run_config, mode, cfg)
    check_train_options(run_config, cfg)
    # one writer per run folder (orchestration.run_claim: lock, resume checks); a failed start leaves no run folder
    with claimed_run_folder(run_dir, resume=resume, steps=steps):
        if run_config.orchestrator == "ray":
            from .ray_launch import run_on_ray

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            return run_on_ray(run_config, _rank_main, model_config=resolve_model_config(run_config, model_source)[0],
                              model_source=model_source, mode=mode, steps=steps,
                              run_dir=run_dir, resume=resume, cfg=cfg, progress=progress, address=ray_address,
                              max_restarts=ray_max_restarts)
        if run_config.world > 1 and not joined_ranks():
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            return launch_local_ranks(run_config, _rank_main, (run_config, model_source, mode, steps, str(run_dir),
                                                               resume, cfg, progress))
        return _rank_main(run_config, model_source, mode, steps, run_dir, resume, cfg, progress)


def _rank_main(run_config, model_source, mode, steps, run_dir, resume, cfg, progress) -> Dict[str, Any]:
    """One rank's run: join the run's process groups (torchrun's environment; one rank: the one-rank layout),
    train in that layout. Under ``--orchestrator
    ray`` the rank's rollout engine is its engine actor's proxy (:func:`orchestration.ray_engines.rank_engine`)."""
    from core.assembly import assemble
    from engine.layout import SINGLE, interleave

    from .launch import init_rank

    parts = assemble(run_config)                 # the rank's handles, made once and passed down
    engine_source, layout = None, SINGLE
    if run_config.world > 1:
        init_rank(run_config, parts, rendezvous_timeout_s=cfg.rendezvous_timeout_s)
        layout = interleave(run_config.vpp)      # --vpp: model chunks per pipeline rank (engine.pipeline)
    if run_config.orchestrator == "ray":
        from .ray_engines import rank_engine

        engine_source = rank_engine
    return train_rank(run_config, model_source, mode, steps, run_dir, resume, cfg, progress, layout=layout,
                      engine_source=engine_source, parts=parts)
