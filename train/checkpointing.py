"""Training checkpoints: atomic, every N steps, enough to resume bit-for-bit.

Layout::

    RUN_DIR/checkpoints/step_000004/
        model/          native checkpoint (core.native_checkpoint.save_native: contract names, DCP), FULL tensors
        optim/          optimizer state as a torch.distributed.checkpoint folder of FULL tensors:
                        "<parameter>/exp_avg", "<parameter>/exp_avg_sq" (+ "<parameter>/master", the fp32 master
                        weights of a bf16 run); optim.json: {"steps": {parameter: Adam's step count}, "optimizer": the build}
        rng.safetensors + rng.json       torch CPU RNG state (+ CUDA states when present), Python's random state
        state.json      {"step": 4, "complete": true, "layout": {...}}  (written last, inside the folder)
    RUN_DIR/checkpoints/latest   "step_000004"  (replaced atomically after the folder is in place)

Layouts: on several ranks the full tensors are gathered (tensor-parallel slices, every expert-parallel rank's
experts, the distributed optimizer's data-parallel ranges; :meth:`train.optim.TorchOptimizer.full_state`) and
global rank 0 writes the folder; loading, each rank reads the model and the optimizer tensors of the
parameters it holds and keeps its share, so a run resumes onto ANY layout (another world size, tp, cp or ep).
Gathering to one rank bounds the model size by rank 0's host memory (fine for the presets up to
``flash-shaped``; sharded writes per rank are the next step for full-size models).

A checkpoint folder is assembled under a temporary name and renamed into place, so a kill at any
moment leaves either the previous complete checkpoint or the new one. Data order and sampling seeds
are functions of (seed, step) (see :mod:`train.data`), so the step number restores them; the RNG states
are saved as well for anything that draws from the global generators. Nothing here is ever unpickled: a run
folder may come from anywhere, and unpickling runs code (pickles of older versions are refused by name).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple


from core.atomic import fsync_file, write_text_atomically

from . import state_io

CKPT_DIR = "checkpoints"
OPTIM_DIR = "optim"
OPTIM_META = state_io.OPTIM_JSON      # one name: state_io.refuse_legacy looks for it
OPTIM_FORMAT = "dsv4-optim-full-v1"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def save_checkpoint(run_dir, step: int, train_model, optimizer, extra: Optional[Dict] = None,
                    keep_last: int = 2, groups=None) -> Optional[Path]:
    """Collective on several ranks (``groups``: :class:`train.distributed.ParallelGroups`): every rank gathers,
    rank 0 writes; returns the folder on rank 0, None elsewhere."""
    from .model import full_view

    view = full_view(train_model, groups)
    optim_state, optim_step = optimizer.full_state()
    written = None
    if groups is None or groups.is_main:
        written = _write(run_dir, step, view, optimizer, optim_state, optim_step, extra, keep_last)
    if groups is not None:
        groups.barrier()
    return written


def _write(run_dir, step, train_model, optimizer, optim_state, optim_step, extra, keep_last) -> Path:
    from core.atomic import atomic_folder
    from core.native_checkpoint import save_native, save_tensor_folder

    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    from converters.staging import check_disk_space
    from core.stale_temps import remove_stale

    remove_stale(root)  # temporaries of a run killed earlier
    need = sum(t.numel() * t.element_size() for _, t in train_model.native_tensors())
    need += sum(t.numel() * t.element_size() for t in optim_state.values())
    check_disk_space(root, need)  # weights + optimizer state, before anything is written
    name = f"step_{step:06d}"
    final = root / name
    with atomic_folder(final) as tmp:    # a leftover final folder (an earlier run got past this step) is replaced
        native = {n: t.detach() for n, t in train_model.native_tensors()}
        save_native(tmp / "model", native, impl=getattr(train_model, "impl", "reference"),
                    config=train_model.config)
        save_tensor_folder(tmp / OPTIM_DIR, optim_state)
        with open(tmp / OPTIM_META, "w") as f:
            json.dump({"steps": {n: int(v) for n, v in optim_step.items()}, "optimizer": optimizer.kind,
                       "format": OPTIM_FORMAT}, f, sort_keys=True)
        state_io.save_rng(tmp)
        with open(tmp / "state.json", "w") as f:
            json.dump({"step": step, "complete": True, **(extra or {})}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for p in tmp.iterdir():
            if p.is_file():
                fsync_file(p)
    write_text_atomically(root / LATEST, name + "\n")
    _prune(root, keep_last, keep=name)
    return final


def _complete(p: Path) -> Optional[int]:
    try:
        st = json.loads((p / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return int(st["step"]) if st.get("complete") else None


def _prune(root: Path, keep_last: int, keep: str) -> None:
    steps = sorted((p for p in root.iterdir() if _STEP_RE.match(p.name)), key=lambda p: p.name)
    for p in steps[:-keep_last] if keep_last > 0 else []:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # temporaries of killed writers
        if p.name.startswith(".step_") and ".tmp-" in p.name:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir) -> Optional[Tuple[int, Path]]:
    """The last COMPLETE checkpoint ``(step, folder)``, or None."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return None
    try:
        name = (root / LATEST).read_text().strip()
        step = _complete(root / name)
        if step is not None:
            return step, root / name
    except OSError:
        pass
    best = None
    for p in root.iterdir():
        if _STEP_RE.match(p.name):
            s = _complete(p)
            if s is not None and (best is None or s > best[0]):
                best = (s, p)
    return best


def load_checkpoint(folder, train_model, optimizer=None, *, restore_rng: bool = True) -> Dict:
    from core.native_checkpoint import load_native

    from core.native_checkpoint import load_tensor_folder

    folder = Path(folder)
    held = getattr(train_model, "held_native_names", lambda: None)()
    state, _meta = load_native(folder / "model", config=train_model.config, names=held)   # this rank's tensors
    train_model.load_native_state(state)
    del state
    if optimizer is not None:
        state_io.refuse_legacy(folder)
        meta = _optim_meta(folder)
        optimizer.load_full_state(lambda names: load_tensor_folder(folder / OPTIM_DIR, names), meta["steps"])
    if restore_rng:
        state_io.load_rng(folder)
    return json.loads((folder / "state.json").read_text())


def _optim_meta(folder: Path) -> Dict:
    from .state_io import TrainingStateError

    try:
        meta = json.loads((folder / OPTIM_META).read_text())
    except FileNotFoundError:
        raise TrainingStateError(f"{folder}: no {OPTIM_META}: this checkpoint's optimizer state was written by an "
                                 f"earlier version; resume is not possible. Fix: start a new run from its weights "
                                 f"with --model {folder / 'model'}") from None
    except (OSError, ValueError) as e:
        raise TrainingStateError(f"{folder / OPTIM_META}: unreadable ({e})") from None
    steps = meta.get("steps") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != OPTIM_FORMAT or not isinstance(steps, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in steps.items()):
        raise TrainingStateError(f"{folder / OPTIM_META}: not a {OPTIM_FORMAT} record")
    return meta
