"""Built-in rollout engines (the fifth plugin axis, ``dsv4_rollout_engines``).

* ``reference`` - :class:`rollout.reference_engine.ReferenceEngine`: generates with the reference model from the
  exported HF-named weights, KV-cached and batched, on the run's device (CPU or any torch device; no server).
* ``sglang`` - :class:`rollout.sglang_engine.SGLangEngine`: starts an SGLang server from the run's starting
  weights (a GPU target and the ``sglang`` package here), or connects to one at ``--rollout-url`` (any
  target: the server runs elsewhere, so the probe below does not apply).
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from core.hookspecs import hookimpl
from core.records import RolloutEngine


def sglang_unavailable() -> Optional[str]:
    if importlib.util.find_spec("sglang") is None:
        return "the sglang package is not installed"
    try:
        import torch

        if not torch.cuda.is_available():
            return "SGLang needs a CUDA/ROCm GPU and none is visible"
    except ImportError:
        return "torch is not installed"
    return None


@hookimpl
def dsv4_rollout_engines():
    return [
        RolloutEngine(
            name="reference",
            description="reference model generating from the exported HF-named weights (KV-cached, batched; "
                        "the run's device)",
            factory="rollout.reference_engine:make_reference_engine",
            gpu=False,
            routed_experts=True,
            weight_update=("tensor",),
            publish_formats=None,
        ),
        RolloutEngine(
            name="sglang",
            description="SGLang server (started by the trainer, or at --rollout-url): generate, weight updates "
                        "from tensors or disk, routed experts",
            factory="rollout.sglang_engine:make_sglang_engine",
            availability="rollout.plugin:sglang_unavailable",
            gpu=True,
            server=True,
            routed_experts=True,
            weight_update=("tensor", "disk"),
            publish_formats=("bf16", "fp8", "nvfp4"),
        ),
    ]
