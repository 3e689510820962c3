"""Native checkpoints: the unified native state dict in torch.distributed.checkpoint (DCP).

Layout of a native checkpoint folder::

    .metadata            DCP metadata
    __0_0.distcp ...     DCP tensor data
    dsv4_native.json     {"format", "contract_version", "impl", "model_config", "num_tensors"}

The state dict is flat, ``native name -> tensor``, with the names of the weight
contract (:mod:`core.weight_contract`), so a checkpoint written by one
training implementation loads into the other. The folder is written
atomically: into a temporary sibling, renamed into place once complete
(``dsv4_native.json`` is written last).

Loading **refuses** (:class:`StaleCheckpointError`, with the re-conversion
command) a folder without ``dsv4_native.json``, one written under another
contract version, and one holding pre-contract names such as
``decoder.layers.0.self_attention.wq_a.weight`` or contract v1's
``mapping_proj.bias`` / ``mtp.layers.K.transformer_layer.`` / ``eh_proj``; the
names are checked from the DCP metadata before any tensor is read. Routed experts
stored in Megatron-Bridge's ``mlp.experts.local_experts.E.linear_fc{1,2}.weight``
form load under the contract's ``linear_fc{1,2}.weightE``.

Tensors are stored under their full shapes as DCP chunks: :func:`save_native` writes them from one process,
a tensor that tensor parallelism splits as equal chunks along its split dimension (``core.tp_layout``: a
stored chunk is the unit of reading, so a rank at ``--tp`` 2, 4 or 8 then reads only its slice), every other
tensor as one chunk; :func:`save_native_pieces` lets every rank of a run write the boxes it holds
(``core.dcp_shards``), and :func:`load_native_pieces` reads a rank's boxes, only the chunks that overlap them.
Checkpoints written with one chunk per tensor (before the chunked layout) load the same way.

Safety: DCP stores tensors in its own format and reads them with
``torch.load(weights_only=True)``; its ``.metadata`` file is a pickle, which
this module reads with an unpickler that only resolves DCP's metadata classes
and a few torch / pathlib names. Non-tensor entries (which DCP would read with
``weights_only=False``) are neither written nor read.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from core import weight_contract as wc
from core.atomic import atomic_folder, write_text_atomically
from core.errors import UserInputError

META_FILE = "dsv4_native.json"
FORMAT = "dsv4-native-dcp"
KNOWN_IMPLS = ("miles", "megatron")

__all__ = ["META_FILE", "KNOWN_IMPLS", "NativeCheckpointError", "StaleCheckpointError", "save_native",
           "load_native", "save_native_pieces", "load_native_pieces", "read_tensor_pieces", "read_native_metadata",
           "native_model_config", "is_native_checkpoint", "assert_checkpoint_is_current"]


class NativeCheckpointError(UserInputError):
    """A native checkpoint folder (or a state dict meant to become one) is invalid."""


class StaleCheckpointError(NativeCheckpointError):
    """The checkpoint predates (or postdates) the current weight contract."""


def _reconvert(impl: Optional[str]) -> str:
    return ("re-convert it from the HF checkpoint: "
            + wc.CONVERT_HINT.format(impl=impl or "<miles|megatron>"))


def _check_impl(impl) -> str:
    if not isinstance(impl, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", impl):
        raise NativeCheckpointError(f"impl must be a short name such as {KNOWN_IMPLS}, got {impl!r}")
    return impl


# ------------------------------------------------------------- DCP reading
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "device", "layout", "memory_format"} | {
        n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names DCP metadata is made of (dataclasses, dtypes, sizes, paths), plus
    ``extra_globals`` (``{module: {names}}``) a caller's writer is known to store."""

    def __init__(self, f, extra_globals: Optional[dict] = None):
        super().__init__(f)
        self.extra_globals = extra_globals or {}

    def find_class(self, module, name):
        if name in _SAFE_GLOBALS.get(module, ()) or name in self.extra_globals.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")


def _read_dcp_metadata(path: Path, extra_globals: Optional[dict] = None):
    """A DCP folder's ``.metadata``, unpickled through the allow-list only; its data files must lie inside the
    folder. ``extra_globals``: further names the writer stores (see :class:`_MetadataUnpickler`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from core.bounded_io import BoundedReadError, check_regular, open_regular

    try:
        with open_regular(path / ".metadata", what="DCP metadata") as f:     # a FIFO or device: refused, never blocks
            md = _MetadataUnpickler(f, extra_globals).load()
    except FileNotFoundError:
        raise NativeCheckpointError(f"{path}: no DCP .metadata file; not a native checkpoint") from None
    except BoundedReadError:
        raise
    except Exception as e:  # corrupt file or a global outside the allow-list
        raise NativeCheckpointError(f"{path}/.metadata: cannot read DCP metadata safely: {e}") from e
    if not isinstance(md, Metadata):
        raise NativeCheckpointError(f"{path}/.metadata: not DCP metadata ({type(md).__name__})")
    from core.path_safety import inside_folder

    for info in (getattr(md, "storage_data", None) or {}).values():  # data files must lie inside the folder
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.isabs(rel) or Path(rel).name != rel:
            raise NativeCheckpointError(f"{path}/.metadata names the data file {rel!r}, which is not a plain "
                                        f"file name inside the checkpoint folder")
        inside_folder(path, rel, what="data file")
        if os.path.lexists(path / rel):     # a rank reads only the files its slice needs: a missing one is
            check_regular(path / rel, what="data file")     # named when read; a FIFO would hang DCP's open
    return md


def _make_reader(path: Path, extra_globals: Optional[dict] = None):
    """A DCP ``FileSystemReader`` whose metadata goes through :func:`_read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = _read_dcp_metadata(Path(self.path), extra_globals)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader(str(path))


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it runs without a process group; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
        yield


# ------------------------------------------------------------ public API
def is_native_checkpoint(path) -> bool:
    """A folder with DCP metadata and ``dsv4_native.json`` (any contract version)."""
    p = Path(path)
    # present in any form (a FIFO too): read bounded later and refused by its kind, not taken for an HF folder
    return p.is_dir() and os.path.lexists(p / META_FILE) and os.path.lexists(p / ".metadata")


def read_native_metadata(path, *, impl: Optional[str] = None) -> Dict[str, Any]:
    """``dsv4_native.json`` of a checkpoint folder (refuses folders without one)."""
    p = Path(path)
    if not p.is_dir():
        raise NativeCheckpointError(f"{p}: native checkpoint folder does not exist")
    mf = p / META_FILE
    if not os.path.lexists(mf):
        if os.path.lexists(p / ".metadata"):
            raise StaleCheckpointError(
                f"{p}: DCP checkpoint without {META_FILE}: written before weight contract "
                f"v{wc.CONTRACT_VERSION} (or by another tool); {_reconvert(impl)}")
        raise NativeCheckpointError(f"{p}: not a native checkpoint (no {META_FILE} and no DCP .metadata)")
    from core.bounded_io import load_json

    try:
        meta = load_json(mf, what="native checkpoint record")
    except (OSError, ValueError) as e:
        raise NativeCheckpointError(f"{mf}: unreadable: {e}") from e
    if not isinstance(meta, dict):
        raise NativeCheckpointError(f"{mf}: must hold a JSON object")
    return meta


def assert_checkpoint_is_current(path, *, impl: Optional[str] = None) -> Dict[str, Any]:
    """Refuse a checkpoint of another contract version or with pre-contract
    names (checked from metadata only); return its ``dsv4_native.json``."""
    p = Path(path)
    meta = read_native_metadata(p, impl=impl)
    ver = meta.get("contract_version")
    if isinstance(ver, bool) or ver != wc.CONTRACT_VERSION:
        when = "a newer" if isinstance(ver, int) and ver > wc.CONTRACT_VERSION else "an older"
        raise StaleCheckpointError(
            f"{p}: written under {when if ver is not None else 'no'} weight contract "
            f"(contract_version={ver!r}, this code reads v{wc.CONTRACT_VERSION}); "
            f"{_reconvert(impl or meta.get('impl'))}")
    md = _read_dcp_metadata(p)
    stale = [(n, wc.stale_reason(wc.canonical_native_name(n))) for n in md.state_dict_metadata]
    stale = [(n, why) for n, why in stale if why]
    if stale:
        shown = "; ".join(f"{n!r} ({why})" for n, why in stale[:3])
        raise StaleCheckpointError(
            f"{p}: {len(stale)} tensor name(s) predate weight contract v{wc.CONTRACT_VERSION}, e.g. {shown}; "
            f"{_reconvert(impl or meta.get('impl'))}")
    return meta


def native_model_config(path):
    """The ModelConfig recorded in a native checkpoint, held to the tensor sizes in its DCP metadata.

    Why: the config decides how much memory the model takes; a config claiming sizes the files do not
    hold (edited, or from another model) must be refused before anything is allocated, not discovered
    after a model of that size was built."""
    from core.config import ConfigError, ModelConfig

    p = Path(path)
    meta = assert_checkpoint_is_current(p)
    try:
        config = ModelConfig.from_hf_dict(meta.get("model_config"))
    except ConfigError as e:
        raise NativeCheckpointError(f"{p}/{META_FILE}: invalid model_config: {e}") from None
    want = wc.native_names(config)
    for name, item in _read_dcp_metadata(p).state_dict_metadata.items():
        size = tuple(getattr(item, "size", ()))
        if name in want and size != tuple(want[name][0]):
            raise NativeCheckpointError(f"{p}: {META_FILE} describes a model whose tensor {name!r} has shape "
                                        f"{tuple(want[name][0])}, but the checkpoint holds {size}; the config "
                                        f"does not belong to these files")
    return config


def _architecture(config) -> dict:
    """The config without the checkpoint-storage fields: native tensors are dequantized, so
    ``expert_dtype`` / ``quantization_config`` of the HF source do not make a model different."""
    return config.replace(expert_dtype=None, quantization_config=None).to_hf_dict()


def _tp_chunked(state: Mapping[str, torch.Tensor]):
    """``{name: (shape, [(offsets, view)])}``: each tensor as the chunks :func:`core.tp_layout.tp_chunk_boxes`
    cuts it into (views of it), for :func:`core.dcp_shards.save_pieces` to store one DCP chunk each."""
    from core.tp_layout import tp_chunk_boxes

    out = {}
    for name, t in state.items():
        boxes = tp_chunk_boxes(name, t.shape)
        out[name] = (tuple(t.shape), [(off, t[tuple(slice(o, o + n) for o, n in zip(off, sizes))])
                                      for off, sizes in boxes])
    return out


def save_native(path, native_state_dict: Mapping[str, torch.Tensor], *, impl: str, config,
                overwrite: bool = False, complete: bool = True) -> Path:
    """Write ``native_state_dict`` as a native checkpoint at ``path`` (atomic).

    Every name must be a contract name of ``config`` with the contract shape
    (``complete``: and every contract tensor must be present). ``impl`` names
    the implementation that wrote it; it is recorded, not required to match
    on load. Tensors are saved as held (dtype included). A tensor that tensor parallelism splits is stored as
    equal DCP chunks along its split dimension (:func:`core.tp_layout.tp_chunk_boxes`), so a tensor-parallel
    rank loading it reads only its slice; any DCP reader still reads the folder whole.
    """
    impl = _check_impl(impl)
    out = Path(path).absolute()
    if out.exists() and not out.is_dir():
        raise NativeCheckpointError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise NativeCheckpointError(f"{out}: folder exists and is not empty (pass overwrite=True)")

    wc.check_native_state(native_state_dict.keys(), config, complete=complete)
    want = wc.native_names(config)
    state: Dict[str, torch.Tensor] = {}
    for name, t in native_state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise NativeCheckpointError(f"tensor {name!r}: only tensors can be saved, got {type(t).__name__}")
        shape, dt = want[name]
        if tuple(t.shape) != tuple(shape):
            raise NativeCheckpointError(f"tensor {name!r}: shape {tuple(t.shape)} != contract shape {shape}")
        if t.is_floating_point() != dt.is_floating_point:
            raise NativeCheckpointError(f"tensor {name!r}: dtype {t.dtype} does not match the contract ({dt})")
        state[name] = t.detach().contiguous()

    from core.dcp_shards import save_pieces

    out.parent.mkdir(parents=True, exist_ok=True)
    from core.stale_temps import remove_stale

    remove_stale(out.parent)  # temporaries of writers killed earlier
    with atomic_folder(out) as tmp:
        save_pieces(tmp, _tp_chunked(state), distributed=False)
        meta = {
            "format": FORMAT,
            "contract_version": wc.CONTRACT_VERSION,
            "impl": impl,
            "model_config": config.to_hf_dict(),
            "num_tensors": len(state),
            "complete": bool(complete),
        }
        write_text_atomically(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True))
    return out


def _checked(p: Path, impl: Optional[str], config):
    """A native checkpoint's ``(meta, DCP metadata, {contract name: stored name}, saved config)``, every stored
    tensor checked against the contract (names, shapes, completeness) from metadata only."""
    from core.config import ModelConfig
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if impl is not None:
        _check_impl(impl)
    meta = assert_checkpoint_is_current(p, impl=impl)
    try:
        saved_cfg = ModelConfig.from_hf_dict(meta.get("model_config"))
    except Exception as e:
        raise NativeCheckpointError(f"{p}/{META_FILE}: invalid model_config: {e}") from e
    if config is not None and _architecture(config) != _architecture(saved_cfg):
        changed = sorted(k for k, v in _architecture(config).items() if _architecture(saved_cfg).get(k) != v)
        raise NativeCheckpointError(
            f"{p}: checkpoint was written for a different model config than the one given (differs in: {', '.join(changed)})"
        )
    md = _read_dcp_metadata(p)
    want = wc.native_names(saved_cfg)
    stored: Dict[str, str] = {}  # contract name -> name in the file (Megatron-Bridge's local_experts form)
    for stored_name, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise NativeCheckpointError(f"{p}: entry {stored_name!r} is not a tensor; refusing to unpickle it")
        name = wc.canonical_native_name(stored_name)
        if name in stored:
            raise NativeCheckpointError(f"{p}: {stored_name!r} and {stored[name]!r} are the same tensor {name!r}")
        stored[name] = stored_name
        if name not in want:
            raise StaleCheckpointError(f"{p}: tensor {name!r} is not in the model's contract; "
                                       f"{_reconvert(impl or meta.get('impl'))}")
        if tuple(item.size) != tuple(want[name][0]):
            raise NativeCheckpointError(f"{p}: tensor {name!r} has shape {tuple(item.size)}, "
                                        f"contract shape {want[name][0]}")
    missing = [n for n in want if n not in stored]
    if missing and meta.get("complete", True):
        raise NativeCheckpointError(f"{p}: incomplete checkpoint, {len(missing)} contract tensor(s) missing, "
                                    f"e.g. {missing[:5]}")
    return meta, md, stored, saved_cfg


@contextlib.contextmanager
def _reading_tensor_data(p: Path, fix: str = ""):
    """A truncated or damaged ``.distcp`` (DCP's CheckpointException is a BaseException) becomes one
    NativeCheckpointError naming the folder; ``fix`` is appended."""
    try:
        yield
    except (NativeCheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        first = str(e).strip().splitlines()
        raise NativeCheckpointError(
            f"{p}: cannot read the tensor data ({type(e).__name__}: {first[0] if first else ''}); the .distcp "
            f"files are truncated or damaged" + (f"; {fix}" if fix else "")) from e


def load_native(path, *, impl: Optional[str] = None, config=None, device: str = "cpu",
                names=None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Load a native checkpoint: ``(state_dict, metadata)``.

    ``names``: only these contract tensors are read (a rank reads the tensors it holds: under expert
    parallelism its own experts); the whole checkpoint is still checked against the contract.

    ``impl``: the implementation loading it (any; names are unified, so a
    checkpoint written by ``miles`` loads for ``megatron`` and vice versa);
    only used in messages and recorded as ``metadata["loaded_by"]``.
    ``config``: if given, must equal the recorded model config. Refuses stale
    checkpoints (see the module docstring).
    """
    p = Path(path)
    meta, md, stored, _cfg = _checked(p, impl, config)
    keep = None if names is None else set(names)
    state: Dict[str, torch.Tensor] = {}
    for name, stored_name in stored.items():
        if keep is None or name in keep:
            item = md.state_dict_metadata[stored_name]
            state[name] = torch.empty(tuple(item.size), dtype=item.properties.dtype, device=device)

    import torch.distributed.checkpoint as dcp

    by_stored = {stored[n]: t for n, t in state.items()}
    with _reading_tensor_data(p, _reconvert(impl or meta.get("impl"))), _quiet_single_process():
        dcp.load(by_stored, storage_reader=_make_reader(p), no_dist=True)
    from core.finite import check_finite

    check_finite(state.items(), where=str(p),
                 fix="the checkpoint is damaged or was saved from a diverged run; use an earlier one")
    _check_routing(state.items(), p, _cfg)
    meta = dict(meta)
    meta["loaded_by"] = impl
    return state, meta


def save_native_pieces(path, tensors, *, impl: str, config, group=None, distributed: bool = True,
                       write_meta: bool = True) -> Path:
    """Every rank's share of a native checkpoint into the folder ``path`` (inside the caller's staging folder,
    which the caller publishes atomically once every rank returned): ``tensors`` maps contract names to
    ``(full shape, this rank's pieces)`` (:mod:`core.dcp_shards`). Collective over ``group`` (see
    :func:`core.dcp_shards.save_pieces`); the rank with ``write_meta`` writes ``dsv4_native.json`` after the
    data. Each piece is written by the rank holding it, nothing is gathered."""
    from core.dcp_shards import save_pieces

    impl = _check_impl(impl)
    out = Path(path)
    want = wc.native_names(config)
    for name, (shape, pieces) in tensors.items():
        if name not in want:
            raise NativeCheckpointError(f"tensor {name!r} is not a contract name of this model")
        if tuple(shape) != tuple(want[name][0]):
            raise NativeCheckpointError(f"tensor {name!r}: shape {tuple(shape)} != contract shape {want[name][0]}")
        for _off, t in pieces:
            if t.is_floating_point() != want[name][1].is_floating_point:
                raise NativeCheckpointError(f"tensor {name!r}: dtype {t.dtype} does not match the contract "
                                            f"({want[name][1]})")
    out.mkdir(parents=True, exist_ok=True)
    save_pieces(out, tensors, group=group, distributed=distributed)
    if write_meta:
        meta = {"format": FORMAT, "contract_version": wc.CONTRACT_VERSION, "impl": impl,
                "model_config": config.to_hf_dict(), "num_tensors": len(want), "complete": True}
        write_text_atomically(out / META_FILE, json.dumps(meta, indent=2, sort_keys=True))
    return out


def load_native_pieces(path, wanted, *, impl: Optional[str] = None, config=None) -> Dict[str, Any]:
    """Fill ``wanted`` (contract name -> this rank's pieces ``[(full offsets, tensor)]``) from a native
    checkpoint, reading only the stored chunks that overlap them (any layout's checkpoint, or whole tensors);
    checked like :func:`load_native`. Returns the checkpoint's metadata."""
    from core.dcp_shards import load_pieces

    p = Path(path)
    meta, md, stored, _cfg = _checked(p, impl, config)
    missing = sorted(n for n in wanted if n not in stored)
    if missing:
        raise NativeCheckpointError(f"{p}: {len(missing)} tensor(s) this rank holds are not in the checkpoint, "
                                    f"e.g. {missing[:3]}")
    with _reading_tensor_data(p, _reconvert(impl or meta.get("impl"))):
        load_pieces(_make_reader(p), md, {stored[n]: pieces for n, pieces in wanted.items()})
    from core.finite import check_finite

    check_finite(((f"{n}@{off}", t) for n, pieces in wanted.items() for off, t in pieces), where=str(p),
                 fix="the checkpoint is damaged or was saved from a diverged run; use an earlier one")
    _check_routing(((n, t) for n, pieces in wanted.items() for _off, t in pieces), p, _cfg)
    return dict(meta, loaded_by=impl)


def _check_routing(named, p: Path, config) -> None:
    """The hash layers' routing tables read (whole or in row slices) name existing experts, none twice in a row
    (core.routing_table)."""
    from core.routing_table import check_tid2eid, is_tid2eid

    for name, t in named:
        if is_tid2eid(name) and isinstance(t, torch.Tensor):
            check_tid2eid(name, t, config.n_routed_experts, where=p)


def read_tensor_pieces(path, wanted) -> None:
    """Fill ``wanted`` (name -> pieces) from a plain tensor folder (:func:`save_tensor_folder`, or one written
    piecewise by every rank with :func:`core.dcp_shards.save_pieces`), reading only the overlapping chunks."""
    from core.dcp_shards import load_pieces

    p = Path(path)
    have = tensor_folder_names(p)
    missing = sorted(n for n in wanted if n not in have)
    if missing:
        raise NativeCheckpointError(f"{p}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    with _reading_tensor_data(p):
        load_pieces(_make_reader(p), _read_dcp_metadata(p), wanted)


# ------------------------------------------------------- plain tensor folders
def save_tensor_folder(path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``tensors`` (name -> tensor) as a DCP folder at ``path`` (a new folder inside the caller's staging
    folder: the caller publishes it atomically). Tensors only, so reading it back never unpickles anything."""
    import torch.distributed.checkpoint as dcp

    out = Path(path)
    out.mkdir(parents=True, exist_ok=False)
    state = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise NativeCheckpointError(f"tensor {name!r}: only tensors can be saved, got {type(t).__name__}")
        state[name] = t.detach().contiguous().cpu()
    with _quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), sync_files=True), no_dist=True)
    return out


def tensor_folder_names(path) -> Dict[str, Tuple[tuple, torch.dtype]]:
    """``name -> (shape, dtype)`` of a folder written by :func:`save_tensor_folder` (metadata only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    p = Path(path)
    md = _read_dcp_metadata(p)
    out = {}
    for name, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise NativeCheckpointError(f"{p}: entry {name!r} is not a tensor; refusing to unpickle it")
        out[name] = (tuple(item.size), item.properties.dtype)
    return out


def load_tensor_folder(path, names=None) -> Dict[str, torch.Tensor]:
    """Read ``names`` (default: all) from a folder written by :func:`save_tensor_folder`: only those tensors'
    bytes are read, through the allow-listed metadata reader; damaged files are one :class:`NativeCheckpointError`."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    have = tensor_folder_names(p)
    wanted = list(have) if names is None else list(names)
    missing = [n for n in wanted if n not in have]
    if missing:
        raise NativeCheckpointError(f"{p}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    state = {n: torch.empty(have[n][0], dtype=have[n][1]) for n in wanted}
    if not state:
        return state
    with _reading_tensor_data(p), _quiet_single_process():
        dcp.load(state, storage_reader=_make_reader(p), no_dist=True)
    return state
