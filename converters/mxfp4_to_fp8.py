"""MXFP4 routed experts -> FP8 e4m3 128x128 blocks, losslessly (``prepare-fp8``).

Input: an official checkpoint whose routed experts are stored as e2m1 codes
packed two per int8 (low nibble = even column) with one ue8m0 scale per
(1, 32) block, ``config.json`` saying ``expert_dtype: "fp4"``.
Output: the same checkpoint with those experts as e4m3 + one scale per
128x128 tile (the uniform FP8 layout); every other tensor copied byte for
byte, ``expert_dtype`` removed from config.json (and from its
``quantization_config``), tokenizer / template / other side files copied,
index rewritten.

The cast (architecture.md §4, official ``cast_e2m1fn_to_e4m3fn``): per tile,
``tile_exp = max(block exponents) - 6`` (the tile scale is ``max scale / 2^6``;
raised to the e8m0 minimum 2^-127 when lower, which only makes the offsets
smaller, never inexact), each value becomes
``fp4 * 2^(block_exp - tile_exp)``. The offset is at most 6 and
``6 * 2^6 = 384 < 448``, so nothing overflows.

**When is it exact?** An e2m1 value ``v`` has its lowest set bit at
``2^lsb(v)`` (lsb: 0.5 -> -1, 1 -> 0, 1.5 -> -1, 2 -> 1, 3 -> 0, 4 -> 2, 6 -> 1).
``v * 2^off`` is exactly representable in e4m3 iff ``lsb(v) + off >= -9``
(2^-9 is the e4m3 subnormal step; above it 1 mantissa bit always fits in 3).
So a tile is exact iff every *nonzero* element satisfies that, i.e. roughly
while its block scales span at most 2^14 (2^15 for blocks without 0.5 / 1.5
multiples). Zeros are always exact. This is **checked per tile** from the
integer exponents (never inferred from a float round trip). A tile that fails
is reported with the tensor name and tile index ``(row_tile, col_tile)``:

* ``on_inexact="error"`` (default): :class:`InexactConversionError`, nothing
  is written.
* ``on_inexact="report"``: the tile is rounded (RNE cast), a warning is
  emitted and every such tile is listed in ``mxfp4_to_fp8_report.json`` in the
  output folder and in the returned report. Never silent.

A scale byte of 255 (e8m0 NaN) is always reported the same way.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from core.errors import UserInputError
from core.checkpoint.errors import CheckpointError
from core.checkpoint.formats import (
    E8M0_DTYPE, FP4_BLOCK, FP8_BLOCK, FP8_DTYPE, e8m0_from_exponent, fp4_table,
)
from core.checkpoint.io import CONFIG_FILE, INDEX_FILE

from ._accel import triton_kernels_for
from ._common import Layout, ScaleLookup, ShardWriter, copy_side_files, file_digest, progress, resolve_device, \
    write_config
from .staging import run_stage

STAGE_NAME = "mxfp4-to-fp8"
REPORT_FILE = "mxfp4_to_fp8_report.json"
MAX_OFFSET = 6                   # 2^6: 6 * 64 = 384 <= 448
E4M3_MIN_LSB = -9                # smallest e4m3 subnormal 2^-9
E8M0_MIN_EXP = -127
# lowest set bit exponent of each e2m1 magnitude code 0..7 (0 -> "no bits": large)
_FP4_LSB = (127, -1, 0, -1, 1, 0, 2, 1)


class InexactConversionError(UserInputError, ValueError):
    """FP4 -> FP8 would lose bits in some tiles; names tensor and tiles."""

    def __init__(self, tensor: str, tiles: List[dict]):
        shown = ", ".join(f"{t['tile']} ({t['reason']})" for t in tiles[:8])
        more = f" and {len(tiles) - 8} more" if len(tiles) > 8 else ""
        super().__init__(f"tensor {tensor!r}: FP4 -> FP8 cast is not exact in {len(tiles)} 128x128 tile(s) "
                         f"[row_tile, col_tile]: {shown}{more}. The FP4 block scales of a tile span too "
                         f"many powers of two for e4m3 (small values would underflow its subnormals). "
                         f"Pass on_inexact='report' to round them and get a report instead.")
        self.tensor = tensor
        self.tiles = tiles


@dataclass
class ConversionReport:
    converted: List[str] = field(default_factory=list)
    copied: int = 0
    inexact: Dict[str, List[dict]] = field(default_factory=dict)
    side_files: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"converted": len(self.converted), "copied": self.copied,
                "inexact_tiles": self.inexact, "side_files": self.side_files}


_BYTE_LUT_CACHE: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}


def _byte_luts(device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per packed byte: its two decoded values (low nibble first) [256, 2] fp32,
    and the lowest set-bit exponent of its nonzero values [256] int16."""
    device = torch.device(device)
    if device not in _BYTE_LUT_CACHE:
        b = torch.arange(256, dtype=torch.int64)
        lo, hi = b & 0xF, b >> 4
        vals = torch.stack((fp4_table()[lo], fp4_table()[hi]), dim=-1)
        lsb = torch.tensor(_FP4_LSB, dtype=torch.int16)
        _BYTE_LUT_CACHE[device] = (vals.to(device), torch.minimum(lsb[lo & 7], lsb[hi & 7]).to(device))
    return _BYTE_LUT_CACHE[device]


def _inexact_tiles(exps: torch.Tensor, byte_idx: torch.Tensor, tile_exp: torch.Tensor) -> List[dict]:
    """Per-tile exactness check (see module docstring). ``exps`` [out, in/32]
    int32 block exponents (byte-127), ``byte_idx`` [out, in/2] int64 packed
    bytes, ``tile_exp`` [rb, cb]. Returns the failing tiles (empty when exact)."""
    out_f, nb = exps.shape
    rb, cb = tile_exp.shape
    _, lsb_lut = _byte_luts(byte_idx.device)
    min_lsb = lsb_lut[byte_idx].view(out_f, nb, FP4_BLOCK // 2).amin(dim=-1).to(torch.int32)  # [out, nb]
    off = exps.view(rb, FP8_BLOCK, cb, FP8_BLOCK // FP4_BLOCK) - tile_exp[:, None, :, None]
    lost = (min_lsb.view_as(off) + off) < E4M3_MIN_LSB                                 # bits below 2^-9
    nan = (exps == 128).view_as(off)                                                   # byte 255
    bad_lost = lost.any(dim=3).any(dim=1)
    bad_nan = nan.any(dim=3).any(dim=1)
    bad = bad_lost | bad_nan
    if not bool(bad.any()):
        return []
    emin = exps.view_as(off).amin(dim=(1, 3))
    emax = exps.view_as(off).amax(dim=(1, 3))
    tiles = []
    for r, c in bad.nonzero().tolist():
        reason = ("NaN (0xFF) block scale" if bool(bad_nan[r, c]) else
                  f"block scale exponents span 2^{int(emin[r, c])}..2^{int(emax[r, c])}")
        tiles.append({"tile": [r, c], "reason": reason})
    return tiles


def _tiles_from_flags(flags: torch.Tensor, scale: torch.Tensor) -> List[dict]:
    """The failing-tile list of :func:`_inexact_tiles` from the Triton kernel's per-tile flags
    (bit 0: bits lost, bit 1: NaN block scale); same order, same reasons."""
    rb, cb = flags.shape
    exps = scale.view(torch.uint8).to(torch.int32) - 127
    blk = exps.view(rb, FP8_BLOCK, cb, FP8_BLOCK // FP4_BLOCK)
    emin = blk.amin(dim=(1, 3)).cpu()
    emax = blk.amax(dim=(1, 3)).cpu()
    f = flags.cpu()
    tiles = []
    for r, c in (f != 0).nonzero().tolist():
        reason = ("NaN (0xFF) block scale" if int(f[r, c]) & 2 else
                  f"block scale exponents span 2^{int(emin[r, c])}..2^{int(emax[r, c])}")
        tiles.append({"tile": [r, c], "reason": reason})
    return tiles


def cast_mxfp4_to_fp8(packed: torch.Tensor, scale: torch.Tensor, *, name: str = "<tensor>",
                      scale_format: str = "ue8m0", on_inexact: str = "error"
                      ) -> Tuple[torch.Tensor, torch.Tensor, List[dict]]:
    """Packed e2m1 ``[out, in/2]`` (int8/uint8) + ue8m0 scale ``[out, in/32]``
    -> ``(e4m3 [out, in], tile scale [out/128, in/128], inexact tiles)``.

    Runs on ``packed.device``. ``scale_format``: ``"ue8m0"`` (float8_e8m0fnu,
    the official dtype) or ``"fp32"`` (same powers of two stored as fp32,
    the sgl FP8 repack convention). ``on_inexact``: see the module docstring.
    """
    if scale_format not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_format must be 'ue8m0' or 'fp32', got {scale_format!r}")
    if on_inexact not in ("error", "report"):
        raise ValueError(f"on_inexact must be 'error' or 'report', got {on_inexact!r}")
    if packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"expected a 2-D int8 packed FP4 tensor, got {packed.dtype} "
                              f"{list(packed.shape)}", tensor=name)
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if out_f % FP8_BLOCK or in_f % FP8_BLOCK:
        raise CheckpointError(f"FP4 -> FP8 needs both logical dims divisible by {FP8_BLOCK}, got "
                              f"{[out_f, in_f]}", tensor=name)
    if tuple(scale.shape) != (out_f, in_f // FP4_BLOCK):
        raise CheckpointError(f"scale shape {list(scale.shape)} does not match packed weight "
                              f"{list(packed.shape)} (expected {[out_f, in_f // FP4_BLOCK]})", tensor=name)
    if scale.dtype not in (E8M0_DTYPE, torch.uint8):
        raise CheckpointError(f"expected float8_e8m0fnu block scales, got {scale.dtype}", tensor=name)
    scale = scale.to(packed.device)
    tk = triton_kernels_for(packed)
    if tk is not None:       # one fused pass per 128x128 tile, bit-identical to the torch code below
        w8, s, flags, any_flag = tk.mxfp4_to_fp8(packed, scale, scale_format)
        tiles = _tiles_from_flags(flags, scale) if int(any_flag.item()) else []
        if tiles and on_inexact == "error":
            raise InexactConversionError(name, tiles)
        return w8, s, tiles
    exps = scale.view(torch.uint8).to(torch.int32) - 127                    # [out, nb]
    rb, cb = out_f // FP8_BLOCK, in_f // FP8_BLOCK
    per = FP8_BLOCK // FP4_BLOCK
    blk = exps.view(rb, FP8_BLOCK, cb, per)
    is_nan = blk == 128                                                      # byte 255
    tile_exp = torch.where(is_nan, torch.full_like(blk, -1000), blk).amax(dim=(1, 3)) - MAX_OFFSET
    tile_exp = tile_exp.clamp_min(E8M0_MIN_EXP)   # exact: only lowers the offsets (all >= 0 then)
    byte_idx = packed.view(torch.uint8).long()                                # [out, in/2]
    tiles = _inexact_tiles(exps, byte_idx, tile_exp)
    if tiles and on_inexact == "error":
        raise InexactConversionError(name, tiles)
    off = (blk - tile_exp[:, None, :, None]).reshape(out_f, in_f // FP4_BLOCK)
    mult = torch.ldexp(torch.ones((), dtype=torch.float32, device=packed.device), off.float())
    mult = torch.where(is_nan.reshape(out_f, -1), torch.full_like(mult, float("nan")), mult)
    vals = _byte_luts(packed.device)[0][byte_idx].view(out_f, in_f // FP4_BLOCK, FP4_BLOCK)
    w8 = (vals * mult[..., None]).view(out_f, in_f).to(FP8_DTYPE)
    if scale_format == "ue8m0":
        s = e8m0_from_exponent(tile_exp)
    else:
        s = torch.ldexp(torch.ones((), dtype=torch.float32, device=packed.device), tile_exp.float())
    return w8, s, tiles


def _out_config(cfg: dict) -> dict:
    d = dict(cfg)
    d.pop("expert_dtype", None)
    qc = d.get("quantization_config")
    if isinstance(qc, dict):
        qc = dict(qc)
        qc.pop("expert_dtype", None)
        d["quantization_config"] = qc
    return d


def fp4_weight_names(layout: Layout) -> List[str]:
    """The FP4 set: int8/uint8 tensors named ``*.weight`` (as the reference tool)."""
    return sorted(n for f, h in layout.headers.items() for n, e in h.items()
                  if e.dtype in (torch.int8, torch.uint8) and n.endswith(".weight"))


def estimate_output_bytes(layout: Layout) -> int:
    """Bytes of the FP8 output: FP4 weights double, their scales shrink to one per tile."""
    fp4 = set(fp4_weight_names(layout))
    total = 0
    for h in layout.headers.values():
        for n, e in h.items():
            nb = e.offsets[1] - e.offsets[0]
            total += 2 * nb if n in fp4 else nb
    return total + (1 << 20)


def convert_into(in_dir, out_dir, *, device=None, scale_format: str = "ue8m0", on_inexact: str = "error",
                 validate: bool = True, progress_bar: Optional[bool] = None) -> ConversionReport:
    """Do the conversion into an existing (empty) folder; not atomic by itself
    (:func:`convert_mxfp4_to_fp8` wraps it in a stage)."""
    dev = resolve_device(device)
    layout = Layout(in_dir)
    if validate:
        from core.checkpoint.io import open_checkpoint
        r = open_checkpoint(in_dir)
        if r.weight_format != "mxfp4-experts":
            raise CheckpointError(f"input is a {r.weight_format!r} checkpoint, expected 'mxfp4-experts' "
                                  f"(config.json expert_dtype 'fp4')", file=str(Path(in_dir) / CONFIG_FILE))
    fp4 = fp4_weight_names(layout)
    if not fp4:
        raise CheckpointError("no FP4 (int8 '*.weight') tensors found: not an MXFP4 checkpoint",
                              file=str(layout.path))
    fp4_set = set(fp4)
    scales = ScaleLookup(layout, fp4)
    consumed = scales.consumed_scales()
    writer = ShardWriter(out_dir)
    report = ConversionReport()
    for fname in progress(layout.shard_files, total=len(layout.shard_files), desc="mxfp4->fp8",
                          enabled=progress_bar):
        out: Dict[str, torch.Tensor] = {}
        with safe_open(str(layout.path / fname), framework="pt") as f:
            for n in layout.names_in(fname):
                if n in consumed:
                    continue  # an FP4 block scale: replaced by the tile scale next to its weight
                t = f.get_tensor(n)
                if n not in fp4_set:
                    out[n] = t
                    report.copied += 1
                    continue
                sc = scales.get(n, f)
                w8, s, tiles = cast_mxfp4_to_fp8(t.to(dev), sc, name=n, scale_format=scale_format,
                                                 on_inexact=on_inexact)
                if tiles:
                    report.inexact[n] = tiles
                    warnings.warn(f"{n}: {len(tiles)} tile(s) rounded in the FP4 -> FP8 cast "
                                  f"(see {REPORT_FILE})", stacklevel=2)
                out[n] = w8
                out[n[: -len(".weight")] + ".scale"] = s
                report.converted.append(n)
        writer.write(out)
    writer.finish()
    write_config(out_dir, _out_config(layout.config_dict))
    report.side_files = copy_side_files(layout.path, out_dir)
    if report.inexact:
        (Path(out_dir) / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report


def convert_mxfp4_to_fp8(in_dir, out_dir, *, device=None, scale_format: str = "ue8m0",
                         on_inexact: str = "error", validate: bool = True, overwrite: bool = False,
                         lock_dir=None, progress_bar: Optional[bool] = None, verbose: bool = True) -> Path:
    """Convert an MXFP4-experts checkpoint at ``in_dir`` into FP8 at ``out_dir``.

    Runs as a safe stage (:func:`converters.staging.run_stage`): built in a temp
    folder next to ``out_dir``, renamed into place when complete, skipped when
    ``out_dir`` already holds this conversion of the same input, serialized by
    a lock across processes, free disk space checked first. ``device``: where
    the cast runs (``"cuda"`` on a GPU host). Returns ``out_dir``.
    """
    in_path = Path(in_dir).resolve()
    layout = Layout(in_path)
    inputs = {"in_dir": str(in_path), "index_sha256": file_digest(in_path / INDEX_FILE),
              "config_sha256": file_digest(in_path / CONFIG_FILE), "scale_format": scale_format,
              "on_inexact": on_inexact}
    res = run_stage(out_dir, lambda tmp: convert_into(in_path, tmp, device=device, scale_format=scale_format,
                                                      on_inexact=on_inexact, validate=validate,
                                                      progress_bar=progress_bar),
                    name=STAGE_NAME, input_paths=[in_path], inputs=inputs,
                    required_bytes=estimate_output_bytes(layout),
                    lock_dir=lock_dir, overwrite=overwrite, verbose=verbose)
    return res.path
