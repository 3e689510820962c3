"""What a run reports: the lines it prints and its log file, and the trackers its metrics go to.

* :mod:`.run_log` - the ``dsv4`` logger, the console (``-q`` / ``-v``), ``RUN_DIR/train.log``, the progress bar, the
  resolved configuration and the step line.
* :mod:`.trackers` - where each step's scalars go besides ``metrics.jsonl``: TensorBoard, wandb, MLflow.
* :mod:`.profiling` - ``profile_steps``: where a training step's time goes (``RUN_DIR/profile/budget.json``).

Why a package of its own: the trainer, the rollout side, the orchestrators and the launcher all print through the
one logger, so it sits low (it imports only ``core``) and each of them may use it. ``metrics.jsonl`` itself is the
trainer's (:mod:`train.metrics`); the plots of a run are the launcher's (:mod:`launchers.plot`).
"""
