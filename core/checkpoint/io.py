"""Read and write official-format DeepSeek-V4 checkpoints (sharded safetensors).

Layout of a checkpoint folder::

    config.json                          HF config (ModelConfig.to_hf_dict(), format keys adjusted)
    model-00001-of-0000N.safetensors     shards, official tensor names (official_tensors.py)
    ...
    model.safetensors.index.json         {"metadata": {"total_size": <bytes>}, "weight_map": {name: file}}

A folder with a single ``model.safetensors`` and no index is also readable.

The weight format (``bf16`` / ``fp8`` / ``mxfp4-experts``) is read from
``config.json``: no ``quantization_config`` -> ``bf16``; an fp8
``quantization_config`` -> ``fp8``, or ``mxfp4-experts`` when
``expert_dtype == "fp4"``. The writer sets those keys to match the format it
writes.

Guarantees:

* :func:`open_checkpoint` validates config, index, shard headers and every
  tensor name / shape / dtype against :func:`official_tensor_specs` before any
  tensor data is read. Errors are :class:`CheckpointError` naming the tensor
  and the file.
* :meth:`CheckpointReader.iter_tensors` streams: one shard open at a time.
* :func:`write_checkpoint` is atomic: it writes into a hidden temporary folder
  next to the destination, fsyncs, then renames; on any error the temporary
  folder is removed and the destination is untouched.
* Only safetensors are ever read (no pickle, no ``torch.load``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from core.atomic import fsync_file

from .errors import CheckpointError
from .formats import fp4_dequantize, fp4_quantize, fp8_block_dequantize, fp8_block_quantize
from .official_tensors import (
    Q_FP4, Q_FP8, SCALE, WEIGHT_FORMATS, TensorSpec, dtype_itemsize, logical_specs,
    official_tensor_specs, scale_name,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000

FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# safetensors dtype strings <-> torch dtypes
ST_DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}

DtypeArg = Union[torch.dtype, Callable[[str], Optional[torch.dtype]], None]


def shard_file_name(k: int, n: int) -> str:
    """``model-0000K-of-0000N.safetensors`` (1-based, 5 digits as in HF)."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _progress(it, *, total: int, desc: str, enabled: Optional[bool]):
    disable = (not sys.stderr.isatty()) if enabled is None else (not enabled)
    return tqdm(it, total=total, desc=desc, unit="shard", file=sys.stderr, disable=disable)


# ---------------------------------------------------------------------------
# config.json <-> weight format
# ---------------------------------------------------------------------------

def hf_config_for_format(config, weight_format: str) -> dict:
    """``config.to_hf_dict()`` with ``quantization_config`` / ``expert_dtype``
    set to describe ``weight_format`` (bf16: both removed; fp8: fp8 e4m3
    128x128 ue8m0, no expert_dtype; mxfp4-experts: the same plus
    ``expert_dtype: "fp4"``)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    d = dict(config.to_hf_dict())
    d.pop("quantization_config", None)
    d.pop("expert_dtype", None)
    if weight_format != "bf16":
        d["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    if weight_format == "mxfp4-experts":
        d["expert_dtype"] = "fp4"
    return d


def weight_format_from_hf_dict(d: Mapping, *, file: str = CONFIG_FILE) -> str:
    """Inverse of :func:`hf_config_for_format` (see the module docstring)."""
    qc = d.get("quantization_config")
    ed = d.get("expert_dtype")
    if not qc:
        if ed not in (None, "bf16", "bfloat16"):
            raise CheckpointError(f"expert_dtype {ed!r} without an fp8 quantization_config is not supported",
                                  file=file)
        return "bf16"
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "fp8":
        raise CheckpointError(f"unsupported quantization_config {qc!r} (only quant_method 'fp8')", file=file)
    bs = qc.get("weight_block_size", [128, 128])
    if list(bs) != [128, 128]:
        raise CheckpointError(f"unsupported weight_block_size {bs!r} (only [128, 128])", file=file)
    if ed in (None, "fp8"):
        return "fp8"
    if ed == "fp4":
        return "mxfp4-experts"
    raise CheckpointError(f"unsupported expert_dtype {ed!r}", file=file)


# ---------------------------------------------------------------------------
# safetensors headers (parsed by hand so validation never reads tensor data)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class HeaderEntry:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offsets: Tuple[int, int]


def read_safetensors_header(path: Union[str, Path]) -> Dict[str, HeaderEntry]:
    """Parse and sanity-check a safetensors header without reading tensor data.

    Detects truncated files (data section shorter than the header claims),
    garbage headers, unknown dtypes and inconsistent offsets.
    """
    from core.bounded_io import loads_bounded, open_regular

    path = Path(path)
    fname = path.name
    try:
        with open_regular(path, what="shard") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"corrupt safetensors file: {size} bytes, too short for a header",
                                      file=fname)
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"corrupt or truncated safetensors file: header length {n} "
                                      f"does not fit in {size} bytes", file=fname)
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read shard: {e}", file=fname) from e
    try:
        hdr = loads_bounded(raw, source=path, what="safetensors header of")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt safetensors header: {e}", file=fname) from e
    if not isinstance(hdr, dict):
        raise CheckpointError("corrupt safetensors header: not a JSON object", file=fname)
    data_len = size - 8 - n
    out: Dict[str, HeaderEntry] = {}
    max_end = 0
    for name, info in hdr.items():
        if name == "__metadata__":
            continue
        try:
            dt = ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as ex:
            raise CheckpointError(f"corrupt safetensors header entry {info!r} ({ex})", tensor=name,
                                  file=fname) from None
        nbytes = math.prod(shape) * dtype_itemsize(dt)
        if b < 0 or e - b != nbytes:
            raise CheckpointError(f"corrupt safetensors header: offsets {[b, e]} do not match "
                                  f"shape {list(shape)} {info['dtype']}", tensor=name, file=fname)
        if e > data_len:
            raise CheckpointError(f"truncated shard: tensor data ends at byte {e} of a "
                                  f"{data_len}-byte data section", tensor=name, file=fname)
        max_end = max(max_end, e)
        out[name] = HeaderEntry(dt, shape, (b, e))
    if max_end != data_len:
        raise CheckpointError(f"corrupt shard: data section is {data_len} bytes but tensors cover "
                              f"{max_end}", file=fname)
    _check_no_overlap(out, fname)
    return out


def _check_no_overlap(entries: Dict[str, HeaderEntry], fname: str) -> None:
    """Tensors' byte ranges must tile the data section without overlapping (as safetensors itself demands):
    two tensors over the same bytes are a crafted or damaged header, refused by name before any read."""
    end, prev = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: kv[1].offsets):
        b = e.offsets[0]
        if b < end and e.offsets[1] > b:
            raise CheckpointError(f"corrupt safetensors header: the byte ranges of '{prev}' and '{name}' overlap "
                                  f"({b} < {end}); the shard is damaged or crafted: re-download or re-convert it",
                                  tensor=name, file=fname)
        if e.offsets[1] > b:
            end, prev = e.offsets[1], name


# ---------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------

def _check_index_entry(name: str, fname, ckpt: Path, index_file: str) -> None:
    if not isinstance(fname, str):
        raise CheckpointError(f"{index_file}: weight_map value {fname!r} is not a string", tensor=name,
                              file=index_file)
    bad = (fname in ("", ".", "..") or "/" in fname or "\\" in fname or "\0" in fname
           or os.path.isabs(fname) or Path(fname).name != fname)
    if bad:
        raise CheckpointError(f"{index_file} points outside the checkpoint folder: shard entries must be "
                              f"plain file names in {ckpt}", tensor=name, file=fname)


def _finite(name: str, t: torch.Tensor, where: Path, n_experts: Optional[int] = None) -> torch.Tensor:
    """Every tensor read from a checkpoint is refused if it holds NaN/inf (core.finite), and a hash layer's
    routing table if it names experts that do not exist or one twice (core.routing_table; ``n_experts``:
    the config's ``n_routed_experts``)."""
    from core.finite import check_finite_tensor
    from core.routing_table import check_tid2eid, is_tid2eid

    if n_experts is not None and is_tid2eid(name):
        check_tid2eid(name, t, n_experts, where=where)
    return check_finite_tensor(name, t, where=str(where),
                               fix="the checkpoint is damaged or was saved from a diverged run; use an earlier one")


class CheckpointReader:
    """A validated checkpoint folder. Holds no open files.

    Attributes: ``path``, ``config`` (ModelConfig), ``config_dict`` (raw
    config.json), ``weight_format``, ``specs`` (official_tensor_specs),
    ``weight_map`` (name -> shard file name), ``shard_files`` (ordered),
    ``headers`` (file -> name -> HeaderEntry).
    """

    def __init__(self, path, config, config_dict, weight_format, specs, weight_map, shard_files, headers):
        self.path = Path(path)
        self.config = config
        self.config_dict = config_dict
        self.weight_format = weight_format
        self.specs: Dict[str, TensorSpec] = specs
        self.weight_map: Dict[str, str] = weight_map
        self.shard_files: List[str] = shard_files
        self.headers: Dict[str, Dict[str, HeaderEntry]] = headers

    def __repr__(self) -> str:
        return (f"CheckpointReader({str(self.path)!r}, format={self.weight_format!r}, "
                f"{len(self.weight_map)} tensors in {len(self.shard_files)} shards)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    # -- what is in it ------------------------------------------------------
    def tensor_names(self) -> List[str]:
        """Stored names (``.scale`` entries included), in streaming order."""
        return [n for f in self.shard_files for n in self._names_in(f)]

    def logical_specs(self) -> Dict[str, TensorSpec]:
        """What ``iter_tensors(dequantize=True)`` yields: name -> logical spec."""
        return logical_specs(self.specs)

    def _names_in(self, fname: str) -> List[str]:
        return sorted(self.headers[fname].keys())

    # -- streaming ----------------------------------------------------------
    def iter_tensors(self, dequantize: bool = True, dtype: DtypeArg = torch.bfloat16, *,
                     names: Optional[Iterable[str]] = None,
                     progress: Optional[bool] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` shard by shard, one shard open at a time.

        ``dequantize=True``: FP8 / FP4 weights come back as ``dtype`` floats
        with their logical shape and ``.scale`` entries are dropped; other
        floating tensors stored as BF16 are cast to ``dtype``; tensors stored
        as F32 stay F32 and ``tid2eid`` stays int64. ``dtype`` may also be a
        callable ``name -> dtype``. ``dequantize=False``: stored tensors as-is
        (scales included). ``names`` restricts the output (logical names when
        dequantising). A weight whose scale sits in another shard gets it from
        a short pre-pass that reads only those scales.
        """
        wanted = None if names is None else set(names)
        if wanted is not None:
            known = set(self.logical_specs()) if dequantize else set(self.weight_map)
            unknown = sorted(wanted - known)
            if unknown:
                raise CheckpointError("no such tensor in checkpoint", tensor=unknown[0], file=str(self.path))

        def want(n: str) -> bool:
            return wanted is None or n in wanted

        def target_dtype(n: str) -> Optional[torch.dtype]:
            return dtype(n) if callable(dtype) else dtype

        stash: Dict[str, torch.Tensor] = {}
        if dequantize:
            # scales stored in a different shard than their weight: read them first (they are small)
            remote: Dict[str, List[str]] = {}
            for n, s in self.specs.items():
                if s.quant is not None and want(n):
                    sn = scale_name(n)
                    if self.weight_map[sn] != self.weight_map[n]:
                        remote.setdefault(self.weight_map[sn], []).append(sn)
            for fname in self.shard_files:
                if fname in remote:
                    with safe_open(str(self.path / fname), framework="pt") as f:
                        for sn in remote[fname]:
                            stash[sn] = f.get_tensor(sn)

        for fname in _progress(self.shard_files, total=len(self.shard_files), desc="reading shards",
                               enabled=progress):
            names_here = [n for n in self._names_in(fname)
                          if (not dequantize and want(n))
                          or (dequantize and self.specs[n].kind != SCALE and want(n))]
            if not names_here:
                continue
            with safe_open(str(self.path / fname), framework="pt") as f:
                for n in names_here:
                    t = f.get_tensor(n)
                    if not dequantize:
                        yield n, _finite(n, t, self.path / fname, self.config.n_routed_experts)
                        continue
                    spec = self.specs[n]
                    td = target_dtype(n)
                    if spec.quant is not None:
                        sn = scale_name(n)
                        sc = stash.pop(sn) if sn in stash else f.get_tensor(sn)
                        out_dtype = td or spec.logical_dtype
                        if spec.quant == Q_FP8:
                            t = fp8_block_dequantize(t, sc, dtype=out_dtype)
                        else:
                            t = fp4_dequantize(t, sc, dtype=out_dtype)
                    elif td is not None and t.is_floating_point() and t.dtype != torch.float32:
                        t = t.to(td)
                    yield n, _finite(n, t, self.path / fname, self.config.n_routed_experts)

    def get_tensor(self, name: str, dequantize: bool = True, dtype: DtypeArg = torch.bfloat16) -> torch.Tensor:
        """One tensor (opens at most two shards, one after the other)."""
        for _, t in self.iter_tensors(dequantize, dtype, names=[name], progress=False):
            return t
        raise CheckpointError("no such tensor in checkpoint", tensor=name, file=str(self.path))


def _load_json(path: Path, what: str):
    from core.bounded_io import load_json

    if not os.path.lexists(path):
        raise CheckpointError(f"{what} not found in {path.parent}", file=path.name) from None
    try:
        return load_json(path, what=what)
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found in {path.parent}", file=path.name) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"malformed JSON in {what}: {e}", file=path.name) from e
    except OSError as e:
        raise CheckpointError(f"cannot read {what}: {e}", file=path.name) from e


def open_checkpoint(path, *, weight_format: Optional[str] = None, config=None) -> CheckpointReader:
    """Open and fully validate a checkpoint folder (no tensor data is read).

    ``weight_format`` overrides the one derived from config.json; ``config``
    (a ModelConfig) overrides config.json's architecture (config.json must
    still be valid JSON).
    """
    from core.bounded_io import check_regular
    from core.config import ConfigError, ModelConfig
    from core.path_safety import inside_folder

    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError("checkpoint folder does not exist", file=str(ckpt))

    # 1. config.json
    cfg_dict = _load_json(ckpt / CONFIG_FILE, "checkpoint config")
    if not isinstance(cfg_dict, dict):
        raise CheckpointError("config must be a JSON object", file=CONFIG_FILE)
    if config is None:
        try:
            config = ModelConfig.from_hf_dict(cfg_dict)
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"invalid config: {e}", file=CONFIG_FILE) from e
    fmt = weight_format or weight_format_from_hf_dict(cfg_dict)
    try:
        specs = official_tensor_specs(config, fmt)
    except ValueError as e:
        raise CheckpointError(f"config does not describe a valid model: {e}", file=CONFIG_FILE) from e

    # 2. index (or a single model.safetensors)
    index_path = ckpt / INDEX_FILE
    if index_path.exists():
        index = _load_json(index_path, "checkpoint index")
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError("index has no 'weight_map' object", file=INDEX_FILE)
        for name, fname in wm.items():
            _check_index_entry(name, fname, ckpt, INDEX_FILE)
        weight_map = dict(wm)
        index_name = INDEX_FILE
    elif (ckpt / SINGLE_FILE).is_file():
        weight_map = None
        index_name = SINGLE_FILE
    else:
        raise CheckpointError(f"neither {INDEX_FILE} nor {SINGLE_FILE} found", file=str(ckpt))

    # 3. shard headers
    shard_files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    headers: Dict[str, Dict[str, HeaderEntry]] = {}
    for fname in shard_files:
        p = ckpt / fname
        if not os.path.exists(p):
            some = next(n for n, v in weight_map.items() if v == fname)
            raise CheckpointError("shard listed in the index does not exist", tensor=some, file=fname)
        check_regular(p, what="shard")      # a FIFO or a device: refused by its kind, never opened blocking
        inside_folder(ckpt, fname, what="shard")  # a symlink out of the folder is not followed
        headers[fname] = read_safetensors_header(p)
    if weight_map is None:
        weight_map = {n: SINGLE_FILE for n in headers[SINGLE_FILE]}
    for fname, hdr in headers.items():
        for n in hdr:
            if weight_map.get(n) != fname:
                where = weight_map.get(n)
                raise CheckpointError(
                    f"tensor is stored in this shard but the index "
                    f"{'does not list it' if where is None else 'maps it to ' + repr(where)}",
                    tensor=n, file=fname)
    for n, fname in weight_map.items():
        if n not in headers[fname]:
            raise CheckpointError(f"{index_name} maps the tensor to this shard but the shard does not "
                                  f"contain it", tensor=n, file=fname)

    # 4. names / shapes / dtypes against the official table
    for fname in shard_files:
        for n, e in headers[fname].items():
            spec = specs.get(n)
            if spec is None:
                raise CheckpointError(f"unknown tensor: not part of the official {fmt} layout for this config",
                                      tensor=n, file=fname)
            if e.shape != spec.shape:
                raise CheckpointError(f"wrong shape {list(e.shape)}, expected {list(spec.shape)}",
                                      tensor=n, file=fname)
            if e.dtype not in spec.accepted_dtypes:
                raise CheckpointError(f"wrong dtype {TORCH_TO_ST.get(e.dtype, e.dtype)}, expected "
                                      f"{' or '.join(TORCH_TO_ST[d] for d in spec.accepted_dtypes)}",
                                      tensor=n, file=fname)
    for n, spec in specs.items():
        if n in weight_map:
            continue
        if spec.kind == SCALE:
            w = spec.scale_of
            raise CheckpointError(f"missing scale tensor {n!r} for the {specs[w].quant.upper()} weight {w!r}",
                                  tensor=w, file=weight_map.get(w, index_name))
        raise CheckpointError("missing tensor: required by the official layout but not in the checkpoint",
                              tensor=n, file=index_name)

    order = {f: i for i, f in enumerate(shard_files)}
    return CheckpointReader(ckpt, config, cfg_dict, fmt, specs, weight_map,
                            sorted(shard_files, key=order.__getitem__), headers)


def load_into(model: torch.nn.Module, reader: CheckpointReader, *,
              rename: Optional[Callable[[str], str]] = None, progress: Optional[bool] = None) -> None:
    """Copy a checkpoint into ``model.state_dict()`` (strict).

    Names (after ``rename``) must match the state dict exactly and logical
    shapes must match; both are checked before any data is read. Values are
    dequantised straight to each target tensor's dtype and copied in place.
    """
    sd = model.state_dict()
    rename = rename or (lambda n: n)
    lspecs = reader.logical_specs()
    mapped = {rename(n): n for n in lspecs}
    index = str(reader.path / INDEX_FILE)
    missing = sorted(set(sd) - set(mapped))
    unexpected = sorted(set(mapped) - set(sd))
    if missing:
        raise CheckpointError(f"model tensor missing from the checkpoint ({len(missing)} in all)",
                              tensor=missing[0], file=index)
    if unexpected:
        n = mapped[unexpected[0]]
        raise CheckpointError(f"checkpoint tensor has no place in the model ({len(unexpected)} in all)",
                              tensor=unexpected[0], file=reader.weight_map[n])
    for mn, cn in mapped.items():
        if tuple(sd[mn].shape) != lspecs[cn].logical_shape:
            raise CheckpointError(f"shape {list(lspecs[cn].logical_shape)} does not fit model tensor "
                                  f"{mn!r} of shape {list(sd[mn].shape)}", tensor=cn, file=reader.weight_map[cn])

    def dtype_for(n: str):
        t = sd[rename(n)]
        return t.dtype if t.is_floating_point() else None

    with torch.no_grad():
        for n, t in reader.iter_tensors(dequantize=True, dtype=dtype_for, progress=progress):
            sd[rename(n)].copy_(t)


# ---------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------

def _own_storage(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def _encode(name: str, t, spec: Optional[TensorSpec], quantize: bool, where: str):
    """Validate one input tensor, returning the stored ``[(name, tensor), ...]``."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"expected a torch.Tensor, got {type(t).__name__}", tensor=name, file=where)
    if spec is None:
        raise CheckpointError("unknown tensor: not part of the official layout for this config/format",
                              tensor=name, file=where)
    if not quantize:
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"wrong shape {list(t.shape)}, expected {list(spec.shape)}", tensor=name,
                                  file=where)
        if t.dtype not in spec.accepted_dtypes:
            raise CheckpointError(f"wrong dtype {t.dtype}, expected {spec.dtype}", tensor=name, file=where)
        return [(name, t)]
    if spec.kind == SCALE:
        raise CheckpointError("quantize=True takes logical tensors; scales are computed, not given",
                              tensor=name, file=where)
    if tuple(t.shape) != spec.logical_shape:
        raise CheckpointError(f"wrong shape {list(t.shape)}, expected {list(spec.logical_shape)}",
                              tensor=name, file=where)
    if spec.dtype.is_floating_point != t.dtype.is_floating_point and spec.quant is None:
        raise CheckpointError(f"wrong dtype {t.dtype}, expected {spec.dtype}", tensor=name, file=where)
    if spec.quant == Q_FP8:
        q, s = fp8_block_quantize(t, scale_fmt="ue8m0")
        return [(name, q), (scale_name(name), s)]
    if spec.quant == Q_FP4:
        q, s = fp4_quantize(t)
        return [(name, q), (scale_name(name), s)]
    return [(name, t.to(spec.dtype))]


def write_checkpoint(out_dir, config, tensors: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
                     *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, weight_format: str = "bf16",
                     quantize: bool = False, overwrite: bool = False,
                     extra_files: Optional[Mapping[str, Union[str, bytes]]] = None,
                     progress: Optional[bool] = None) -> Path:
    """Write an official-format checkpoint atomically and return its path.

    ``tensors``: a mapping or an iterable of ``(name, tensor)`` (consumed
    once, streamed into shards of at most ``max_shard_bytes``; a tensor larger
    than that gets a shard of its own). With ``quantize=False`` the tensors
    must already be in the stored format (FP8 weights plus their ``.scale``,
    ...); with ``quantize=True`` they are logical tensors (what
    ``iter_tensors(dequantize=True)`` yields) and the writer quantises to
    ``weight_format`` (ue8m0 scales) and casts the rest to the stored dtypes.
    A ``.scale`` is kept in the same shard as its weight when it follows it.

    ``extra_files``: more files (name -> text/bytes, plain names) to include,
    e.g. a tokenizer. ``overwrite``: replace an existing non-empty folder
    (swapped in by rename). Anything invalid (unknown / duplicate / missing
    tensor, wrong shape or dtype) raises :class:`CheckpointError` and leaves
    nothing behind.
    """
    out = Path(out_dir).absolute()
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    specs = official_tensor_specs(config, weight_format)
    cfg_dict = hf_config_for_format(config, weight_format)
    if out.exists() and not out.is_dir():
        raise CheckpointError("destination exists and is not a folder", file=str(out))
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError("destination folder exists and is not empty (pass overwrite=True)", file=str(out))
    for fn in (extra_files or {}):
        if fn in (CONFIG_FILE, INDEX_FILE) or Path(fn).name != fn or fn.startswith("model-"):
            raise ValueError(f"extra file name {fn!r} is not allowed")

    out.parent.mkdir(parents=True, exist_ok=True)
    from core.stale_temps import remove_stale

    remove_stale(out.parent)  # temporaries of writers killed earlier
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        seen: set = set()
        shards: List[List[str]] = []
        cur: Dict[str, torch.Tensor] = {}
        cur_bytes = 0
        total = 0
        weight_map: Dict[str, int] = {}

        def flush():
            nonlocal cur, cur_bytes
            if cur:
                k = len(shards)
                save_file(cur, str(tmp / f"shard-{k:05d}.partial"), metadata={"format": "pt"})
                shards.append(list(cur))
                cur, cur_bytes = {}, 0

        where = str(out)
        n_inputs = sum(1 for s in specs.values() if s.kind != SCALE) if quantize else len(specs)
        disable = (not sys.stderr.isatty()) if progress is None else (not progress)
        bar = tqdm(total=n_inputs, desc="writing tensors", unit="tensor", file=sys.stderr, disable=disable)
        for name, t in items:
            bar.update(1)
            for sn, st in _encode(name, t, specs.get(name), quantize, where):
                if sn in seen:
                    raise CheckpointError("tensor given twice", tensor=sn, file=where)
                seen.add(sn)
                st = _own_storage(st)
                nb = st.numel() * st.element_size()
                spec = specs[sn]
                keep_with_weight = spec.kind == SCALE and spec.scale_of in cur
                if cur and cur_bytes + nb > max_shard_bytes and not keep_with_weight:
                    flush()
                cur[sn] = st
                cur_bytes += nb
                total += nb
                weight_map[sn] = len(shards)
        flush()
        bar.close()

        missing = [n for n in specs if n not in seen]
        if missing:
            n = missing[0]
            s = specs[n]
            if s.kind == SCALE and s.scale_of in seen:
                raise CheckpointError(f"missing scale tensor {n!r} for the {specs[s.scale_of].quant.upper()} "
                                      f"weight", tensor=s.scale_of, file=where)
            raise CheckpointError(f"missing tensor ({len(missing)} missing in all)", tensor=n, file=where)

        n_sh = len(shards)
        names = [shard_file_name(k + 1, n_sh) for k in range(n_sh)]
        for k in range(n_sh):
            os.replace(tmp / f"shard-{k:05d}.partial", tmp / names[k])
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: names[weight_map[n]] for n in sorted(weight_map)}}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg_dict, indent=2) + "\n")
        for fn, content in (extra_files or {}).items():
            data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
            (tmp / fn).write_bytes(data)
        for p in tmp.iterdir():
            fsync_file(p)
        fsync_file(tmp)

        old = None
        if out.exists():
            if any(out.iterdir()):
                old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.replace(out, old)
            else:
                out.rmdir()
        os.replace(tmp, out)
        fsync_file(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
