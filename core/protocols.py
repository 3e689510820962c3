"""What each axis's factory returns: the typed handles the assembly step hands to the code that runs.

A record (``core.records``) says what a backend is; its factory builds the object that does the work.
These protocols are that object's contract, one per axis, so a third-party backend knows what to return
and ``tests/protocols_test.py`` can check every built-in factory against its protocol:

* attention implementation: the factory itself is a :class:`ModelFactory`;
* kernel backend: the factory returns :class:`KernelOps` (built-ins return :class:`core.kernel_ops.OpTable`);
* hardware target: the factory is a class whose instances are :class:`Target`;
* quantization scheme: the factory returns a :class:`Scheme`;
* rollout engine: the factory is an :class:`EngineFactory` returning an :class:`Engine`.

Only typing is imported here (no torch).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

from core.records import ATTENTION, HARDWARE, KERNEL, QUANT, ROLLOUT


@runtime_checkable
class ModelFactory(Protocol):
    """``build_model(model_config, run_config, *, ops, params_dtype, **options) -> torch.nn.Module``.

    ``ops`` is the run's kernel op table (the model calls every DeepSeek-V4 op through it); the process
    is already set up by the run's hardware target (megatron-core's parallel state exists). A factory that
    takes ``initialize`` (a bool) skips its random init when it is False: the model is loaded from a
    checkpoint next (``core.assembly.Assembly.build_model``)."""

    def __call__(self, model_config: Any, run_config: Any, *, ops: "KernelOps", params_dtype: Any,
                 **options: Any) -> Any: ...


@runtime_checkable
class KernelOps(Protocol):
    """The ops a kernel backend provides, under the reference op names (``core.kernel_ops.OP_NAMES``);
    ``provider[op]`` names the backend that answers each one; ``indexer_inputs`` the dtype its
    ``indexer_scores`` takes ``q`` and ``k`` in (``core.kernel_ops.INDEXER_INPUTS``: ``"compute"``, fp32, as
    the reference op; ``"activation"``, the model's dtype, as a bf16/fp16 kernel)."""

    backend: str
    dtypes: Optional[frozenset]
    provider: dict
    indexer_inputs: str

    sparse_attention_with_sink: Callable
    indexer_scores: Callable
    hadamard_transform: Callable
    sinkhorn: Callable
    hc_pre: Callable
    hc_post: Callable
    hc_head: Callable


@runtime_checkable
class Target(Protocol):
    """Where a run executes: its device, process setup and process groups (the run's parallel layout)."""

    distributed_backend: str

    def device(self, local_rank: int = 0) -> Any: ...

    def setup(self) -> None: ...

    def init_process_group(self, rank: int = 0, world_size: int = 1, *, tp: int = 1, cp: int = 1, ep: int = 1,
                           pp: int = 1,
                           port: Optional[int] = None, seed: int = 1234, store: Any = None) -> Any:
        """Join the run's process group (on ``store``, the c10d store the ranks met on, if any) and start its
        parallel layout; returns this rank's layout (``engine.layout.ParallelLayout``)."""

    def destroy_process_group(self) -> None: ...


@runtime_checkable
class Scheme(Protocol):
    """A quantization scheme at run time: how the trained weights are published to the rollout engine,
    and what it changes in a model that trains under it (QAT's fake quantization; nothing for the rest)."""

    name: str
    publish_format: str

    def publish(self, named_tensors: Iterable) -> list: ...

    def prepare_training(self, model: Any) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """A rollout engine: generates from weights the trainer publishes to it in buckets."""

    def generate(self, prompts: Sequence[Sequence[int]], params: Any, *, n: int, seed: int,
                 first_prompt: int = 0) -> list: ...

    def begin_update(self, version: int) -> None: ...

    def load_bucket(self, bucket: list) -> None: ...

    def finish_update(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class EngineFactory(Protocol):
    """``make_engine(model_config, **options) -> Engine``. The assembly passes ``device`` (this process's
    device on the run's target), ``ops`` (the run's kernel op table, to an engine that is not a
    server) and, with ``--rollout-url``, ``url`` (a server engine connects to it). The
    trainer passes ``dtype`` (the run's), ``settings`` (its ``TrainConfig``: a server engine reads its own
    fields), ``run_dir`` (the run folder, for files the engine writes), ``publish_format`` (the format of
    the weights it will be sent) and, for a server engine it starts, ``model_path`` (the run's starting
    weights as an HF checkpoint). An engine ignores the options it does not use (a server: ``device``,
    ``dtype``, ``ops``)."""

    def __call__(self, config: Any, **options: Any) -> Engine: ...


# Per axis: the protocol of what ``record.load()`` returns, and of what calling it returns (None: the
# loaded object is the handle itself).
FACTORY_PROTOCOLS = {
    ATTENTION: (ModelFactory, None),
    KERNEL: (None, KernelOps),
    HARDWARE: (None, Target),
    QUANT: (None, Scheme),
    ROLLOUT: (EngineFactory, None),
}
