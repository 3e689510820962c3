"""Export trained weights as an HF-format (official-named) checkpoint (``dsv4 export``).

:func:`export_hf` loads the last complete checkpoint of a run (or a given step) and writes it with
:func:`core.checkpoint.write_checkpoint` (bf16 by default, fp32-kept tensors in their official dtypes;
``weight_format="fp8"`` quantises like the official release), plus the byte tokenizer file when the
run used one. The result loads with ``core.checkpoint.open_checkpoint`` / ``load_into`` and serves as
``--model`` for another run or for a rollout engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

from core import weight_contract as wc
from core.finite import checked

CONFIG_FILE = "train_config.json"  # in a run folder: every knob of the run (written by train.trainer)


def export_model(train_model, out_dir, *, weight_format: str = "bf16", tokenizer=None,
                 overwrite: bool = True) -> Path:
    from core.checkpoint import write_checkpoint
    from core.checkpoint.tokenizer import TOKENIZER_FILE

    config = train_model.config
    native = checked(((n, t.detach().cpu()) for n, t in train_model.native_tensors()), where="export",
                     fix="the weights diverged; export an earlier checkpoint (--step)")
    official = wc.native_to_hf(native, config, official_dtypes=True)
    extra = {TOKENIZER_FILE: tokenizer.to_json()} if tokenizer is not None and hasattr(tokenizer, "to_json") else None
    return write_checkpoint(out_dir, config, official, weight_format=weight_format, quantize=True,
                            overwrite=overwrite, extra_files=extra, progress=False)


def export_source(run_dir, step: Optional[int] = None) -> Tuple[int, Path]:
    """``(step, checkpoint folder)`` to export from a run folder, or a one-line error saying what is wrong."""
    from core.errors import UserInputError

    from .checkpointing import CKPT_DIR, _complete, latest_checkpoint

    run = Path(run_dir)
    if not (run / CONFIG_FILE).is_file():
        raise UserInputError(f"{run} is not a training run folder (no {CONFIG_FILE}); pass the --run-dir of a "
                             f"`dsv4 train` run")
    if step is None:
        found = latest_checkpoint(run)
        if found is None:
            raise UserInputError(f"{run}: no complete checkpoint to export yet (train with --save-every N)")
        return found
    folder = run / CKPT_DIR / f"step_{step:06d}"
    if _complete(folder) != step:
        have = latest_checkpoint(run)
        raise UserInputError(f"{run}: no complete checkpoint for --step {step}"
                             + (f"; the last complete one is step {have[0]}" if have else ""))
    return step, folder


def export_hf(run_dir, out_dir, *, step: Optional[int] = None, weight_format: str = "bf16") -> Path:
    """Run folder -> HF checkpoint in ``out_dir`` (atomic). ``step`` None = the last complete one."""
    from core.config import ConfigError, ModelConfig
    from core.errors import UserInputError

    from .checkpointing import load_checkpoint
    from .data import tokenizer_for
    from .model import build_train_model

    run = Path(run_dir)
    _step, folder = export_source(run, step)
    try:
        desc = json.loads((run / CONFIG_FILE).read_text())
        config = ModelConfig.from_hf_dict(desc["model_config"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        raise UserInputError(f"{run / CONFIG_FILE}: unreadable run description ({e})") from None
    model = build_train_model(config, None, impl="reference", initialize=False)   # the checkpoint fills it
    load_checkpoint(folder, model, None, restore_rng=False)
    tok = tokenizer_for(desc.get("model_source"), config.vocab_size)
    return export_model(model, out_dir, weight_format=weight_format, tokenizer=tok)
