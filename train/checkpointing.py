"""Training checkpoints: atomic, every N steps, enough to resume bit-for-bit, written by every rank.

Layout::

    RUN_DIR/checkpoints/step_000004/
        model/          native checkpoint (core.native_checkpoint: contract names, DCP, dsv4_native.json)
        optim/          optimizer state, a torch.distributed.checkpoint folder: "<parameter>/exp_avg",
                        "<parameter>/exp_avg_sq" (+ "<parameter>/master", the fp32 master weights of a bf16 run)
        optim.json      {"steps": {parameter: Adam's step count}, "optimizer": the build, "format"}
        rng.safetensors + rng.json       torch CPU RNG state (+ CUDA states when present), Python's random state
        state.json      {"step": 4, "complete": true, "layout": {...}}  (written last, inside the folder)
    RUN_DIR/checkpoints/latest   "step_000004"  (replaced atomically after the folder is in place)

Sharded writes: ``model/`` and ``optim/`` hold each tensor under its FULL shape as DCP chunks, and every rank
writes the chunks it holds, in parallel, into its own ``__<rank>_<n>.distcp`` files (``core.dcp_shards``):
its tensor-parallel slices, its experts, and its data-parallel range of the distributed optimizer's fp32
state (:meth:`train.optim.TorchOptimizer.shard_state`); a piece several ranks hold (a replicated tensor) is
written once. Nothing is gathered, so no rank needs more memory than its own share. DCP's coordinator
(global rank 0) writes each folder's ``.metadata`` once every rank is done. Loading, each rank reads only the
stored chunks that overlap its own pieces, so a run resumes onto ANY layout (another world size, tp, cp or
ep) and reads about its share of the bytes; checkpoints of earlier versions, which stored whole tensors,
load the same way (one chunk per tensor). ``dsv4 export`` and ``--model CKPT/model`` read ``model/`` as any
native checkpoint.

Atomicity: global rank 0 creates the folder under a temporary name, every rank writes into it (the run
folder must be on a file system every node sees), and rank 0 renames it into place only after every rank's
write returned and its own small files are written; a kill of any rank at any moment (the others then
fail in the next collective) leaves the previous complete checkpoint and ``latest`` as they were. Data
order and sampling seeds are functions of (seed, step) (see :mod:`train.data`), so the step number restores
them; rank 0's RNG states are saved as well for anything that draws from the global generators. Nothing
here is ever unpickled: a run folder may come from anywhere, and unpickling runs code (DCP's ``.metadata``
goes through ``core.native_checkpoint``'s allow-list; pickles of older versions are refused by name).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

from core.atomic import fsync_file, write_text_atomically
from core.errors import UserInputError

from . import state_io

CKPT_DIR = "checkpoints"
OPTIM_DIR = "optim"
OPTIM_META = state_io.OPTIM_JSON      # one name: state_io.refuse_legacy looks for it
OPTIM_FORMAT = "dsv4-optim-sharded-v2"
OPTIM_FORMATS = ("dsv4-optim-full-v1", OPTIM_FORMAT)   # v1 stored whole tensors: the same reader loads both
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def save_checkpoint(run_dir, step: int, train_model, optimizer, extra: Optional[Dict] = None,
                    keep_last: int = 2, groups=None) -> Optional[Path]:
    """Collective on several ranks (``groups``: :class:`train.distributed.ParallelGroups`): every rank writes
    its pieces, rank 0 publishes the folder; returns the folder on rank 0, None elsewhere."""
    from .distributed import ParallelGroups

    groups = groups or ParallelGroups()
    model = train_model.native_shards()
    optim, optim_step = optimizer.shard_state()        # collective under expert parallelism (step counts)
    root = Path(run_dir) / CKPT_DIR
    name = f"step_{step:06d}"
    with contextlib.ExitStack() as stack:
        tmp = error = None
        if groups.is_main:
            try:
                tmp = stack.enter_context(_staging(root, name, train_model, model, optim))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                groups.broadcast_world((None, error))
                raise
        tmp, error = groups.broadcast_world((None if tmp is None else str(tmp), error))
        if error is not None:
            raise RuntimeError(f"rank 0 could not start checkpoint {name}: {error}")
        _write_shards(Path(tmp), train_model, model, optim, groups)
        if groups.is_main:
            _write_small_files(Path(tmp), step, optimizer, optim_step, extra)
    # the folder is in place (rank 0 left atomic_folder); every rank's data was written before
    if groups.is_main:
        write_text_atomically(root / LATEST, name + "\n")
        _prune(root, keep_last, keep=name)
    groups.barrier()
    return root / name if groups.is_main else None


@contextlib.contextmanager
def _staging(root: Path, name: str, train_model, model, optim):
    """Rank 0: the temporary folder every rank writes into, renamed to ``root/name`` when the block ends
    without an error (``core.atomic.atomic_folder``); free disk space is checked first."""
    from converters.staging import check_disk_space
    from core.atomic import atomic_folder
    from core.stale_temps import remove_stale

    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)  # temporaries of a run killed earlier
    check_disk_space(root, _full_bytes(train_model, model, optim))
    with atomic_folder(root / name) as tmp:   # a leftover final folder (an earlier run got past this step) is replaced
        yield tmp


def _full_bytes(train_model, model, optim) -> int:
    """A bound on the whole checkpoint (every rank's share, replicas once) that rank 0 can compute alone:
    every contract tensor at the widest dtype this rank holds, plus 4 bytes per element per optimizer key."""
    import math

    from core import weight_contract as wc

    numel = sum(math.prod(shape) for shape, _dt in wc.native_names(train_model.config).values())
    itemsize = max((t.element_size() for _s, pieces in model.values() for _o, t in pieces), default=4)
    keys = {k.rsplit("/", 1)[1] for k in optim}
    return numel * (itemsize + 4 * len(keys))


def _write_shards(tmp: Path, train_model, model, optim, groups) -> None:
    """Every rank: its pieces of the model and of the optimizer state (collective over every rank)."""
    from core.dcp_shards import save_pieces
    from core.native_checkpoint import save_native_pieces

    group, distributed = groups.checkpoint_group(), groups.world > 1
    save_native_pieces(tmp / "model", model, impl=getattr(train_model, "impl", "reference"),
                       config=train_model.config, group=group, distributed=distributed, write_meta=groups.is_main)
    (tmp / OPTIM_DIR).mkdir(exist_ok=True)
    save_pieces(tmp / OPTIM_DIR, optim, group=group, distributed=distributed)


def _write_small_files(tmp: Path, step: int, optimizer, optim_step, extra) -> None:
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


def _complete(p: Path) -> Optional[int]:
    """The step of a complete checkpoint folder; None for anything else (a missing, damaged or foreign
    ``state.json``: read bounded, never trusted)."""
    from core.bounded_io import load_json

    try:
        st = load_json(p / "state.json", what="checkpoint state")
    except (OSError, ValueError, UserInputError):
        return None
    if not isinstance(st, dict) or st.get("complete") is not True:
        return None
    step = st.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return step


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """Remove all but the newest ``keep_last`` step folders, after ``keep`` (the new one) is complete and in
    place; only real folders inside ``root`` (a link out of it is never followed, nor removed)."""
    real_root = os.path.realpath(root)
    steps = sorted((p for p in root.iterdir() if _STEP_RE.match(p.name) and not p.is_symlink() and p.is_dir()
                    and os.path.dirname(os.path.realpath(p)) == real_root), key=lambda p: p.name)
    if keep not in {p.name for p in steps} or _complete(root / keep) is None:
        return                     # the new checkpoint is not complete in place: nothing is removed
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
    """This rank's share of a checkpoint written by any layout (no communication: each rank reads alone).
    Every weight of ``train_model`` must be written by it (``core.finite.check_written``: a model built without
    random init starts NaN)."""
    from core.finite import check_written
    from core.native_checkpoint import load_native, read_tensor_pieces

    folder = Path(folder)
    if hasattr(train_model, "load_native_shards"):          # an implementation: its pieces, read in place
        train_model.load_native_shards(folder / "model")
    else:                                                   # the one-process reference model: everything
        state, _meta = load_native(folder / "model", config=train_model.config)
        train_model.load_native_state(state)
        del state
    check_written(train_model, source=f"training checkpoint {folder}")
    if optimizer is not None:
        state_io.refuse_legacy(folder)
        meta = _optim_meta(folder)
        optimizer.load_shard_state(lambda wanted: read_tensor_pieces(folder / OPTIM_DIR, wanted), meta["steps"])
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
    if not isinstance(meta, dict) or meta.get("format") not in OPTIM_FORMATS or not isinstance(steps, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in steps.items()):
        raise TrainingStateError(f"{folder / OPTIM_META}: not a {' or '.join(OPTIM_FORMATS)} record")
    return meta
