"""Shared plumbing of the checkpoint converters: layout, scale lookup, shard writer.

Everything here streams: one input shard is open at a time, and only the
(small) scale tensors that live in a different shard than their weight are
read ahead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from core.checkpoint.errors import CheckpointError
from core.checkpoint.io import (
    CONFIG_FILE, INDEX_FILE, SINGLE_FILE, HeaderEntry, read_safetensors_header, shard_file_name,
)

from .staging import SENTINEL

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def progress(it, *, total: int, desc: str, unit: str = "shard", enabled: Optional[bool] = None):
    """tqdm on stderr; on by default only when stderr is a terminal."""
    disable = (not sys.stderr.isatty()) if enabled is None else (not enabled)
    return tqdm(it, total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable)


class Layout:
    """Index / shard headers / config.json of a safetensors checkpoint folder
    (no tensor data read; no check against the official table)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError("checkpoint folder does not exist", file=str(self.path))
        cfg = self.path / CONFIG_FILE
        from core.bounded_io import load_json

        try:
            self.config_dict = load_json(cfg, what="config file")
        except FileNotFoundError:
            raise CheckpointError("config.json not found", file=str(cfg)) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"malformed JSON: {e}", file=str(cfg)) from e
        idx = self.path / INDEX_FILE
        if idx.exists():
            try:
                wm = load_json(idx, what="checkpoint index")["weight_map"]
            except (KeyError, TypeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"malformed index: {e!r}", file=str(idx)) from e
            self.weight_map: Dict[str, str] = dict(wm)
            files = sorted(set(self.weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
            self.weight_map = {}
        else:
            raise CheckpointError(f"neither {INDEX_FILE} nor {SINGLE_FILE} found", file=str(self.path))
        for f in files:
            if Path(f).name != f:
                raise CheckpointError("index points outside the checkpoint folder", file=f)
        self.shard_files: List[str] = files
        self.headers: Dict[str, Dict[str, HeaderEntry]] = {
            f: read_safetensors_header(self.path / f) for f in files}
        if not self.weight_map:
            self.weight_map = {n: f for f in files for n in self.headers[f]}

    def entry(self, name: str) -> HeaderEntry:
        return self.headers[self.weight_map[name]][name]

    def names_in(self, fname: str) -> List[str]:
        return sorted(self.headers[fname])

    def total_bytes(self) -> int:
        return sum(e.offsets[1] - e.offsets[0] for h in self.headers.values() for e in h.values())


def weight_base(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def find_scale_name(layout: Layout, weight: str) -> str:
    """The stored name of ``weight``'s scale; raises ``KeyError`` when absent."""
    base = weight_base(weight)
    for suf in SCALE_SUFFIXES:
        if base + suf in layout.weight_map:
            return base + suf
    raise KeyError(weight)


class ScaleLookup:
    """Gets the scale of a quantised weight: from the open shard, or from a
    small read-ahead of scales stored in other shards.

    :meth:`get` is the only place a missing scale is detected; it raises
    :class:`CheckpointError` naming the weight (a hard error, never skipped).
    """

    def __init__(self, layout: Layout, weights: Iterable[str]):
        self.layout = layout
        self.scale_of: Dict[str, str] = {}
        self._missing: Dict[str, bool] = {}
        remote: Dict[str, List[str]] = {}
        for w in weights:
            try:
                sn = find_scale_name(layout, w)
            except KeyError:
                self._missing[w] = True
                continue
            self.scale_of[w] = sn
            if layout.weight_map[sn] != layout.weight_map[w]:
                remote.setdefault(layout.weight_map[sn], []).append(sn)
        self._stash: Dict[str, torch.Tensor] = {}
        for fname, names in remote.items():
            with safe_open(str(layout.path / fname), framework="pt") as f:
                for sn in names:
                    self._stash[sn] = f.get_tensor(sn)

    def consumed_scales(self) -> set:
        return set(self.scale_of.values())

    def get(self, weight: str, open_file) -> torch.Tensor:
        try:
            sn = self.scale_of[weight]
        except KeyError:
            raise CheckpointError(
                f"missing scale tensor for the quantized weight (looked for "
                f"{', '.join(weight_base(weight) + s for s in SCALE_SUFFIXES)})",
                tensor=weight, file=self.layout.weight_map.get(weight)) from None
        if sn in self._stash:
            return self._stash.pop(sn)
        return open_file.get_tensor(sn)


def _own(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


class ShardWriter:
    """Writes output shards into ``out_dir`` (one per :meth:`write` call that
    has tensors), then names them ``model-K-of-N`` and writes the index."""

    def __init__(self, out_dir):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._parts: List[Tuple[Path, List[str]]] = []
        self.total = 0

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            return
        d = {n: _own(t) for n, t in tensors.items()}
        p = self.out / f"part-{len(self._parts):05d}.partial"
        save_file(d, str(p), metadata={"format": "pt"})
        self.total += sum(t.numel() * t.element_size() for t in d.values())
        self._parts.append((p, list(d)))

    def finish(self) -> Dict[str, str]:
        n = len(self._parts)
        wm: Dict[str, str] = {}
        for k, (p, names) in enumerate(self._parts):
            fn = shard_file_name(k + 1, n)
            os.replace(p, self.out / fn)
            for name in names:
                if name in wm:
                    raise CheckpointError("tensor written twice", tensor=name, file=fn)
                wm[name] = fn
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: wm[k] for k in sorted(wm)}}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return wm


def copy_side_files(src, dst) -> List[str]:
    """Copy every top-level regular file that is not a shard, the index, the
    config or a staging sentinel (tokenizer*, chat_template*, generation
    config, *.py, README, ...). Returns the copied names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith(".safetensors") or p.name in (INDEX_FILE, CONFIG_FILE, SENTINEL):
            continue
        if p.name.startswith("."):
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def write_config(dst, config_dict: Mapping) -> None:
    (Path(dst) / CONFIG_FILE).write_text(json.dumps(dict(config_dict), indent=2) + "\n")


def file_digest(path) -> Optional[str]:
    """sha256 of a small file (index / config) for stage inputs; None if absent."""
    import hashlib
    p = Path(path)
    if not p.is_file():
        return None
    return hashlib.sha256(p.read_bytes()).hexdigest()


def resolve_device(device) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")
