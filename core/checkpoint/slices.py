"""Read a box (a range of rows and columns) of an official checkpoint tensor, dequantised, without reading the
rest of it.

Why: a tensor-parallel rank holds a slice of most matrices; reading whole tensors and slicing them afterwards
makes every rank read (and dequantise, and hold for a moment) the whole checkpoint. safetensors reads a slice
of a tensor straight from the memory-mapped file (``safe_open(...).get_slice(name)[rows, cols]``), so a rank
reads only the bytes of its box (a column range of a row-major tensor is one span per row; what comes off the
disk is the pages those spans touch).

Quantised weights are read by whole quantisation blocks, the blocks covering the box, then dequantised and
trimmed, so the values are exactly those of dequantising the whole tensor and slicing it (dequantisation is
elementwise, ``q * scale of its block``):

* FP8 e4m3, 128x128 blocks: the covering 128-row / 128-column blocks of the weight and the matching entries
  of its ``.scale`` (tensor-parallel slices of the real models are block-aligned, so nothing is trimmed);
* FP4 e2m1 routed experts (two codes per byte, 1x32 blocks): the box's rows, the covering 32-column blocks of
  the packed bytes and of the scale.

A box covering the whole tensor is read with ``get_tensor``. Dtypes follow
:meth:`core.checkpoint.io.CheckpointReader.iter_tensors` with ``dequantize=True``: quantised and bf16 tensors
come back as ``dtype``, F32 stays F32, integers stay integers. Every box read is checked finite.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from safetensors import safe_open

from .errors import CheckpointError
from .io import _finite
from .formats import FP4_BLOCK, FP8_BLOCK, fp4_dequantize, fp8_block_dequantize
from .official_tensors import Q_FP4, Q_FP8, SCALE, scale_name

__all__ = ["BoxReader"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _covering(lo: int, hi: int, block: int, size: int):
    """The block-aligned range ``[LO, HI)`` covering ``[lo, hi)`` inside ``[0, size)``."""
    return lo // block * block, min(_ceil_div(hi, block) * block, size)


class BoxReader:
    """Boxes of the logical tensors of a validated checkpoint (:func:`core.checkpoint.open_checkpoint`).

    A context manager: shard files are opened (memory-mapped) on first use and closed on exit."""

    def __init__(self, reader):
        self.reader = reader
        self._open: Dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()
        return False

    def _file(self, name: str):
        fname = self.reader.weight_map[name]
        f = self._open.get(fname)
        if f is None:
            f = safe_open(str(self.reader.path / fname), framework="pt")
            f.__enter__()
            self._open[fname] = f
        return f

    def _slice(self, name: str, index):
        return self._file(name).get_slice(name)[index]

    def read(self, name: str, offsets: Sequence[int], sizes: Sequence[int],
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The box ``offsets`` / ``sizes`` (in the logical, dequantised shape) of the logical tensor ``name``."""
        spec = self.reader.specs.get(name)
        if spec is None or spec.kind == SCALE:
            raise CheckpointError("no such tensor in checkpoint", tensor=name, file=str(self.reader.path))
        shape = tuple(spec.logical_shape)
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CheckpointError(f"box at {list(offsets)} of size {list(sizes)} is not inside the tensor's "
                                  f"shape {list(shape)}", tensor=name, file=self.reader.weight_map[name])
        whole = all(o == 0 and s == n for o, s, n in zip(offsets, sizes, shape))
        if spec.quant == Q_FP8:
            t = self._fp8(name, offsets, sizes, shape, dtype)
        elif spec.quant == Q_FP4:
            t = self._fp4(name, offsets, sizes, shape, dtype)
        else:
            t = (self._file(name).get_tensor(name) if whole
                 else self._slice(name, tuple(slice(o, o + s) for o, s in zip(offsets, sizes))))
            if t.is_floating_point() and t.dtype != torch.float32:
                t = t.to(dtype)
        return _finite(name, t.contiguous(), self.reader.path / self.reader.weight_map[name],
                       self.reader.config.n_routed_experts)

    def _fp8(self, name, offsets, sizes, shape, dtype):
        (r0, c0), (nr, nc) = offsets, sizes
        R0, R1 = _covering(r0, r0 + nr, FP8_BLOCK, shape[0])
        C0, C1 = _covering(c0, c0 + nc, FP8_BLOCK, shape[1])
        q = self._slice(name, (slice(R0, R1), slice(C0, C1)))
        s = self._slice(scale_name(name), (slice(R0 // FP8_BLOCK, _ceil_div(R1, FP8_BLOCK)),
                                           slice(C0 // FP8_BLOCK, _ceil_div(C1, FP8_BLOCK))))
        return fp8_block_dequantize(q, s, dtype=dtype)[r0 - R0:r0 - R0 + nr, c0 - C0:c0 - C0 + nc]

    def _fp4(self, name, offsets, sizes, shape, dtype):
        (r0, c0), (nr, nc) = offsets, sizes
        C0, C1 = _covering(c0, c0 + nc, FP4_BLOCK, shape[1])       # even: 32-aligned, or the (even) width
        q = self._slice(name, (slice(r0, r0 + nr), slice(C0 // 2, C1 // 2)))
        s = self._slice(scale_name(name), (slice(r0, r0 + nr),
                                           slice(C0 // FP4_BLOCK, _ceil_div(C1, FP4_BLOCK))))
        return fp4_dequantize(q, s, dtype=dtype)[:, c0 - C0:c0 - C0 + nc]
