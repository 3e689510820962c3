"""``dsv4 plot RUN_DIR``: PNG curves from ``RUN_DIR/metrics.jsonl``.

Writes ``RUN_DIR/plots/<metric>.png`` for reward, loss, logprob diff, KL and tokens/s (a metric with no
finite value, e.g. the reward of an SFT run, gets no file) and ``RUN_DIR/plots/summary.png`` with all of
them. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

from .metrics import read_metrics

CURVES = (
    ("reward_mean", "reward (mean)"),
    ("loss", "loss"),
    ("train_rollout_logprob_abs_diff", "|logp train - logp rollout|"),
    ("train_rollout_kl", "KL(rollout || train), k3"),
    ("tokens_per_s", "tokens / s"),
)


def _series(rows: List[Dict], key: str):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir, out_dir: Optional[str] = None) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = read_metrics(run)
    if not rows:
        raise FileNotFoundError(f"{run}: no metrics.jsonl rows to plot")
    out = Path(out_dir) if out_dir else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    present = [(k, t) for k, t in CURVES if _series(rows, k)[0]]
    for key, title in present:
        xs, ys = _series(rows, key)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out / f"{key}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    n = len(present)
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.4 * n), squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], present):
        xs, ys = _series(rows, key)
        ax.plot(xs, ys)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(str(run.name))
    fig.tight_layout()
    p = out / "summary.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)
    return written
