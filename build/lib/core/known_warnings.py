"""The library warnings every run used to print, filtered in this one place (issue #21, item 7).

Why: importing megatron-core prints "Transformer Engine and Apex are not installed" four times, each
with the full path of the file that warned, and building a megatron ``TransformerConfig`` with its
defaults warns that its own default CUDA-graph scope is deprecated. None of them is something a user of
``dsv4`` can act on, and they buried the run's own lines.

:func:`filter_known_warnings` ignores exactly these (by message and category), in this process and, through
``PYTHONWARNINGS``, in the processes it starts (``--cp N`` ranks, scoring workers). ``dsv4 -v`` shows
them again. Any other warning is shown as before.
"""

from __future__ import annotations

import os
import re
import warnings

__all__ = ["KNOWN_WARNINGS", "filter_known_warnings"]

# (the start of the message, category): warnings that are harmless for a dsv4 run.
KNOWN_WARNINGS = (
    # megatron/core/{optimizer,distributed/fsdp,...}: the optional fused kernels are absent (CPU builds)
    ("Transformer Engine and Apex are not installed", UserWarning),
    # megatron/core/transformer/transformer_config.py: megatron's own default cuda_graph_scope
    ("full scope is deprecated", UserWarning),
)


def _env_entries() -> list[str]:
    """The same filters in ``-W`` syntax (the message is a literal prefix there; none holds a comma)."""
    return [f"ignore:{message}:{category.__name__}" for message, category in KNOWN_WARNINGS]


def filter_known_warnings(show: bool = False) -> None:
    """Ignore :data:`KNOWN_WARNINGS` here and in child processes, unless ``show``."""
    if show:
        return
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    present = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(present + [e for e in _env_entries() if e not in present])
