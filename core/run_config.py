"""Normalization: the CLI's choices become one frozen RunConfig, or an error.

This is the only place that turns user choices into a run configuration. It
resolves names through the plugin host (unknown names list the valid choices),
fills defaults that depend on other choices (the qkv format defaults to the
implementation's first format), and checks the combination table. Nothing is
ever substituted for an explicit choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from core.combinations import Selection, check
from core.records import ATTENTION, HARDWARE, KERNEL, QUANT, QKV_FORMATS


@dataclass(frozen=True)
class Choices:
    """What the user asked for (None = not given, take the default)."""

    impl: str = "miles"
    kernel_backend: str = "none"
    quant: str = "bf16"
    hardware: str = "cpu"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    qkv_format: Optional[str] = None
    model: Optional[object] = dataclasses.field(default=None, repr=False)  # core.config.ModelConfig
    max_tokens_per_rank: Optional[int] = None  # packing budget per context-parallel rank (None = not given)


@dataclass(frozen=True)
class RunConfig:
    """The resolved, validated configuration every job runs from."""

    impl: str
    kernel_backend: str
    quant: str
    hardware: str
    qkv_format: str
    model_name: str
    tp: int
    pp: int
    cp: int
    ep: int
    selection: Selection = dataclasses.field(repr=False, compare=False)
    model: Optional[object] = dataclasses.field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("selection", "model")}
        out["providers"] = {
            "impl": self.selection.impl.provider,
            "kernel_backend": self.selection.kernel.provider,
            "quant": self.selection.quant.provider,
            "hardware": self.selection.hardware.provider,
        }
        return out


def normalize(choices: Choices, host, model_name: str = "unspecified") -> RunConfig:
    """Resolve and validate; raises UnknownBackendError or InvalidCombination.

    ``choices.model`` (a ModelConfig) enables the checks that depend on the
    model's shape (tensor parallel must divide o_groups, expert parallel the
    routed experts); ``model_name`` is what the user called it.
    """
    for name in ("tp", "pp", "cp", "ep"):
        value = getattr(choices, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer (got {value!r})")
    if choices.pp != 1:
        raise ValueError(
            f"--pp {choices.pp}: pipeline parallelism is not supported by either implementation yet. Fix: use --pp 1."
        )
    impl = host.get(ATTENTION, choices.impl)
    kernel = host.get(KERNEL, choices.kernel_backend)
    quant = host.get(QUANT, choices.quant)
    hardware = host.get(HARDWARE, choices.hardware)
    qkv_format = choices.qkv_format or impl.qkv_formats[0]
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"unknown --qkv-format {qkv_format!r}; valid choices: {', '.join(QKV_FORMATS)}")
    model = choices.model
    selection = Selection(
        impl,
        kernel,
        quant,
        hardware,
        qkv_format=qkv_format,
        tp=choices.tp,
        cp=choices.cp,
        ep=choices.ep,
        o_groups=getattr(model, "o_groups", None),
        n_routed_experts=getattr(model, "n_routed_experts", None),
        compress_ratios=tuple(getattr(model, "compress_ratios", ()) or ()) or None,
        max_tokens_per_rank=choices.max_tokens_per_rank,
    )
    check(selection, host)
    return RunConfig(
        impl=impl.name,
        kernel_backend=kernel.name,
        quant=quant.name,
        hardware=hardware.name,
        qkv_format=qkv_format,
        model_name=model_name,
        tp=choices.tp,
        pp=choices.pp,
        cp=choices.cp,
        ep=choices.ep,
        selection=selection,
        model=model,
    )


def availability_problems(run: RunConfig) -> list[str]:
    """Why the chosen backends cannot run on *this* machine (empty if they can).

    Separate from the combination table: the table says what can work anywhere;
    this says what is installed and visible here (a GPU, cuDNN-frontend, ...).
    """
    problems = []
    sel = run.selection
    for option, record in (
        ("--impl", sel.impl),
        ("--kernel-backend", sel.kernel),
        ("--quant", sel.quant),
        ("--hardware", sel.hardware),
    ):
        reason = record.unavailable_reason()
        if reason:
            problems.append(f"{option} {record.name} is not usable on this machine: {reason}")
    return problems
