"""megatron-core ``dist_checkpointing`` checkpoints (``torch_dist`` backend) under upstream names.

Layout written by megatron-core's ``dist_checkpointing.save`` (``metadata.json`` with
``"sharded_backend": "torch_dist"``, ``common.pt``, DCP ``.metadata`` + ``__*.distcp``). The sharded keys
are upstream Megatron's (``docs/interop.md``): the contract's native names, except the routed experts,
which upstream's ``TEGroupedMLP`` / ``SequentialMLP`` store as one tensor per layer with the global expert
index as a prepended axis::

    <layer>.mlp.experts.linear_fc1.weight<e>  ->  <layer>.mlp.experts.experts.linear_fc1.weight  [E, 2I, C]
    <layer>.mlp.experts.linear_fc2.weight<e>  ->  <layer>.mlp.experts.experts.linear_fc2.weight  [E, C, I]

``linear_fc1`` is saved as upstream's SwiGLU factory saves it: gate and up rows as two chunks of the
same key. ``mlp.router.tid2eid`` is stored as upstream's int32 buffer and read back as int64.

* :func:`save_torch_dist` writes with megatron-core's own ``dist_checkpointing.save`` (a process group
  is needed; a one-rank gloo group is started when none exists).
* :func:`load_torch_dist` reads with plain ``torch.distributed.checkpoint`` (no process group), through
  the allow-listed metadata unpickler of :mod:`core.native_checkpoint`; ``common.pt`` (a pickle) is never
  read, Transformer Engine's ``_extra_state`` objects and optimizer state are ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Dict, Mapping

import torch

from core import weight_contract as wc
from core.errors import UserInputError

__all__ = ["TorchDistError", "is_torch_dist_checkpoint", "save_torch_dist", "load_torch_dist",
           "check_torch_dist", "torch_dist_model_config", "upstream_key", "CONFIG_FILE", "cpu_save_context"]

CONFIG_FILE = "config.json"  # the HF config of the model, written next to the checkpoint
_RX_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)\Z")


class TorchDistError(UserInputError):
    """A torch_dist checkpoint folder is invalid or does not fit the model."""


def upstream_key(native_name: str):
    """``(sharded key, expert index or None)`` of a native name."""
    m = _RX_EXPERT.match(native_name)
    if m:
        return f"{m.group(1)}experts.{m.group(2)}.weight", int(m.group(3))
    return native_name, None


def is_torch_dist_checkpoint(path) -> bool:
    """Whether ``path`` is a megatron-core dist checkpoint of the torch_dist backend. One of another backend
    (``"sharded_backend": "zarr"``, megatron-core's older format) is refused here by name, rather than read as
    an HF folder and reported as missing its config.json."""
    from core.bounded_io import BoundedReadError, load_json

    p = Path(path)
    try:
        meta = load_json(p / "metadata.json", what="megatron-core checkpoint metadata")
    except BoundedReadError:
        raise                 # a FIFO, a device, a huge file: named as such, not read as an HF folder
    except (OSError, ValueError, UserInputError):
        return False
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if isinstance(backend, str) and backend != "torch_dist":
        raise TorchDistError(f"{p}: a megatron-core dist checkpoint of the sharded_backend {backend[:40]!r} "
                             f"(metadata.json); dsv4 reads only 'torch_dist' ones. Fix: re-save it with "
                             f"megatron-core's torch_dist backend, or convert its HF checkpoint with "
                             f"dsv4 convert --format torch_dist")
    return backend == "torch_dist" and os.path.lexists(p / ".metadata")


@contextlib.contextmanager
def cpu_save_context():
    """megatron-core's torch_dist writer always ends its tensor preload with ``torch.cuda.synchronize()``;
    on a host without CUDA that raises. There (only), make it a no-op for the duration of a save."""
    if torch.cuda.is_available():
        yield
        return
    orig = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = orig


#: torch's own plan dataclasses / enums that megatron-core's writer stores in the DCP metadata (besides the
#: metadata classes :mod:`core.native_checkpoint` allows); nothing else is resolved while unpickling it.
_PLANNER_CLASSES = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
                    "LoadItemType"}


# the allow-listed metadata reader of native checkpoints, plus the planner classes above
_EXTRA_GLOBALS = {"torch.distributed.checkpoint.planner": _PLANNER_CLASSES}


def _read_metadata(path: Path):
    from core.native_checkpoint import _read_dcp_metadata

    return _read_dcp_metadata(path, _EXTRA_GLOBALS)


def _reader(path: Path):
    from core.native_checkpoint import _make_reader

    return _make_reader(path, _EXTRA_GLOBALS)


def _ensure_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # the hardware target sets processes up (converters sit below backends)
        raise RuntimeError("writing a torch_dist checkpoint needs a process group: set the process up through the "
                           "run's hardware target first (core.assembly.assemble(run).setup_process())")


def _sharded_state_dict(native: Mapping[str, torch.Tensor], config) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    E = config.n_routed_experts
    out = {}
    for name, t in native.items():
        t = t.detach().contiguous()
        if name.endswith("mlp.router.tid2eid"):
            t = t.to(torch.int32)  # upstream's buffer dtype
        key, e = upstream_key(name)
        if e is None:
            out[name] = ShardedTensor.from_rank_offsets(key, t, replica_id=0)
        elif key.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(t, 2, dim=0)
            out[name + ":w"] = ShardedTensor.from_rank_offsets(key, gate.contiguous(), (0, e, E), (1, 0, 2),
                                                               replica_id=0, prepend_axis_num=1)
            out[name + ":v"] = ShardedTensor.from_rank_offsets(key, up.contiguous(), (0, e, E), (1, 1, 2),
                                                               replica_id=0, prepend_axis_num=1)
        else:
            out[name] = ShardedTensor.from_rank_offsets(key, t, (0, e, E), replica_id=0, prepend_axis_num=1)
    return out


def save_torch_dist(path, native_state: Mapping[str, torch.Tensor], config, *, overwrite: bool = False) -> Path:
    """Write ``native_state`` (contract names, complete) as a megatron-core torch_dist checkpoint at
    ``path`` (atomically: built in a temporary sibling, renamed into place) plus the HF ``config.json``."""
    out = Path(path).absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise TorchDistError(f"{out}: exists and is not an empty folder (pass --overwrite to replace it)")
    wc.check_native_state(native_state.keys(), config, complete=True)
    _ensure_process_group()
    from megatron.core import dist_checkpointing

    out.parent.mkdir(parents=True, exist_ok=True)
    from core.atomic import atomic_folder

    with atomic_folder(out) as tmp:
        with cpu_save_context():
            dist_checkpointing.save(_sharded_state_dict(native_state, config), str(tmp))
        (tmp / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2, sort_keys=True))
    return out


def torch_dist_model_config(path):
    """The ModelConfig of a torch_dist checkpoint: its ``config.json`` (written by :func:`save_torch_dist`).
    A checkpoint written by Megatron itself has none: the model must then be named (``--model``)."""
    from core.config import ModelConfig

    p = Path(path)
    if not (p / CONFIG_FILE).is_file():
        raise TorchDistError(f"{p}: a torch_dist checkpoint without {CONFIG_FILE}; name its model with "
                             f"--model PRESET (or an HF checkpoint directory of the same model)")
    return ModelConfig.from_json(p / CONFIG_FILE)


def _require(p: Path) -> None:
    if not is_torch_dist_checkpoint(p):
        raise TorchDistError(f"{p}: not a megatron-core torch_dist checkpoint (metadata.json with "
                             f"sharded_backend 'torch_dist' and a DCP .metadata file)")


def _plan(p: Path, config) -> Dict[str, torch.Tensor]:
    """``upstream key -> empty tensor`` to read, checked against ``config`` from the DCP metadata alone:
    every contract tensor present, a tensor, with the contract's shape (experts: ``[E, ...]``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _require(p)
    items = _read_metadata(p).state_dict_metadata
    E = config.n_routed_experts
    request: Dict[str, torch.Tensor] = {}
    problems = []
    for name, (shape, _dt) in wc.native_names(config).items():
        key, e = upstream_key(name)
        full = tuple(shape) if e is None else (E, *shape)
        if key in request:
            continue
        item = items.get(key)
        if item is None:
            problems.append(f"{key!r} missing")
            continue
        if not isinstance(item, TensorStorageMetadata):
            problems.append(f"{key!r} is not a tensor")
            continue
        if tuple(item.size) != full:
            problems.append(f"{key!r} has shape {tuple(item.size)}, the model needs {full}")
            continue
        request[key] = torch.empty(full, dtype=item.properties.dtype)
    if problems:
        raise TorchDistError(f"{p}: does not hold this model's tensors under upstream Megatron names: "
                             + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    return request


def check_torch_dist(path, config=None):
    """Validate a torch_dist checkpoint against ``config`` (default: its ``config.json``) from its metadata,
    reading no tensor; returns the config."""
    p = Path(path)
    _require(p)
    config = config if config is not None else torch_dist_model_config(p)
    _plan(p, config)
    return config


def load_torch_dist(path, config=None):
    """Read a torch_dist checkpoint (upstream names) -> ``(native state dict, ModelConfig)``.

    ``config``: the model; default: the folder's ``config.json``. Every contract tensor must be
    present with its contract shape; extra tensors (optimizer state, ...) are ignored, non-tensor
    entries (TE ``_extra_state``) are never unpickled."""
    from core.native_checkpoint import _quiet_single_process

    p = Path(path)
    _require(p)
    config = config if config is not None else torch_dist_model_config(p)
    request = _plan(p, config)
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.load(request, storage_reader=_reader(p), no_dist=True)
    state: Dict[str, torch.Tensor] = {}
    for name, (shape, dt) in wc.native_names(config).items():
        key, e = upstream_key(name)
        t = request[key] if e is None else request[key][e]
        if not dt.is_floating_point:
            t = t.to(dt)
        state[name] = t.contiguous()
    return state, config
