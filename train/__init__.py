"""The trainer: the SFT / GRPO loop of one rank, its losses, optimizer, checkpoints, metrics and data (issue #7).

Entry points (wired into ``dsv4 train`` / ``dsv4 export`` / ``dsv4 plot`` by the launcher):

* :func:`train.trainer.train_rank` - one rank's SFT / GRPO loop (metrics, checkpoints, resume); the ranks are
  started by :func:`orchestration.run_training`, above this package.
* :func:`train.export.export_hf` - a run's last complete checkpoint -> an HF-format checkpoint.
* :func:`train.plot.plot_run` - PNG curves from ``RUN_DIR/metrics.jsonl``.

Modules: :mod:`.data` (JSONL data, built-in task, rewards, tokenization), :mod:`.model` (the
``TrainModel`` protocol and the adapters; ``build_train_model`` is where an implementation plugs in),
:mod:`.losses`, :mod:`.optim`, :mod:`.distributed` (the trainer's ranks), :mod:`.metrics`, :mod:`.run_log` (what a
run prints: configuration, step lines, progress, ``RUN_DIR/train.log``), :mod:`.checkpointing`. The rollout engines,
weight sync and routing replay are the rollout side's (:mod:`rollout`, below this package).

Importing this package imports nothing heavy; the functions below import lazily.
"""

from __future__ import annotations


def export_hf(*args, **kwargs):
    from .export import export_hf as _export

    return _export(*args, **kwargs)


def plot_run(*args, **kwargs):
    from .plot import plot_run as _plot

    return _plot(*args, **kwargs)


__all__ = ["export_hf", "plot_run"]
