"""Training state other than the weights and the optimizer (RNG, reference weights) as safetensors + JSON,
never pickle.

Why: a run folder is data a user may have copied from anywhere; ``--resume``
used to ``torch.load(weights_only=False)`` its ``optim.pt`` and ``rng.pt``,
so a crafted file in a run folder ran code. Here every tensor goes into a
``.safetensors`` file (a JSON header plus raw bytes: nothing is executed on
read) and everything else (Python's ``random`` state) into a ``.json`` file;
the optimizer state is a DCP tensor folder (:mod:`train.checkpointing`).
Loading raises :class:`TrainingStateError` (a user-facing error) naming the
file when it does not fit.

Files written per checkpoint (next to ``model/``, ``optim/`` and ``state.json``)::

    rng.safetensors     "torch" (CPU generator), "cuda.<i>" (one per visible GPU)
    rng.json            {"format", "python": [version, [625 ints], gauss_next]}

Pickle files of older versions (``optim.pt``, ``rng.pt``) are never opened:
:func:`refuse_legacy` names them and the way out.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Dict, Mapping

import torch
from safetensors.torch import load_file, save_file

from core.errors import UserInputError

FORMAT = "dsv4-train-state-v1"
OPTIM_JSON = "optim.json"   # the optimizer record (train.checkpointing); its presence marks a current checkpoint
RNG_TENSORS, RNG_JSON = "rng.safetensors", "rng.json"
LEGACY_PICKLES = ("optim.pt", "rng.pt")

__all__ = ["TrainingStateError", "save_rng", "load_rng", "save_tensors", "load_tensors", "refuse_legacy"]


class TrainingStateError(UserInputError):
    """A checkpoint's training state is missing, unreadable or does not fit the run."""


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TrainingStateError(f"{path}: unreadable training state ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise TrainingStateError(f"{path}: not a training-state file of format {FORMAT}")
    return d


def save_tensors(path, tensors: Mapping[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def load_tensors(path) -> Dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise TrainingStateError(f"{path}: missing") from None
    except Exception as e:  # safetensors raises its own error types for a damaged header / short file
        raise TrainingStateError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def refuse_legacy(folder: Path) -> None:
    """A checkpoint of an older version stores its training state as pickles: name them, load nothing."""
    old = [n for n in LEGACY_PICKLES if (Path(folder) / n).exists()]
    if old and not (Path(folder) / OPTIM_JSON).exists():
        raise TrainingStateError(
            f"{folder}: the training state is stored as pickle ({', '.join(old)}), which is never loaded "
            f"(unpickling can run code); resume is not possible from this checkpoint. Fix: start a new run "
            f"from its weights with --model {Path(folder) / 'model'}")


# ----------------------------------------------------------------------- rng
def save_rng(folder: Path) -> None:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    save_tensors(Path(folder) / RNG_TENSORS, tensors)
    _write_json(Path(folder) / RNG_JSON, {"format": FORMAT, "python": [version, list(internal), gauss]})


def load_rng(folder: Path) -> None:
    folder = Path(folder)
    refuse_legacy(folder)
    meta = _read_json(folder / RNG_JSON)
    tensors = load_tensors(folder / RNG_TENSORS)
    try:
        version, internal, gauss = meta["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        torch.set_rng_state(tensors["torch"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise TrainingStateError(f"{folder}: invalid RNG state ({e})") from None
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
