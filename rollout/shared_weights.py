"""Zero-copy weight sync: an engine in the trainer's process, on the trainer's device, computes with the trainer's
own weight memory.

Why: the copy path (:func:`rollout.weight_sync.sync_weights`) exports every tensor, publishes, loads and checks it
every step: 11.6 GB per GRPO step at Flash-shaped size, a quarter of the step, although the built-in engine runs
in the same process on the same GPU as the weights it copies (issue #32).

How: the official tensors an export would send are views of the trainer's parameters - renamed, ``linear_fc1``
split into ``w1`` / ``w3`` as row views, fp32-kept tensors as they are (:func:`official_views`). The engine points
its own tensor at each view (``ReferenceEngine.share_tensor``); its decode MoE then stacks the experts as views of
the trainer's expert bank (``kernels.reference.stacks``). From then on the trainer's optimizer step IS the engine's
update, and a sync is a version bump plus a check that nothing moved. What cannot be a view is copied at every
sync and counted (``weight_sync_bytes``): tensors the export builds (the three alphas packed into one ``hc_*_scale``),
tensors the engine holds in another dtype than the trainer, experts that do not lie one after another.
``weight_sync_shared_bytes`` counts the rest.

When (:func:`weight_sync_mode`): ``weight_sync=auto`` (the default) shares when the engine is the built-in engine
in this process, this rank holds the full weights (tensor, context, expert and pipeline parallel 1), weights are
published as they are (``--quant`` publishing bf16), no rollout runs while the trainer steps (no
``async_rollout``) and the sync is not the lossless one of ``true_on_policy``; otherwise it copies and says why.
``weight_sync=shared`` refuses a run where it cannot share; ``weight_sync=copy`` always copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from core import weight_contract as wc
from core.config import ConfigError
from core.export import tensor_nbytes

from .weight_sync import SyncReport

__all__ = ["MODES", "WeightSharer", "WeightSyncChoice", "choose_weight_sync", "official_views", "share_weights",
           "run_refusal", "weight_sync_mode"]

MODES = ("auto", "shared", "copy")


def official_views(train_model) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(official name, tensor)`` of every contract tensor, views of the trainer's memory wherever the contract
    renames or cuts (nothing cast, nothing cloned); a tensor the contract joins from several is a new one."""
    native = ((n, t.detach()) for n, t in train_model.native_tensors())
    yield from wc.native_to_hf(native, train_model.config, clone_cuts=False)


def _reasons(cfg, *, in_process: bool, engine_name: str, sizes, publish_format: str) -> Optional[str]:
    checks = (
        (not in_process, f"the {engine_name} rollout engine runs in another process (only the built-in engine in "
         "the trainer's process can read its memory)"),
        (any(getattr(sizes, k, 1) > 1 for k in ("tp", "cp", "ep", "pp")),
         "this rank holds a shard of the weights (tensor, context, expert or pipeline parallel > 1): the engine "
         "needs them whole"),
        (publish_format != "bf16", f"--quant publishes {publish_format} weights: the engine computes with "
         "quantized copies"),
        (bool(cfg.async_rollout), "async_rollout generates while the trainer updates the weights"),
        (bool(cfg.true_on_policy), "true_on_policy syncs every tensor in the trainer's own dtype by the copy path"),
    )
    return next((why for bad, why in checks if bad), None)


def run_refusal(run_config, cfg) -> Optional[str]:
    """Why a run's configuration cannot share its weights with its engine (None: it can, once the engine is
    on the trainer's device): checked when the run is configured (``train.config_checks``)."""
    sel = run_config.selection
    record = sel.rollout
    in_process = record is not None and not record.server and run_config.orchestrator == "local"
    return _reasons(cfg, in_process=in_process, engine_name=record.name if record else "(none)", sizes=run_config,
                    publish_format=sel.quant.publish_format)


def _why_not_shared(cfg, engine, dist, publish_format: str, model_device) -> Optional[str]:
    why = _reasons(cfg, in_process=hasattr(engine, "share_tensor"),
                   engine_name=getattr(engine, "name", type(engine).__name__), sizes=dist,
                   publish_format=publish_format)
    device = getattr(engine, "device", model_device)
    if why is None and device != model_device:
        why = f"the engine is on {device}, the trainer's weights on {model_device}"
    return why


def refusal_message(why: str) -> str:
    return (f"training option 'weight_sync' = shared: {why}. Fix: weight_sync=auto (copies where it cannot share) "
            f"or weight_sync=copy")


@dataclass(frozen=True)
class WeightSyncChoice:
    """How a run's weights reach its engine: ``mode`` "none" (the engine draws from the trainer's module:
    ``TrainModuleEngine``), "shared" (``sharer`` keeps the engine on the trainer's memory) or "copy" (``why``)."""

    mode: str
    why: Optional[str] = None
    sharer: "Optional[WeightSharer]" = None

    def line(self) -> str:
        """The run log's line."""
        if self.mode == "none":
            return "weight sync: none (the engine draws from the trainer's module)"
        if self.mode == "shared":
            return "weight sync: shared (the engine computes with the trainer's weights in place; weight_sync=copy copies)"
        return f"weight sync: copy ({self.why})"


def choose_weight_sync(cfg, engine, dist, publish_format: str, model_device) -> WeightSyncChoice:
    """The run's :class:`WeightSyncChoice` for its rollout engine (None: a rank without an engine)."""
    if engine is None:
        return WeightSyncChoice("copy", "no engine on this rank")
    if getattr(engine, "reads_trainer_weights", False):
        return WeightSyncChoice("none")
    mode, why = weight_sync_mode(cfg, engine, dist, publish_format, model_device)
    return WeightSyncChoice(mode, why, WeightSharer(engine) if mode == "shared" else None)


def weight_sync_mode(cfg, engine, dist, publish_format: str, model_device) -> Tuple[str, Optional[str]]:
    """``("shared" | "copy", why it copies or None)`` for a run's ``weight_sync`` setting; a run that asks for
    ``shared`` where it cannot share is refused (ConfigError naming the reason and the fix)."""
    if cfg.weight_sync == "copy":
        return "copy", "weight_sync=copy"
    why = _why_not_shared(cfg, engine, dist, publish_format, torch.device(model_device))
    if why is None:
        return "shared", None
    if cfg.weight_sync == "shared":
        raise ConfigError(refusal_message(why))
    return "copy", why


class WeightSharer:
    """Keeps a rollout engine pointed at the trainer's weights from step to step.

    The first sync (and one after the engine released its memory, or the trainer's memory moved) goes tensor by
    tensor (:func:`share_weights`) and remembers the addresses it shared and the tensors it had to copy. Every
    later sync checks that those addresses still hold (one pointer read per tensor), copies again only the
    tensors the contract builds or casts (a few kilobytes: the packed ``hc_*_scale``), and bumps the engine's
    version: the step's weights are already where the engine reads them."""

    def __init__(self, engine):
        self.engine = engine
        self._plan: Optional[_Plan] = None

    def sync(self, train_model, *, version: int, check: bool = True) -> SyncReport:
        t0 = time.perf_counter()
        plan = self._plan
        if plan is not None and plan.intact(train_model, self.engine):
            copies = plan.copy_again(self.engine)
            self.engine.bump(version)
            return SyncReport(time.perf_counter() - t0, 0, plan.n_tensors, sum(t.nbytes for _, t in copies),
                              _check_copies(self.engine, copies) if check else None, shared_bytes=plan.shared_bytes)
        report = share_weights(train_model, self.engine, version=version, check=check)
        self._plan = _Plan.of(train_model, self.engine, report)
        return report


class _Plan:
    """What a full share left: the trainer's tensors and their addresses, the engine's shared addresses, and
    per copied official tensor the native tensors it is made of."""

    @classmethod
    def of(cls, train_model, engine, report: SyncReport) -> "Optional[_Plan]":
        if not engine.reusable_share:           # the decode MoE copied experts: every sync must share again
            return None
        plan = cls()
        plan.model, plan.n_tensors, plan.shared_bytes = train_model, report.tensors, report.shared_bytes
        native = list(train_model.native_tensors())
        plan.sources = [t for _, t in native]
        plan.addresses = [t.data_ptr() for t in plan.sources]
        plan.engine_addresses = engine.shared_addresses()
        copied = set(engine.copied_names())
        by_name = dict(native)
        units = {}                              # the export units of the copied tensors: re-exported each sync
        for n in by_name:
            key, members, officials = wc.export_unit(n, train_model.config)
            if copied & set(officials):
                units[key] = members
        plan.copies = [[(m, by_name[m]) for m in members] for members in units.values()]   # (name, tensor) lists
        return plan

    def intact(self, train_model, engine) -> bool:
        return (train_model is self.model and engine.holds_weights
                and all(t.data_ptr() == a for t, a in zip(self.sources, self.addresses))
                and engine.shared_addresses() == self.engine_addresses)

    def copy_again(self, engine) -> list:
        """Copy the tensors that cannot be shared into the engine again; returns ``[(name, source)]``."""
        copies = []
        with torch.no_grad():
            for members in self.copies:
                for name, t in wc.native_to_hf(((n, t.detach()) for n, t in members), self.model.config,
                                               clone_cuts=False):
                    engine.copy_into(name, t)
                    copies.append((name, t))
        return copies


def _check_copies(engine, copies):
    """The weight checker over the copied tensors (the shared ones are the trainer's memory, checked by address:
    :meth:`_Plan.intact`)."""
    from core.export import check_weights

    held = engine.held_weights()
    return check_weights({n: held[n] for n, _ in copies}, {n: t.to(held[n].dtype) for n, t in copies})


def share_weights(train_model, engine, *, version: int, check: bool = True) -> SyncReport:
    """Point ``engine`` at ``train_model``'s weights (the first time, and again after the engine released them or
    the trainer's memory moved); copy what cannot be shared. ``check``: compare every copied tensor with its
    source afterwards (shared ones are the source)."""
    t0 = time.perf_counter()
    n_tensors = copied = shared = 0
    engine.begin_share(version)
    copies = []
    with torch.no_grad():
        trainer_memory = {t.untyped_storage().data_ptr() for _, t in train_model.native_tensors()}
        for name, t in official_views(train_model):
            n_tensors += 1
            # a view of the trainer's memory is shared; a tensor the contract built (a join) is a copy already
            moved = engine.share_tensor(name, t, live=t.untyped_storage().data_ptr() in trainer_memory)
            if moved:
                copied += moved
                copies.append((name, t))
            else:
                shared += tensor_nbytes(t)
    copied += engine.finish_share()
    report = _check_copies(engine, copies) if check else None
    return SyncReport(time.perf_counter() - t0, 0, n_tensors, copied, report, shared_bytes=shared)
