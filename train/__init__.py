"""The trainer: the SFT / GRPO loop of one rank, its losses, optimizer, checkpoints, metrics and data (issue #7).

Entry points (wired into ``dsv4 train`` / ``dsv4 export`` by the launcher):

* :func:`train.trainer.train_rank` - one rank's SFT / GRPO loop (metrics, checkpoints, resume); the ranks are
  started by :func:`orchestration.run_training`, above this package.
* :func:`train.export.export_hf` - a run's last complete checkpoint -> an HF-format checkpoint.

Modules: :mod:`.data` (JSONL data, built-in task, rewards, tokenization), :mod:`.model` (the
``TrainModel`` protocol and the adapters; ``build_train_model`` is where an implementation plugs in),
:mod:`.losses`, :mod:`.optim`, :mod:`.distributed` (the trainer's ranks), :mod:`.metrics` (``metrics.jsonl``),
:mod:`.checkpointing`, :mod:`.run_folder` (where a run starts, resume), :mod:`.sft` and :mod:`.grpo` (the steps).
What a run prints and its trackers are :mod:`reporting`'s. The rollout engines,
weight sync and routing replay are the rollout side's (:mod:`rollout`, below this package).

Importing this package imports nothing heavy; the functions below import lazily.
"""

from __future__ import annotations


def export_hf(*args, **kwargs):
    from .export import export_hf as _export

    return _export(*args, **kwargs)


__all__ = ["export_hf"]
