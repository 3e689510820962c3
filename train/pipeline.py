"""The trainer's micro-batches under pipeline parallelism (``--pp P``): what each stage runs and where the results
go. megatron-core's 1F1B schedule drives them (:func:`engine.pipeline.run_schedule`); the steps
(:mod:`train.sft`, :mod:`train.grpo`) keep their loss code and call :func:`run_items` / :func:`forward_items`
instead of their own loop when the layout has more than one stage.

Why a module of its own: the loss runs on the last stage only, so each step's running sums (``acc``) are filled
there and then broadcast to the other stages (:func:`engine.pipeline.from_last_stage`); each stage records the
routing of the layers it holds, merged over the stages for the replay check.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from engine.layout import current
from engine.pipeline import from_last_stage, gather_over_stages, run_schedule

from .model import TrainForward


def pipelined() -> bool:
    """Whether this rank is one stage of several."""
    return current().pp > 1


def _schedule(run, items: List[dict], forward_kw: Callable, loss: Callable, forward_only: bool) -> Dict[int, dict]:
    """Run ``items`` through the stages; ``loss(k, item, fwd)`` on the last stage. Returns every micro-batch's
    routing, merged over the stages (``{k: {layer: idx}}``)."""
    c, used = run.model.config, {}

    def stage(mb, streams):
        k, it = mb
        out, used[k] = run.model.forward_stage(it["ids"], streams, **forward_kw(it))
        return out

    run_schedule(list(enumerate(items)), [tuple(it["ids"].shape) for it in items], c.hc_mult * c.dim, stage,
                 lambda mb, fwd: loss(mb[0], mb[1], fwd), forward_only=forward_only)
    merged: Dict[int, dict] = {k: {} for k in range(len(items))}
    for part in gather_over_stages(used, current()):
        for k, layers in part.items():
            merged[k].update(layers)
    return merged


def run_items(run, items: List[dict], forward_kw: Callable, loss: Callable, acc: Dict[str, float]) -> None:
    """Forward and backward of every micro-batch; ``loss(item, fwd)`` adds to ``acc`` on the last stage, whose
    sums every stage then takes (in place)."""
    _schedule(run, items, forward_kw, lambda k, it, fwd: loss(it, fwd), forward_only=False)
    acc.update(from_last_stage(dict(acc), current()))


def forward_items(run, items: List[dict], forward_kw: Callable) -> List[TrainForward]:
    """Every micro-batch's forward without gradients, its log-probs on every stage and its routing over every
    layer."""
    lps: Dict[int, torch.Tensor] = {}

    def keep(k, it, fwd):
        lps[k] = fwd.logprobs.detach()
        return fwd.logprobs.sum() * 0

    with torch.no_grad():
        used = _schedule(run, items, forward_kw, keep, forward_only=True)
    lps = from_last_stage(lps, current())
    return [TrainForward(lps[k], None, used[k]) for k in range(len(items))]
