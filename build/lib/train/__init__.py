"""DeepSeek-V4 training loop: SFT and GRPO with a pluggable rollout engine (issue #7).

Entry points (wired into ``dsv4 train`` / ``dsv4 export`` / ``dsv4 plot`` by the launcher):

* :func:`train.trainer.run_training` - the SFT / GRPO loop (metrics, checkpoints, resume).
* :func:`train.export.export_hf` - a run's last complete checkpoint -> an HF-format checkpoint.
* :func:`train.plot.plot_run` - PNG curves from ``RUN_DIR/metrics.jsonl``.

Modules: :mod:`.data` (JSONL data, built-in task, rewards, tokenization), :mod:`.model` (the
``TrainModel`` protocol and the adapters; ``build_train_model`` is where an implementation plugs in),
:mod:`.engines` (rollout-engine protocol + the built-in reference engine), :mod:`.sglang_engine`
(SGLang server adapter), :mod:`.weight_sync`, :mod:`.losses`, :mod:`.replay` (routing replay R3 and the
indexer-replay seam), :mod:`.metrics`, :mod:`.run_log` (what a run prints: configuration, step lines, progress,
``RUN_DIR/train.log``), :mod:`.checkpointing`.

Importing this package imports nothing heavy; the functions below import lazily.
"""

from __future__ import annotations


def run_training(*args, **kwargs):
    from .trainer import run_training as _run

    return _run(*args, **kwargs)


def export_hf(*args, **kwargs):
    from .export import export_hf as _export

    return _export(*args, **kwargs)


def plot_run(*args, **kwargs):
    from .plot import plot_run as _plot

    return _plot(*args, **kwargs)


__all__ = ["run_training", "export_hf", "plot_run"]
