"""FP8 (128x128 block) checkpoint -> BF16 checkpoint (``fp8_cast_bf16``).

* Every ``*.weight`` stored as float8_e4m3fn is dequantized per 128x128 block
  ``W = f32(q) * f32(scale[i // 128, j // 128])`` and written as bf16. Scales
  may be fp32 (or another float dtype) or float8_e8m0fnu; e8m0 is converted to
  fp32 first (exactly, through its byte).
* When the input still has MXFP4 routed experts (int8 ``*.weight`` with 1x32
  ue8m0 scales) those are dequantized too, so any official checkpoint comes
  out as plain bf16.
* ``.scale`` (or ``.weight_scale_inv``) tensors are dropped; every other
  tensor is copied unchanged; ``quantization_config`` and ``expert_dtype``
  are removed from config.json; side files (tokenizer, ...) are copied; the
  index is rewritten.

Error handling is narrowed to the **scale lookup**: a quantized weight without
a scale is a hard :class:`CheckpointError` naming it (never skipped, never
copied as FP8). Anything that fails *inside* dequantization propagates as is:
there is no ``try`` around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors import safe_open

from core.checkpoint.errors import CheckpointError
from core.checkpoint.formats import fp4_dequantize, fp8_block_dequantize
from core.checkpoint.io import CONFIG_FILE, INDEX_FILE

from ._accel import triton_kernels_for
from ._common import Layout, ScaleLookup, ShardWriter, copy_side_files, file_digest, progress, resolve_device, \
    write_config
from .staging import run_stage

STAGE_NAME = "fp8-to-bf16"
SOURCE_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def dequantize_fp8_weight(q: torch.Tensor, scale: torch.Tensor, *, dtype=torch.bfloat16) -> torch.Tensor:
    """128x128 block dequant on ``q.device``; ``scale`` fp32/bf16 or e8m0.

    CUDA tensors go through the fused Triton kernel (bit-identical to the torch path)."""
    scale = scale.to(q.device)
    tk = triton_kernels_for(q)
    if tk is not None:
        out = tk.fp8_block_dequantize(q, scale, dtype=dtype)
        if out is not None:
            return out
    return fp8_block_dequantize(q, scale, dtype=dtype)


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, *, dtype=torch.bfloat16) -> torch.Tensor:
    """1x32 MXFP4 dequant on ``packed.device``."""
    return fp4_dequantize(packed, scale.to(packed.device), dtype=dtype)


def quantized_weights(layout: Layout) -> Dict[str, str]:
    """``name -> "fp8" | "fp4"`` for every stored quantized ``*.weight``."""
    out = {}
    for h in layout.headers.values():
        for n, e in h.items():
            if not n.endswith(".weight"):
                continue
            if e.dtype in SOURCE_FP8_DTYPES:
                out[n] = "fp8"
            elif e.dtype in (torch.int8, torch.uint8):
                out[n] = "fp4"
    return out


def _out_config(cfg: dict) -> dict:
    d = dict(cfg)
    d.pop("quantization_config", None)
    d.pop("expert_dtype", None)
    return d


def estimate_output_bytes(layout: Layout) -> int:
    q = quantized_weights(layout)
    total = 0
    for h in layout.headers.values():
        for n, e in h.items():
            nb = e.offsets[1] - e.offsets[0]
            if n in q:
                total += nb * (2 if q[n] == "fp8" else 4)
            elif not n.endswith((".scale", ".weight_scale_inv")):
                total += nb
    return total + (1 << 20)


def convert_into(in_dir, out_dir, *, device=None, validate: bool = True,
                 progress_bar: Optional[bool] = None) -> List[str]:
    """Convert into an existing empty folder (not atomic; see :func:`convert_fp8_to_bf16`).
    Returns the dequantized weight names."""
    dev = resolve_device(device)
    layout = Layout(in_dir)
    if validate:
        from core.checkpoint.io import open_checkpoint
        r = open_checkpoint(in_dir)
        if r.weight_format == "bf16":
            raise CheckpointError("input is already a bf16 checkpoint (no quantization_config)",
                                  file=str(Path(in_dir) / CONFIG_FILE))
    qw = quantized_weights(layout)
    scales = ScaleLookup(layout, qw)
    consumed = scales.consumed_scales()
    writer = ShardWriter(out_dir)
    done: List[str] = []
    for fname in progress(layout.shard_files, total=len(layout.shard_files), desc="fp8->bf16",
                          enabled=progress_bar):
        out: Dict[str, torch.Tensor] = {}
        with safe_open(str(layout.path / fname), framework="pt") as f:
            for n in layout.names_in(fname):
                if n in consumed:
                    continue
                t = f.get_tensor(n)
                kind = qw.get(n)
                if kind is None:
                    out[n] = t
                    continue
                sc = scales.get(n, f)          # the only guarded step: a missing scale -> CheckpointError
                if kind == "fp8":
                    out[n] = dequantize_fp8_weight(t.to(dev), sc)
                else:
                    out[n] = dequantize_fp4_weight(t.to(dev), sc)
                done.append(n)
        writer.write(out)
    writer.finish()
    write_config(out_dir, _out_config(layout.config_dict))
    copy_side_files(layout.path, out_dir)
    return done


def convert_fp8_to_bf16(in_dir, out_dir, *, device=None, validate: bool = True, overwrite: bool = False,
                        lock_dir=None, progress_bar: Optional[bool] = None, verbose: bool = True) -> Path:
    """Dequantize the checkpoint at ``in_dir`` to bf16 at ``out_dir`` (a safe stage,
    like :func:`converters.mxfp4_to_fp8.convert_mxfp4_to_fp8`). Returns ``out_dir``."""
    in_path = Path(in_dir).resolve()
    layout = Layout(in_path)
    inputs = {"in_dir": str(in_path), "index_sha256": file_digest(in_path / INDEX_FILE),
              "config_sha256": file_digest(in_path / CONFIG_FILE)}
    res = run_stage(out_dir, lambda tmp: convert_into(in_path, tmp, device=device, validate=validate,
                                                      progress_bar=progress_bar),
                    name=STAGE_NAME, input_paths=[in_path], inputs=inputs,
                    required_bytes=estimate_output_bytes(layout),
                    lock_dir=lock_dir, overwrite=overwrite, verbose=verbose)
    return res.path
