"""The assembly step: a validated :class:`core.run_config.RunConfig` becomes the objects that run.

This module is the only product code that calls ``record.load()``. Everything that builds a model, sets up
a process, publishes weights or starts a rollout engine (the launcher's stages, parallel scoring, the
trainer, export and every benchmark) takes a RunConfig and asks :func:`assemble` for its handles, so a
choice made on the command line reaches the code that runs unchanged: nothing below re-derives it from
strings or replaces it with a default.

Handles (typed by ``core.protocols``), each built once per :class:`Assembly`, on first use:

* ``target``: the hardware target (device, process setup, process groups);
* ``ops``: the kernel backend's op table (``core.kernel_ops.OpTable``: which kernels ran is counted);
* ``scheme``: the quantization scheme (publish format, what it changes in a training model);
* ``build_model(...)``: the attention implementation's model, built with the run's ops and dtype (without
  random init when a checkpoint fills it);
* ``rollout_engine(...)``: the rollout engine.
"""

from __future__ import annotations

import functools
from typing import Any

from core.protocols import Engine, KernelOps, Scheme, Target

__all__ = ["Assembly", "AssemblyError", "assemble"]


class AssemblyError(TypeError):
    """A factory returned something that does not fit its axis's protocol."""


def _checked(handle: Any, protocol: type, what: str) -> Any:
    if not isinstance(handle, protocol):
        raise AssemblyError(f"{what} returned {type(handle).__name__}, which is not a {protocol.__name__} "
                            f"(core.protocols.{protocol.__name__})")
    return handle


class Assembly:
    """The run's handles (see the module docstring)."""

    def __init__(self, run):
        self.run = run
        self.selection = run.selection

    @functools.cached_property
    def target(self) -> Target:
        record = self.selection.hardware
        return _checked(record.load()(), Target, f"--hardware {record.name}")

    @functools.cached_property
    def ops(self) -> KernelOps:
        record = self.selection.kernel
        return _checked(record.load()(), KernelOps, f"--kernel-backend {record.name}")

    @functools.cached_property
    def scheme(self) -> Scheme:
        record = self.selection.quant
        return _checked(record.load()(), Scheme, f"--quant {record.name}")

    def setup_process(self) -> Target:
        """Set this process up for the run's target and, when no process group exists yet, start a one-rank
        group with megatron's parallel state (the several-rank jobs start theirs before building models)."""
        import torch.distributed as dist

        target = self.target
        target.setup()
        if not dist.is_initialized():
            target.init_process_group(0, 1, tp=1)
        elif dist.get_backend() != target.distributed_backend:
            # a one-rank group of another target (a CPU job earlier in this process) would be reused: NCCL's
            # collectives on a gloo group crash the process (seen: a segfault in megatron's parameter all-gather)
            raise RuntimeError(f"this process already has a {dist.get_backend()} process group; --hardware "
                               f"{self.selection.hardware.name} needs {target.distributed_backend}. Fix: run it "
                               "in its own process (a new `dsv4` command or pytest run)")
        return target

    def device(self):
        """This process's device on the run's target (the current CUDA device on a GPU target)."""
        import torch

        return self.target.device(torch.cuda.current_device() if self.selection.hardware.gpu else 0)

    def build_model(self, model_config=None, *, params_dtype=None, initialize: bool = True, **options) -> Any:
        """The run's implementation, with the run's kernel ops, in ``params_dtype`` (default: the run's
        ``--dtype``), for this process's ranks. ``options`` go to the implementation's factory (e.g.
        megatron's ``dsa_indexer_loss_coeff``); one it does not take is an error naming it.

        ``initialize=False``: for a model a checkpoint fills. The factory skips its random draws (its
        ``initialize`` option; minutes of one CPU core for a large model, all overwritten by the load) and
        every floating weight is then set to NaN (``core.finite.fill_unwritten_``), so one the load does not
        write fails ``core.finite.check_written`` instead of holding leftover memory."""
        import inspect

        record = self.selection.impl
        factory = record.load()
        if not initialize:
            options["initialize"] = False
        accepted = inspect.signature(factory).parameters
        unknown = [k for k in options if k not in accepted]
        if unknown:
            raise ValueError(f"--impl {record.name} does not take {', '.join(sorted(unknown))}")
        config = model_config if model_config is not None else self.run.model
        dtype = params_dtype if params_dtype is not None else self.run.torch_dtype
        model = factory(config, self.run, ops=self.ops, params_dtype=dtype, **options)
        if not initialize:
            from core.finite import fill_unwritten_

            fill_unwritten_(model)
        return model

    def rollout_engine(self, model_config, **options) -> Engine:
        """The run's rollout engine for ``model_config`` (refused with the reason when it cannot run here).
        ``options`` go to the engine's factory; ``device`` defaults to this process's device on the run's
        target (:meth:`device`: the current CUDA device on a GPU target); an engine that computes here (not a
        server) gets ``ops``, the run's kernel op table (:attr:`ops`), and runs the run's kernels. With
        ``--rollout-url`` (a server engine) the factory gets ``url`` and nothing runs here: the engine's local
        probe does not apply."""
        record = self.selection.rollout
        url = self.run.rollout_url
        if url is None or not record.server:
            reason = record.unavailable_reason()
            if reason:
                raise RuntimeError(f"--rollout-engine {record.name} is not usable here: {reason}")
        else:
            options.setdefault("url", url)
        options.setdefault("device", self.device())
        if not record.server:
            options.setdefault("ops", self.ops)
        return _checked(record.load()(model_config, **options), Engine, f"--rollout-engine {record.name}")


def assemble(run) -> Assembly:
    """The handles of ``run`` (a normalized RunConfig)."""
    return Assembly(run)
