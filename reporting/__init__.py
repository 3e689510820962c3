"""What a run reports: the lines it prints and its log file, and the trackers its metrics go to.

* :mod:`.run_log` - the ``dsv4`` logger, the console (``-q`` / ``-v``), ``RUN_DIR/train.log``, the progress bar, the
  resolved configuration and the step line.
* :mod:`.trackers` - where each step's scalars go besides ``metrics.jsonl``: TensorBoard, wandb, MLflow.
* :mod:`.profiling` - ``profile_steps``: where a training step's time goes (``RUN_DIR/profile/budget.json``).
* :mod:`.metrics` - ``RUN_DIR/metrics.jsonl``: the trainer writes a row per step, resume truncates it, the plots
  and benchmarks read it.

Why a package of its own: the trainer, the rollout side, the orchestrators and the launcher all print through the
one logger, so it sits low (it imports only ``core``) and each of them may use it. The plots of a run are the
launcher's (:mod:`launchers.plot`).
"""
