"""The typed records that plugins hand to the plugin host.

Every choice a user makes at config time (attention implementation, kernel
backend, quantization scheme, hardware target, rollout engine) is served by one
record. A record says what the backend *is* (name, one-line description, capabilities)
and how to build it (a lazy factory: a "module:attribute" string imported only
when the backend is actually used), so listing plugins never imports torch,
megatron-core or a GPU library.

Capabilities are plain data so that the combination table (core/combinations.py)
can be derived from them: a third-party plugin extends the table by declaring
its capabilities, without edits to core/.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

# Axis names, used in messages, in `dsv4 plugins` and as the CLI option names.
ATTENTION = "attention_impl"
KERNEL = "kernel_backend"
QUANT = "quant_scheme"
HARDWARE = "hardware_target"
ROLLOUT = "rollout_engine"
AXES = (ATTENTION, KERNEL, QUANT, HARDWARE, ROLLOUT)

AXIS_OPTION = {
    ATTENTION: "--impl",
    KERNEL: "--kernel-backend",
    QUANT: "--quant",
    HARDWARE: "--hardware",
    ROLLOUT: "--rollout-engine",
}

QKV_FORMATS = ("bshd", "thd")

# The run's compute dtype (``--dtype``): fp32 is the CPU default, bf16 the GPU default.
DTYPES = ("fp32", "bf16")


def _frozen(values) -> Optional[frozenset]:
    """None means "no restriction"; anything else becomes a frozenset of names."""
    if values is None:
        return None
    if isinstance(values, str):
        return frozenset([values])
    return frozenset(values)


@dataclass(frozen=True)
class BackendRecord:
    """Fields every axis shares.

    ``factory`` is "package.module:attribute"; ``load()`` imports it on demand.
    ``provider`` is filled in by the plugin manager with the distribution that
    registered the record ("dsv4" for built-ins), so duplicates can name both.
    ``availability`` is an optional "module:function" returning None when the
    backend can run on this machine, or a sentence saying why it cannot.
    ``not_runnable`` is None for a backend that is built; for one that is declared
    but cannot run anywhere yet (its kernels are not written, or a target defines
    rules only), the sentence saying why. The combination table refuses it with
    that reason and generates no supported test row for it.
    """

    name: str
    description: str
    factory: str
    availability: Optional[str] = None
    provider: str = "dsv4"
    not_runnable: Optional[str] = None

    axis: ClassVar[str] = ""

    def __post_init__(self):
        if not self.name or self.name.strip() != self.name or " " in self.name:
            raise ValueError(f"backend name {self.name!r} must be a non-empty word without spaces")
        if ":" not in self.factory:
            raise ValueError(f"{self.axis} {self.name!r}: factory must be 'module:attribute', got {self.factory!r}")
        for f in dataclasses.fields(self):
            if f.metadata.get("frozenset"):
                object.__setattr__(self, f.name, _frozen(getattr(self, f.name)))

    def load(self) -> Any:
        """Import and return the factory object (a class or function)."""
        return _import_ref(self.factory, f"{self.axis} {self.name!r}")

    def unavailable_reason(self) -> Optional[str]:
        """None when usable here; otherwise why not (e.g. a package is missing)."""
        if self.availability is None:
            return None
        probe: Callable[[], Optional[str]] = _import_ref(self.availability, f"{self.axis} {self.name!r} probe")
        return probe()

    def with_provider(self, provider: str) -> "BackendRecord":
        return dataclasses.replace(self, provider=provider)

    def capabilities(self) -> dict:
        """The capability fields as JSON-friendly data (sorted lists, None = any)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("name", "description", "factory", "availability", "provider", "not_runnable"):
                continue
            value = getattr(self, f.name)
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out


def _set(**kw):
    return field(metadata={"frozenset": True}, **kw)


@dataclass(frozen=True)
class AttentionImpl(BackendRecord):
    """A whole model path (attention, mHC, weight layout) built on megatron-core.

    max_tensor_parallel: largest tensor-parallel size (None = any, subject to
    o_groups % tp == 0). qkv_formats: accepted layouts, the first is the default.
    Which kernel backends serve it is declared by the kernel backends (their
    ``impls``), so a third-party kernel backend can add itself.
    """

    qkv_formats: tuple = ("bshd", "thd")
    max_tensor_parallel: Optional[int] = None
    context_parallel: bool = True
    expert_parallel: bool = True
    pipeline_parallel: bool = False   # --pp > 1: the model splits into stages (engine.pipeline)
    tp_hint: str = ""

    axis: ClassVar[str] = ATTENTION

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "qkv_formats", tuple(self.qkv_formats))
        unknown = set(self.qkv_formats) - set(QKV_FORMATS)
        if unknown or not self.qkv_formats:
            raise ValueError(f"attention impl {self.name!r}: qkv_formats must be a non-empty subset of {QKV_FORMATS}")


@dataclass(frozen=True)
class KernelBackend(BackendRecord):
    """A set of kernels (sparse attention, indexer, compressor, mHC).

    hardware: hardware targets it runs on (None = any). impls: attention
    implementations whose op interface it implements (None = all, as the
    reference ops do). dtypes: the run dtypes (``--dtype``: fp32, bf16) its
    kernels compute in (None = any); a run in another dtype is refused at parse
    time, and its kernels refuse such inputs at run time instead of handing them
    to another backend. deterministic: whether it claims bit-reproducible results.
    attention_head_dims: the head dims its sparse-attention kernel is built for (None = any its entry point
    takes); attention_heads_multiple: the query heads must be a multiple of it (one kernel tile of heads).
    A model outside them is refused at parse time (rule ``kernel-attention-shape``).
    """

    hardware: Optional[frozenset] = _set(default=None)
    impls: Optional[frozenset] = _set(default=None)
    dtypes: Optional[frozenset] = _set(default=None)
    deterministic: bool = False
    attention_head_dims: Optional[frozenset] = _set(default=None)
    attention_heads_multiple: int = 1

    axis: ClassVar[str] = KERNEL


@dataclass(frozen=True)
class QuantScheme(BackendRecord):
    """How weights are stored, published to rollout engines and trained.

    hardware / kernel_backends: where it can run (None = any).
    prepare_stage: the launcher stage that converts checkpoints for it, if any.
    publish_format: the weight format the trainer publishes to the rollout
    engine under this scheme (core/converters publish formats).
    """

    hardware: Optional[frozenset] = _set(default=None)
    kernel_backends: Optional[frozenset] = _set(default=None)
    prepare_stage: Optional[str] = None
    publish_format: str = "bf16"

    axis: ClassVar[str] = QUANT


@dataclass(frozen=True)
class HardwareTarget(BackendRecord):
    """Where a run executes: process-group backend and device setup.

    distributed_backend: torch.distributed backend (nccl, rccl via nccl, gloo).
    gpu: whether it needs an accelerator (decides the test matrix's tags).
    """

    distributed_backend: str = "gloo"
    gpu: bool = False

    axis: ClassVar[str] = HARDWARE


@dataclass(frozen=True)
class RolloutEngine(BackendRecord):
    """An engine that generates rollouts from weights published by the trainer.

    gpu: whether it needs an accelerator where it runs. routed_experts: whether
    it can return the routed experts per token (routing replay, R3).
    weight_update: how it takes new weights ("tensor", "disk"; the first is the
    default). publish_formats: weight formats it loads (core/converters publish
    schemes; None = any). server: whether it is a server the trainer talks to:
    started by the trainer from the run's starting weights (the factory's
    ``model_path``), or already running at ``--rollout-url`` (the factory's
    ``url``; nothing of it then runs on this machine, so ``gpu`` does not
    bind the run's hardware).
    """

    gpu: bool = False
    server: bool = False
    routed_experts: bool = False
    weight_update: tuple = ("tensor",)
    publish_formats: Optional[frozenset] = _set(default=None)

    axis: ClassVar[str] = ROLLOUT

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "weight_update", tuple(self.weight_update))
        if not self.weight_update or set(self.weight_update) - {"tensor", "disk"}:
            raise ValueError(f"rollout engine {self.name!r}: weight_update must be a non-empty subset of "
                             f"('tensor', 'disk')")


RECORD_TYPES = {
    ATTENTION: AttentionImpl,
    KERNEL: KernelBackend,
    QUANT: QuantScheme,
    HARDWARE: HardwareTarget,
    ROLLOUT: RolloutEngine,
}


def _import_ref(ref: str, what: str) -> Any:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what}: cannot import {module_name!r} ({exc})") from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise ImportError(f"{what}: {module_name!r} has no attribute {attr!r}") from exc
    return obj
