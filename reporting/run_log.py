"""What a run tells its user: the console, ``RUN_DIR/train.log`` and the progress bar (issue #21, item 7).

Why: ``dsv4 train`` did not print the configuration it resolved, its progress bar had no time left,
rich markup swallowed the ``[rollout ... sync ...]`` phase timings of the step line, and nothing of the
run was kept once the terminal was gone.

* :data:`log` (``logging.getLogger("dsv4")``) carries every line a run prints. :func:`configure_console`
  (the launcher's ``-q`` / ``-v``) decides what reaches stderr; a run that shows progress and finds no
  console handler adds one at INFO (a library caller, rank 0 of a ``--cp N`` run).
* :func:`file_log` copies the same lines, time-stamped, to ``RUN_DIR/train.log`` while the run is in
  progress (appended to on resume). A failure is written there too, on the file only: the launcher
  prints its own ``error:`` line.
* :func:`step_progress` is the progress bar, with seconds per step and the time left; its
  :meth:`StepProgress.step` logs the step line, which carries both as well (a log file has no bar).
* :func:`config_lines` is the resolved configuration, compact, printed at every start.

Lines are printed without rich markup, so brackets show as written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from rich.console import Console
from rich.progress import ProgressColumn
from rich.text import Text

__all__ = ["LOG_FILE", "log", "console", "configure_console", "file_log", "step_progress", "StepProgress",
           "config_lines", "step_line"]

LOG_FILE = "train.log"
log = logging.getLogger("dsv4")
log.setLevel(logging.DEBUG)          # the handlers decide what they show
# shared by the progress bar and the console handler (no torn lines); pipes and CI logs get a wide console
console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
_RATE_WINDOW = 10                    # steps the seconds-per-step estimate averages over


class _ConsoleHandler(logging.Handler):
    """Prints records on :data:`console`, without markup; warnings and errors say so first."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"{record.levelname.lower()}: {text}"
            console.print(text, markup=False, highlight=False, soft_wrap=True)
        except Exception:
            self.handleError(record)


def _console_handler() -> Optional[_ConsoleHandler]:
    return next((h for h in log.handlers if isinstance(h, _ConsoleHandler)), None)


def configure_console(level: int) -> None:
    """Show records of ``level`` and above on stderr (the launcher: ERROR for ``-q``, DEBUG for ``-v``)."""
    handler = _console_handler()
    if handler is None:
        handler = _ConsoleHandler()
        log.addHandler(handler)
        log.propagate = False        # the run's lines are printed once, here, whatever the root logger has
    handler.setLevel(level)


def _ensure_console() -> None:
    if _console_handler() is None:
        configure_console(logging.INFO)


def _console_level() -> int:
    handler = _console_handler()
    return logging.INFO if handler is None else handler.level


@contextlib.contextmanager
def file_log(run_dir) -> Iterator[Path]:
    """Append the run's lines to ``RUN_DIR/train.log`` inside the block (DEBUG ones too under ``-v``)."""
    path = Path(run_dir) / LOG_FILE
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%Y-%m-%d %H:%M:%S"))
    handler.setLevel(min(logging.INFO, _console_level()))
    log.addHandler(handler)
    try:
        yield path
    except BaseException as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0,
                                      f"run failed: {type(exc).__name__}: {first}", None, None))
        raise
    finally:
        log.removeHandler(handler)
        handler.close()


def _clock(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        sps = task.fields.get("s_per_step")
        return Text("-.-- s/step" if sps is None else f"{sps:.2f} s/step", style="progress.data.speed")


class _EtaColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"ETA {_clock(task.fields.get('eta'))}", style="progress.remaining")


def step_line(row: Dict[str, Any], total: int, s_per_step: float, left: float) -> str:
    """The per-step console / log line: the metrics, the phase timings, seconds per step and time left."""
    return f"{summary_line(row, total)}  {s_per_step:.2f} s/step  ETA {_clock(left)}"


class StepProgress:
    """Counts steps: :meth:`step` logs the step line and moves the bar (if one is shown)."""

    def __init__(self, total: int, progress=None, task=None):
        self.total, self._progress, self._task = total, progress, task
        self._times: List[float] = []

    def seconds_per_step(self) -> float:
        """Mean of the last steps of this invocation; its first step (warm-up, compilation) counts only
        while it is the only one."""
        times = self._times[1:] if len(self._times) > 1 else self._times
        recent = times[-_RATE_WINDOW:]
        return sum(recent) / len(recent)

    def step(self, row: Dict[str, Any]) -> None:
        self._times.append(float(row["time_step"]))
        sps = self.seconds_per_step()
        left = max(0, self.total - int(row["step"])) * sps
        log.info(step_line(row, self.total, sps, left))
        if self._progress is not None:
            self._progress.update(self._task, advance=1, s_per_step=sps, eta=left)


@contextlib.contextmanager
def step_progress(description: str, total: int, completed: int, enabled: bool = True) -> Iterator[StepProgress]:
    """A progress bar over ``total`` steps (``completed`` already done), when ``enabled``."""
    if not enabled:
        yield StepProgress(total)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _ensure_console()
    with Progress(TextColumn("{task.description}", style="bold", markup=False), BarColumn(bar_width=30),
                  MofNCompleteColumn(),
                  TimeElapsedColumn(), _RateColumn(), _EtaColumn(), console=console, transient=False,
                  disable=_console_level() > logging.INFO) as prog:
        task = prog.add_task(description, total=total, completed=completed, s_per_step=None, eta=None)
        yield StepProgress(total, prog, task)


def _value(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _pairs(d: Dict[str, Any]) -> str:
    return " ".join(f"{k}={_value(v)}" for k, v in d.items())


def config_lines(run_config, cfg, *, mode: str, steps: int, start_step: int, run_dir, source: str) -> List[str]:
    """The resolved configuration as three compact lines: the run's choices, the job, every TrainConfig
    field (the keys `dsv4 train --config` / ``KEY=VALUE`` take)."""
    lines = []
    if run_config is not None:
        choices = {k: v for k, v in run_config.as_dict().items() if k not in ("providers", "job", "model_name")}
        lines.append(f"config: run   {_pairs({**choices, 'model': run_config.model_name})}")
    lines.append(f"config: job   {_pairs(dict(mode=mode, steps=steps, start_step=start_step, run_dir=run_dir))} "
                 f"model_source={source}")
    lines.append(f"config: train {_pairs({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})}")
    return lines


def summary_line(row: Dict, total_steps: int) -> str:
    """The step line's metrics: loss, reward, the rollout-vs-train diagnostics, throughput, phase timings."""
    def f(k, fmt="{:.4g}"):
        v = row.get(k)
        return "-" if v is None else fmt.format(v)

    zero_var = row.get("zero_variance_group_frac")
    flat = ""
    if zero_var is not None:
        flat = f"zero-var groups {zero_var:.0%}  "
        if zero_var >= 1.0:
            flat += "(no learning signal: every group's rewards are equal)  "
    return (f"step {row['step']}/{total_steps}  loss {f('loss')}  reward {f('reward_mean')}  {flat}"
            f"|lp diff| {f('train_rollout_logprob_abs_diff', '{:.2e}')}  kl {f('train_rollout_kl', '{:.2e}')}  "
            f"gnorm {f('grad_norm')}  tok/s {f('tokens_per_s', '{:.0f}')}  "
            f"[rollout {f('time_rollout', '{:.2f}')}s logprobs {f('time_logprobs', '{:.2f}')}s "
            f"train {f('time_train', '{:.2f}')}s sync {f('time_update_weights', '{:.2f}')}s]")
