"""How `dsv4 convert` and `dsv4 export` write their output folders safely.

Why: both used to write straight to ``--out``: ``--overwrite`` (and export,
always) replaced whatever folder was there, inputs and unrelated files
included; concurrent runs into one folder all reported "wrote"; a full disk
was found half-way through. Here each runs as a staged output
(:func:`converters.staging.run_stage`): refused when ``--out`` is, contains or
sits inside an input (:func:`core.path_safety.refuse_overlap`), free space
checked first, built in a temporary sibling and renamed into place with a
completion sentinel, a rerun or concurrent run with the same inputs reports
"already ...", and ``--overwrite`` replaces only a folder whose sentinel shows
dsv4 wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

__all__ = ["staged_output", "native_bytes"]


def staged_output(out: Path, build: Callable[[Path], object], *, name: str, inputs: Mapping,
                  input_paths: Iterable[Optional[Path]], required_bytes: Optional[int], overwrite: bool) -> bool:
    """Build ``out`` with ``build(tmp)`` as a stage; True when this call wrote it, False when it was already there."""
    from converters.staging import run_stage

    result = run_stage(out, build, name=name, input_paths=input_paths, inputs=dict(inputs),   # a StageConflict
                       required_bytes=required_bytes, overwrite=overwrite, verbose=False)     # names its fix
    return result.built


def native_bytes(config) -> int:
    """Bytes of a native checkpoint of ``config`` (bf16 weights, fp32-kept tensors), plus 5% for metadata."""
    import torch

    from core import weight_contract as wc

    total = 0
    for shape, dt in wc.native_names(config).values():
        n = 1
        for d in shape:
            n *= int(d)
        size = 2 if dt.is_floating_point and dt != torch.float32 else torch.empty((), dtype=dt).element_size()
        total += n * size
    return int(total * 1.05)


def real(p) -> str:
    return os.path.realpath(os.fspath(p))


def export_run(run_dir: Path, out: Path, *, step: Optional[int], weight_format: str, overwrite: bool) -> bool:
    """`dsv4 export` as a staged output; True when this call wrote ``out``."""
    from core.bounded_io import check_tree
    from orchestration.resume_checks import check_run_files
    from train.export import export_hf, export_source

    fix = "Fix: restore the run's own file, or export another run"
    check_run_files(Path(run_dir), fix=fix)          # FIFOs and devices named, before anything reads them
    found_step, folder = export_source(run_dir, step)
    check_tree(folder, what="checkpoint file")
    return staged_output(out, lambda tmp: export_hf(run_dir, tmp, step=found_step, weight_format=weight_format),
                         name="export", inputs={"run_dir": real(run_dir), "step": found_step,
                                                "weight_format": weight_format},
                         input_paths=[run_dir], required_bytes=None, overwrite=overwrite)
