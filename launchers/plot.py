"""``dsv4 plot RUN_DIR``: PNG curves from ``RUN_DIR/metrics.jsonl``.

Writes ``RUN_DIR/plots/<metric>.png`` for each of :data:`CURVES` (reward, loss, gradient norm, learning
rate, train/rollout log-prob difference and KL, the rollout policy's entropy, the fraction of GRPO groups
with all-equal rewards, tokens/s; a metric with no finite value, e.g. the reward of an SFT run, gets no file),
``RUN_DIR/plots/phase_times.png`` (seconds per step in each phase, :data:`PHASES`) and
``RUN_DIR/plots/summary.png`` with all of them as panels. Every axis is labelled with its unit; with
``smoothing`` > 0 each curve is drawn raw (faint) and as TensorBoard's debiased exponential moving average
(``smoothing`` is the EMA's weight of the past, 0 <= s < 1). Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from reporting.metrics import read_metrics

# (metrics key, title, y-axis label with its unit)
CURVES = (
    ("reward_mean", "reward (mean over samples)", "reward (task score)"),
    ("loss", "loss", "loss (per response token)"),
    ("grad_norm", "gradient norm (before clipping)", "L2 norm"),
    ("lr", "learning rate", "learning rate (per step)"),
    ("train_rollout_logprob_abs_diff", "|logp train - logp rollout|", "nats / token"),
    ("train_rollout_kl", "KL(rollout || train), k3", "nats / token"),
    ("rollout_entropy", "policy entropy (sampled tokens' mean -log p)", "nats / token"),
    ("zero_variance_group_frac", "GRPO groups with all-equal rewards (no gradient)", "fraction of groups"),
    ("tokens_per_s", "throughput", "tokens / s"),
)
# (metrics key, legend label): the phases of a step, in seconds
PHASES = (
    ("time_update_weights", "update weights"),
    ("time_rollout", "rollout"),
    ("time_logprobs", "logprobs"),
    ("time_train", "train"),
    ("time_step", "whole step"),
)
DEFAULT_SMOOTHING = 0.6
STEP_LABEL = "step (optimizer steps)"


def _series(rows: List[Dict], key: str):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def ema(ys: Sequence[float], smoothing: float) -> List[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so it starts at the first value."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    out, last = [], 0.0
    for n, y in enumerate(ys, start=1):
        last = last * smoothing + (1 - smoothing) * y
        out.append(last / (1 - smoothing ** n))
    return out


def _draw(ax, xs, ys, smoothing: float, label: Optional[str] = None, **style) -> None:
    if smoothing > 0 and len(ys) > 2:
        (raw,) = ax.plot(xs, ys, alpha=0.3, linewidth=1, **style)
        ax.plot(xs, ema(ys, smoothing), color=raw.get_color(), label=label, **style)
    else:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label, **style)


def _axes(ax, title: str, ylabel: str, fontsize=None) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=fontsize)
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
    ax.grid(alpha=0.3)


def _curve_panel(ax, rows, key: str, title: str, ylabel: str, smoothing: float, fontsize=None) -> None:
    xs, ys = _series(rows, key)
    _draw(ax, xs, ys, smoothing)
    _axes(ax, title, ylabel, fontsize)


def _phase_panel(ax, rows, smoothing: float, fontsize=None) -> None:
    for key, label in PHASES:
        xs, ys = _series(rows, key)
        if xs:
            _draw(ax, xs, ys, smoothing, label=label, **({"linestyle": "--"} if key == "time_step" else {}))
    _axes(ax, "time per phase", "seconds", fontsize)
    ax.legend(fontsize="small")


def figures(rows: List[Dict], *, smoothing: float = DEFAULT_SMOOTHING, title: str = "") -> Dict[str, object]:
    """File stem -> matplotlib Figure for ``rows`` (metrics.jsonl rows); the caller closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ema([], smoothing)  # range check
    present = [c for c in CURVES if _series(rows, c[0])[0]]
    phases = any(_series(rows, k)[0] for k, _ in PHASES)
    figs = {}
    for key, name, ylabel in present:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        _curve_panel(ax, rows, key, name, ylabel, smoothing)
        fig.tight_layout()
        figs[key] = fig
    if phases:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        _phase_panel(ax, rows, smoothing)
        fig.tight_layout()
        figs["phase_times"] = fig
    n = len(present) + int(phases)
    cols = 2 if n > 1 else 1
    nrows = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 2.8 * nrows), squeeze=False)
    panels = list(axes.flat)
    for ax, (key, name, ylabel) in zip(panels, present):
        _curve_panel(ax, rows, key, name, ylabel, smoothing, fontsize=10)
    if phases:
        _phase_panel(panels[len(present)], rows, smoothing, fontsize=10)
    for ax in panels[n:]:
        ax.set_visible(False)
    fig.suptitle(title + (f" (smoothing {smoothing:g})" if smoothing else ""))
    fig.tight_layout()
    figs["summary"] = fig
    return figs


def plot_run(run_dir, out_dir: Optional[str] = None, smoothing: float = DEFAULT_SMOOTHING) -> List[Path]:
    run = Path(run_dir)
    rows = read_metrics(run)
    if not rows:
        raise FileNotFoundError(f"{run}: no metrics.jsonl rows to plot")
    out = Path(out_dir) if out_dir else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    figs = figures(rows, smoothing=smoothing, title=run.name)
    import matplotlib.pyplot as plt

    written = []
    for stem, fig in figs.items():
        p = out / f"{stem}.png"
        fig.savefig(p, dpi=90 if stem == "summary" else 100)
        plt.close(fig)
        written.append(p)
    return written
