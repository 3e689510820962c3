"""Boxes of checkpoint tensors (core.checkpoint.slices.BoxReader) equal the whole tensor, read and dequantised
by the streaming reader, then sliced: every tensor of the tiny checkpoint in each weight format, at block
-aligned and unaligned boxes, and FP8 / FP4 weights whose shapes end in partial blocks."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from core.checkpoint import CheckpointError, open_checkpoint, prepare_checkpoint
from core.checkpoint import formats as F
from core.checkpoint.official_tensors import EXPERT, Q_FP4, Q_FP8, SCALE, TensorSpec
from core.checkpoint.slices import BoxReader
from core.config import preset


def _boxes(shape, g):
    """A few boxes of ``shape``: the whole tensor, halves along each dimension, and random ones."""
    out = [((0,) * len(shape), tuple(shape))]
    for d, n in enumerate(shape):
        if n >= 2:
            for k in range(2):
                off, size = [0] * len(shape), list(shape)
                off[d], size[d] = k * (n // 2), n // 2
                out.append((tuple(off), tuple(size)))
    for _ in range(3):
        off, size = [], []
        for n in shape:
            a = int(torch.randint(0, n, (1,), generator=g))
            off.append(a)
            size.append(int(torch.randint(1, n - a + 1, (1,), generator=g)))
        out.append((tuple(off), tuple(size)))
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4-experts"])
def test_every_box_equals_the_sliced_whole_tensor(tmp_path, fmt):
    cfg = preset("tiny")
    reader = open_checkpoint(prepare_checkpoint(tmp_path / fmt, cfg, dtype=fmt, seed=3, max_shard_bytes=600_000))
    whole = dict(reader.iter_tensors(dequantize=True, dtype=torch.float32, progress=False))
    g = torch.Generator().manual_seed(0)
    with BoxReader(reader) as boxes:
        for name, t in whole.items():
            for off, size in _boxes(t.shape, g):
                got = boxes.read(name, off, size)
                want = t[tuple(slice(o, o + s) for o, s in zip(off, size))]
                assert got.dtype == want.dtype and torch.equal(got, want), (name, off, size)


def _fake_reader(tmp_path, weights):
    """A reader over one hand-written shard (shapes the official table never has: partial blocks)."""
    tensors, specs = {}, {}
    for name, (quant, w) in weights.items():
        sn = name[:-len(".weight")] + ".scale"
        if quant == Q_FP8:
            q, s = F.fp8_block_quantize(w, scale_fmt="ue8m0")
        else:
            q, s = F.fp4_quantize(w)
        tensors[name], tensors[sn] = q, s
        specs[name] = TensorSpec(tuple(q.shape), q.dtype, EXPERT, quant, tuple(w.shape), torch.bfloat16)
        specs[sn] = TensorSpec(tuple(s.shape), s.dtype, SCALE, scale_of=name)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return SimpleNamespace(path=tmp_path, specs=specs, weight_map={n: "model.safetensors" for n in tensors},
                           config=SimpleNamespace(n_routed_experts=8))   # as a real reader's (tid2eid checks)


def test_partial_blocks(tmp_path):
    g = torch.Generator().manual_seed(1)
    weights = {"a.weight": (Q_FP8, torch.randn(300, 200, generator=g)),
               "b.weight": (Q_FP4, torch.randn(70, 100, generator=g))}
    reader = _fake_reader(tmp_path, weights)
    full = {n: (F.fp8_block_dequantize if quant == Q_FP8 else F.fp4_dequantize)(
        *_stored(reader, n), dtype=torch.float32) for n, (quant, _w) in weights.items()}
    boxes_of = {"a.weight": [((0, 0), (300, 200)), ((150, 0), (150, 200)), ((0, 100), (300, 100)),
                             ((129, 127), (171, 2)), ((256, 128), (44, 72)), ((1, 1), (1, 1))],
                "b.weight": [((0, 0), (70, 100)), ((35, 50), (35, 50)), ((3, 31), (5, 2)), ((0, 96), (70, 4)),
                             ((69, 0), (1, 33))]}
    with BoxReader(reader) as boxes:
        for name, bs in boxes_of.items():
            for (r, c), (nr, nc) in bs:
                assert torch.equal(boxes.read(name, (r, c), (nr, nc)), full[name][r:r + nr, c:c + nc]), (name, r, c)
        with pytest.raises(CheckpointError, match="not inside"):
            boxes.read("a.weight", (200, 0), (101, 10))
        with pytest.raises(CheckpointError, match="no such tensor"):
            boxes.read("a.scale", (0, 0), (1, 1))


def _stored(reader, name):
    from safetensors import safe_open

    with safe_open(str(reader.path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name), f.get_tensor(name[:-len(".weight")] + ".scale")
