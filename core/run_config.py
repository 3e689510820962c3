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

from core.combinations import (JOBS, ORCHESTRATORS, WEIGHT_TRANSPORTS, Selection, check, default_dtype, layout_world,
                                table_rules)
from core.records import ATTENTION, DTYPES, HARDWARE, KERNEL, QKV_FORMATS, QUANT, ROLLOUT


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
    vpp: int = 1    # virtual pipeline stages per pipeline rank (dsv4 train / full-train --vpp)
    qkv_format: Optional[str] = None
    model: Optional[object] = dataclasses.field(default=None, repr=False)  # core.config.ModelConfig
    max_tokens_per_rank: Optional[int] = None  # packing budget per context-parallel rank (None = not given)
    rollout_engine: str = "reference"
    rollout_url: Optional[str] = None  # a running rollout server to connect to (None = the engine runs or starts here)
    dtype: Optional[str] = None  # fp32 | bf16; None = the hardware's default (bf16 on GPUs, fp32 on the CPU)
    job: Optional[str] = None    # "score" | "train": also check that job's own limits
    world: Optional[int] = None  # ranks of the run (torchrun's WORLD_SIZE, --nproc-per-node); None = tp x cp x ep
    orchestrator: str = "local"  # local (this machine's processes) | ray (actors on a Ray cluster)
    rollout_num_gpus: Optional[int] = None  # ray: devices of their own for the rollout engines (None = colocated)
    rollout_num_nodes: Optional[int] = None  # ray: the nodes those devices spread over (None = wherever they fit)
    weight_transport: Optional[str] = None  # ray: how weights reach the engine actors (None = objects)


@dataclass(frozen=True)
class RunConfig:
    """The resolved, validated configuration every job runs from.

    ``selection`` holds the five chosen records (implementation, kernel backend, quantization scheme,
    hardware target, rollout engine); :func:`core.assembly.assemble` turns them into the objects that run.
    The name fields repeat the records' names for printing and saving."""

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
    rollout_engine: str = "reference"
    dtype: str = "fp32"
    max_tokens_per_rank: Optional[int] = None
    job: Optional[str] = None
    world: int = 1
    rollout_url: Optional[str] = None
    orchestrator: str = "local"
    rollout_num_gpus: Optional[int] = None
    rollout_num_nodes: Optional[int] = None
    weight_transport: Optional[str] = None
    vpp: int = 1
    # The table's rules this run was checked against (core.combinations.table_rules of the plugin host): the job
    # rules the plugins added, kept for the trainer's option checks (train_option_problems), made where no host is.
    rules: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks left after tensor, context and pipeline parallelism."""
        return self.world // (self.tp * self.cp * self.pp)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("selection", "model", "rules")}
        out["providers"] = {
            "impl": self.selection.impl.provider,
            "kernel_backend": self.selection.kernel.provider,
            "quant": self.selection.quant.provider,
            "hardware": self.selection.hardware.provider,
            "rollout_engine": self.selection.rollout.provider,
        }
        return out

    @property
    def torch_dtype(self):
        """The run dtype as a ``torch.dtype`` (imports torch)."""
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]


def normalize(choices: Choices, host, model_name: str = "unspecified") -> RunConfig:
    """Resolve and validate; raises UnknownBackendError or InvalidCombination.

    ``choices.model`` (a ModelConfig) enables the checks that depend on the
    model's shape (tensor parallel must divide o_groups, expert parallel the
    routed experts); ``model_name`` is what the user called it.
    """
    for name in ("tp", "pp", "cp", "ep", "vpp"):
        value = getattr(choices, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer (got {value!r})")
    if choices.world is not None and (not isinstance(choices.world, int) or choices.world < 1):
        raise ValueError(f"the number of ranks must be a positive integer (got {choices.world!r})")
    impl = host.get(ATTENTION, choices.impl)
    kernel = host.get(KERNEL, choices.kernel_backend)
    quant = host.get(QUANT, choices.quant)
    hardware = host.get(HARDWARE, choices.hardware)
    rollout = host.get(ROLLOUT, choices.rollout_engine)
    qkv_format = choices.qkv_format or impl.qkv_formats[0]
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"unknown --qkv-format {qkv_format!r}; valid choices: {', '.join(QKV_FORMATS)}")
    dtype = choices.dtype or default_dtype(hardware)
    if dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}; valid choices: {', '.join(DTYPES)}")
    if choices.job is not None and choices.job not in JOBS:
        raise ValueError(f"unknown job {choices.job!r}; valid jobs: {', '.join(JOBS)}")
    rollout_url = server_url(choices.rollout_url) if choices.rollout_url is not None else None
    if choices.rollout_num_gpus is not None and (not isinstance(choices.rollout_num_gpus, int)
                                                 or choices.rollout_num_gpus < 1):
        raise ValueError(f"--rollout-num-gpus must be a positive integer (got {choices.rollout_num_gpus!r})")
    if choices.rollout_num_nodes is not None and (not isinstance(choices.rollout_num_nodes, int)
                                                  or choices.rollout_num_nodes < 1):
        raise ValueError(f"--rollout-num-nodes must be a positive integer (got {choices.rollout_num_nodes!r})")
    if choices.orchestrator not in ORCHESTRATORS:
        raise ValueError(f"unknown --orchestrator {choices.orchestrator!r}; valid choices: {', '.join(ORCHESTRATORS)}")
    if choices.weight_transport is not None and choices.weight_transport not in WEIGHT_TRANSPORTS:
        raise ValueError(f"unknown --weight-transport {choices.weight_transport!r}; valid choices: "
                         f"{', '.join(WEIGHT_TRANSPORTS)}")
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
        pp=choices.pp,
        vpp=choices.vpp,
        n_layers=getattr(model, "n_layers", None),
        o_groups=getattr(model, "o_groups", None),
        n_routed_experts=getattr(model, "n_routed_experts", None),
        n_heads=getattr(model, "n_heads", None),
        head_dim=getattr(model, "head_dim", None),
        compress_ratios=tuple(getattr(model, "compress_ratios", ()) or ()) or None,
        max_tokens_per_rank=choices.max_tokens_per_rank,
        rollout=rollout,
        dtype=dtype,
        job=choices.job,
        world=choices.world,
        rollout_url=rollout_url,
        orchestrator=choices.orchestrator,
        rollout_num_gpus=choices.rollout_num_gpus,
        rollout_num_nodes=choices.rollout_num_nodes,
        weight_transport=choices.weight_transport,
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
        rollout_engine=rollout.name,
        dtype=dtype,
        max_tokens_per_rank=choices.max_tokens_per_rank,
        job=choices.job,
        world=layout_world(selection),
        rollout_url=rollout_url,
        orchestrator=choices.orchestrator,
        rollout_num_gpus=choices.rollout_num_gpus,
        rollout_num_nodes=choices.rollout_num_nodes,
        weight_transport=choices.weight_transport,
        vpp=choices.vpp,
        rules=table_rules(host),
    )


def server_url(text: str) -> str:
    """``--rollout-url``: ``http(s)://HOST:PORT`` (a trailing ``/`` dropped), or a comma-separated list of them
    (one server per engine actor under ``--orchestrator ray``), normalized; else a ValueError naming the option."""
    return ",".join(_one_server_url(part) for part in str(text).split(","))


def rollout_urls(url: Optional[str]) -> list:
    """The servers of a normalized ``--rollout-url`` (:func:`server_url`), in order; empty without one."""
    return [] if url is None else url.split(",")


def _one_server_url(text: str) -> str:
    from urllib.parse import urlsplit

    url = str(text).strip().rstrip("/")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.path or parts.query or parts.fragment:
        raise ValueError(f"--rollout-url must be http://HOST:PORT, the address of a running server (got {text!r})")
    return url


def revalidated(run: RunConfig, host, **changes) -> RunConfig:
    """``run`` with some of its checked fields changed (``max_tokens_per_rank`` once a packed stream's
    length is known, ``job``), checked again against the table; every other choice is kept as it was."""
    selection = dataclasses.replace(run.selection, **changes)
    check(selection, host)
    return dataclasses.replace(run, selection=selection, **changes)


def availability_problems(run: RunConfig) -> list[str]:
    """Why the chosen backends cannot run on *this* machine (empty if they can).

    Separate from the combination table: the table says what can work anywhere;
    this says what is installed and visible here (a GPU, cuDNN-frontend, ...).
    A server rollout engine given ``--rollout-url`` runs nothing here, so its
    probe does not apply (the engine checks the server when it starts).
    """
    problems = []
    sel = run.selection
    connects = sel.rollout.server and run.rollout_url is not None
    for option, record in (
        ("--impl", sel.impl),
        ("--kernel-backend", sel.kernel),
        ("--quant", sel.quant),
        ("--hardware", sel.hardware),
        ("--rollout-engine", None if connects else sel.rollout),
    ):
        reason = record.unavailable_reason() if record is not None else None
        if reason:
            problems.append(f"{option} {record.name} is not usable on this machine: {reason}. "
                            f"Fix: {_AVAILABILITY_FIX.get(option, _AVAILABILITY_FIX['other']).format(option=option)}")
    return problems


# what a user does about a backend this machine cannot run
_AVAILABILITY_FIX = {
    "--hardware": "run on a machine with that hardware and a torch build for it (README, \"Quick start on a GPU "
                  "node\"), or use --hardware cpu",
    "other": "install what it needs (`dsv4 plugins` says what each backend needs and whether it runs here), "
             "or choose another {option}",
}
