"""MXFP4 -> FP8 conversion: exactness on wide scale spreads, per-tile checks, full checkpoints."""

import json
import warnings

import pytest
import torch

from converters.mxfp4_to_fp8 import (
    REPORT_FILE, InexactConversionError, cast_mxfp4_to_fp8, convert_mxfp4_to_fp8,
)
from converters.staging import SENTINEL, read_sentinel
from core.checkpoint import open_checkpoint, prepare_checkpoint, write_checkpoint
from core.checkpoint.errors import CheckpointError
from core.checkpoint.formats import (
    E8M0_DTYPE, FP4_VALUES, fp4_dequantize, fp4_pack, fp8_block_dequantize,
)
from core.checkpoint.tokenizer import TOKENIZER_FILE
from core.config import preset

# magnitude code -> value, and the codes whose value has its lowest bit at 2^-1 (0.5, 1.5)
HALF_CODES = (1, 3)


def _random_fp4(out_f, in_f, gen):
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    return codes, fp4_pack(codes)


def _scales_from_exps(exps):
    return (exps.to(torch.int32) + 127).to(torch.uint8).view(E8M0_DTYPE)


def _wide_exps(out_f, in_f, gen, spread=14, lo=-127, hi=125):
    """Per 128x128 tile a random top exponent in [lo+spread, hi], block exponents
    spread over ``spread`` powers of two below it (the documented exact range)."""
    rb, cb, nb = out_f // 128, in_f // 128, in_f // 32
    top = torch.randint(lo + spread, hi + 1, (rb, 1, cb, 1), generator=gen)
    e = top - torch.randint(0, spread + 1, (rb, 128, cb, 4), generator=gen)
    return e.reshape(out_f, nb)


def _is_exact_by_float(codes, exps):
    """Independent oracle: the fp32 product of each value and its offset survives an e4m3 round trip."""
    out_f, in_f = codes.shape
    vals = torch.tensor(FP4_VALUES)[codes.long()]
    blk = exps.view(out_f // 128, 128, in_f // 128, 4)
    tile = (blk.amax(dim=(1, 3)) - 6).clamp_min(-127)
    off = (blk - tile[:, None, :, None]).reshape(out_f, in_f // 32).repeat_interleave(32, dim=1)
    prod = vals * torch.pow(2.0, off.double()).float()
    back = prod.to(torch.float8_e4m3fn).float()
    ok = (back == prod).view(out_f // 128, 128, in_f // 128, 128).all(dim=3).all(dim=1)
    return ok


@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_lossless_on_wide_scale_spreads(scale_format):
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 512, 1024
    codes, packed = _random_fp4(out_f, in_f, gen)
    exps = _wide_exps(out_f, in_f, gen)
    # extreme tiles: all at the e8m0 minimum, and at the top of the usable range
    exps.view(4, 128, 8, 4)[0, :, 0, :] = -127
    exps.view(4, 128, 8, 4)[1, :, 1, :] = 125
    exps.view(4, 128, 8, 4)[2, :, 2, :] = torch.randint(-127, -115, (128, 4), generator=gen)
    scale = _scales_from_exps(exps)
    assert exps.max() - exps.min() > 200  # the spread across the tensor is wide

    w8, s, tiles = cast_mxfp4_to_fp8(packed, scale, name="t", scale_format=scale_format)
    assert tiles == []
    assert w8.dtype == torch.float8_e4m3fn and tuple(w8.shape) == (out_f, in_f)
    assert tuple(s.shape) == (4, 8)
    assert s.dtype == (E8M0_DTYPE if scale_format == "ue8m0" else torch.float32)
    ref = fp4_dequantize(packed, scale, dtype=torch.float32)
    got = fp8_block_dequantize(w8, s, dtype=torch.float32)
    assert torch.equal(got, ref)
    assert torch.isfinite(ref).all()
    # signs of zeros: -0 (code 8) stays -0
    neg0 = codes == 8
    assert torch.equal(torch.signbit(w8.float()[neg0]), torch.ones(int(neg0.sum()), dtype=torch.bool))


def test_tile_scale_is_max_over_64():
    gen = torch.Generator().manual_seed(1)
    codes, packed = _random_fp4(256, 256, gen)
    exps = _wide_exps(256, 256, gen, spread=10, lo=-100, hi=100)
    _, s, _ = cast_mxfp4_to_fp8(packed, _scales_from_exps(exps), scale_format="fp32")
    expect = torch.pow(2.0, exps.view(2, 128, 2, 4).amax(dim=(1, 3)).double() - 6).float()
    assert torch.equal(s, expect)


def test_exactness_rule_matches_float_oracle():
    """The per-tile integer check agrees with an e4m3 round-trip oracle on random spreads up to 2^18."""
    gen = torch.Generator().manual_seed(2)
    out_f, in_f = 1024, 512
    codes, packed = _random_fp4(out_f, in_f, gen)
    # sparse codes so that some tiles miss the 0.5/1.5 values in their low blocks
    keep = torch.rand(out_f, in_f, generator=gen) < 0.0005
    codes = torch.where(keep, codes, torch.zeros_like(codes))
    codes[::128, ::128] = 7   # every tile keeps a 6.0 at its top scale
    packed = fp4_pack(codes)
    exps = _wide_exps(out_f, in_f, gen, spread=16, lo=-90, hi=90)
    exps.view(8, 128, 4, 4)[:, 0, :, 0] = exps.view(8, 128, 4, 4).amax(dim=(1, 3))
    scale = _scales_from_exps(exps)
    oracle = _is_exact_by_float(codes, exps)
    assert (~oracle).any() and oracle.any()  # both outcomes occur
    _, _, tiles = cast_mxfp4_to_fp8(packed, scale, on_inexact="report")
    flagged = torch.zeros_like(oracle)
    for t in tiles:
        flagged[tuple(t["tile"])] = True
    assert torch.equal(flagged, ~oracle)


def _one_tile(low_exp_gap, low_code):
    """A 128x128 tile: block (0, 0) has exponent top-gap and holds ``low_code`` at column 0."""
    codes = torch.full((128, 128), 7, dtype=torch.uint8)   # 6.0 everywhere
    codes[0, :32] = 0
    codes[0, 0] = low_code
    exps = torch.zeros(128, 4, dtype=torch.int32)
    exps[0, 0] = -low_exp_gap
    return fp4_pack(codes), _scales_from_exps(exps)


@pytest.mark.parametrize("gap,code,exact", [
    (14, 1, True),    # 0.5 * 2^(6-14) = 2^-9: smallest e4m3 subnormal
    (15, 1, False),   # 0.5 * 2^-9 = 2^-10 underflows
    (15, 2, True),    # 1.0 * 2^-9 fits
    (15, 3, False),   # 1.5 * 2^-9 needs a bit below 2^-9
    (16, 6, True),    # 4 * 2^-10 = 2^-8
    (16, 5, False),   # 3 * 2^-10
    (40, 0, True),    # a zero block is exact whatever its scale
])
def test_exactness_boundaries(gap, code, exact):
    packed, scale = _one_tile(gap, code)
    if exact:
        w8, s, tiles = cast_mxfp4_to_fp8(packed, scale)
        assert tiles == []
        assert torch.equal(fp8_block_dequantize(w8, s), fp4_dequantize(packed, scale))
    else:
        with pytest.raises(InexactConversionError) as ei:
            cast_mxfp4_to_fp8(packed, scale, name="layers.0.ffn.experts.0.w1.weight")
        msg = str(ei.value)
        assert "layers.0.ffn.experts.0.w1.weight" in msg and "[0, 0]" in msg
        assert ei.value.tiles[0]["tile"] == [0, 0]


def test_inexact_tile_index_is_reported():
    gen = torch.Generator().manual_seed(3)
    codes, packed = _random_fp4(256, 512, gen)
    codes[130, 0:32] = 1           # 0.5 values in row tile 1, col tile 0
    codes[130 + 0, 300] = 1        # and in col tile 2
    packed = fp4_pack(codes)
    exps = torch.zeros(256, 16, dtype=torch.int32)
    exps[130, 0] = -20
    exps[130, 300 // 32] = -20
    with pytest.raises(InexactConversionError) as ei:
        cast_mxfp4_to_fp8(packed, _scales_from_exps(exps), name="w")
    assert [t["tile"] for t in ei.value.tiles] == [[1, 0], [1, 2]]
    assert "2^-20..2^0" in ei.value.tiles[0]["reason"]


def test_nan_scale_is_reported():
    gen = torch.Generator().manual_seed(4)
    _, packed = _random_fp4(128, 128, gen)
    b = torch.full((128, 4), 127, dtype=torch.uint8)
    b[5, 2] = 255
    with pytest.raises(InexactConversionError, match="NaN"):
        cast_mxfp4_to_fp8(packed, b.view(E8M0_DTYPE))


# ---------------------------------------------------------------------------
# whole checkpoints
# ---------------------------------------------------------------------------

def _wide_mxfp4_checkpoint(path, config, gen):
    """tiny mxfp4 checkpoint whose expert scales are re-drawn with wide spreads."""
    src = prepare_checkpoint(path / "base", config, dtype="mxfp4-experts", seed=0, max_shard_bytes=1_500_000)
    r = open_checkpoint(src)

    def tensors():
        for n, t in r.iter_tensors(dequantize=False):
            spec = r.specs[n]
            if spec.kind == "scale" and r.specs[spec.scale_of].quant == "fp4":
                out_f, nb = t.shape
                yield n, _scales_from_exps(_wide_exps(out_f, nb * 32, gen, spread=13, lo=-120, hi=120))
            else:
                yield n, t

    dst = write_checkpoint(path / "mx", config, tensors(), weight_format="mxfp4-experts",
                           max_shard_bytes=1_500_000, extra_files={TOKENIZER_FILE: (src / TOKENIZER_FILE).read_text(),
                                                                   "chat_template.jinja": "{{ x }}"})
    # quantization_config carrying expert_dtype too (some releases do)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["expert_dtype"] = "fp4"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_convert_checkpoint_end_to_end(tmp_path):
    config = preset("tiny")
    src = _wide_mxfp4_checkpoint(tmp_path, config, torch.Generator().manual_seed(6))
    out = convert_mxfp4_to_fp8(src, tmp_path / "fp8", progress_bar=False)

    rin, rout = open_checkpoint(src), open_checkpoint(out)
    assert rout.weight_format == "fp8"
    cfg = json.loads((out / "config.json").read_text())
    assert "expert_dtype" not in cfg and "expert_dtype" not in cfg["quantization_config"]
    assert (out / TOKENIZER_FILE).read_bytes() == (src / TOKENIZER_FILE).read_bytes()
    assert (out / "chat_template.jinja").read_text() == "{{ x }}"
    assert read_sentinel(out)["stage"] == "mxfp4-to-fp8"
    assert not (out / REPORT_FILE).exists()
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(rout.weight_map)

    # lossless: logical tensors identical in fp32
    a = dict(rin.iter_tensors(dequantize=True, dtype=torch.float32))
    b = dict(rout.iter_tensors(dequantize=True, dtype=torch.float32))
    assert a.keys() == b.keys()
    n_exp = 0
    for n in a:
        assert torch.equal(a[n], b[n]), n
        n_exp += ".experts." in n and ".shared_experts." not in n
    assert n_exp == 5 * 8 * 3

    # everything that is not a routed expert is copied byte for byte
    raw_in = dict(rin.iter_tensors(dequantize=False))
    raw_out = dict(rout.iter_tensors(dequantize=False))
    for n, t in raw_in.items():
        if rin.specs[n].quant == "fp4" or (rin.specs[n].kind == "scale" and rin.specs[rin.specs[n].scale_of].quant == "fp4"):
            continue
        assert raw_out[n].dtype == t.dtype
        assert torch.equal(raw_out[n].view(torch.uint8), t.view(torch.uint8)), n
    w = raw_out["layers.1.ffn.experts.3.w2.weight"]
    assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (256, 128)
    assert tuple(raw_out["layers.1.ffn.experts.3.w2.scale"].shape) == (2, 1)

    # rerun: skipped (sentinel), output untouched
    mtime = (out / SENTINEL).stat().st_mtime_ns
    assert convert_mxfp4_to_fp8(src, tmp_path / "fp8", progress_bar=False) == out
    assert (out / SENTINEL).stat().st_mtime_ns == mtime


def test_convert_reports_inexact_tiles(tmp_path):
    config = preset("tiny")
    src = prepare_checkpoint(tmp_path / "mx", config, dtype="mxfp4-experts", seed=1)
    r = open_checkpoint(src)
    bad = "layers.2.ffn.experts.5.w1"

    def tensors():
        for n, t in r.iter_tensors(dequantize=False):
            if n == bad + ".weight":
                codes = torch.full((128, 256), 2, dtype=torch.uint8)   # 1.0 everywhere
                codes[3, 40] = 1                                       # one 0.5 in block (3, 1)
                t = fp4_pack(codes)
            elif n == bad + ".scale":
                e = torch.zeros(128, 8, dtype=torch.int32)
                e[3, 1] = -30
                e[3, 6] = -30                                          # a 1.0 at 2^-30: also lost
                t = _scales_from_exps(e)
            yield n, t

    src2 = write_checkpoint(tmp_path / "mx2", config, tensors(), weight_format="mxfp4-experts")
    with pytest.raises(InexactConversionError) as ei:
        convert_mxfp4_to_fp8(src2, tmp_path / "out", progress_bar=False)
    assert bad + ".weight" in str(ei.value)
    assert [t["tile"] for t in ei.value.tiles] == [[0, 0], [0, 1]]
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]

    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        out = convert_mxfp4_to_fp8(src2, tmp_path / "out", on_inexact="report", progress_bar=False)
    assert any(bad in str(w.message) for w in ws)
    rep = json.loads((out / REPORT_FILE).read_text())
    assert [t["tile"] for t in rep["inexact_tiles"][bad + ".weight"]] == [[0, 0], [0, 1]]


def test_rejects_non_mxfp4_input(tmp_path):
    src = prepare_checkpoint(tmp_path / "fp8", preset("tiny"), dtype="fp8", seed=0)
    with pytest.raises(CheckpointError, match="input is a 'fp8' checkpoint, expected 'mxfp4-experts'"):
        convert_mxfp4_to_fp8(src, tmp_path / "out", progress_bar=False)
    assert not (tmp_path / "out").exists()


def test_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    import converters.mxfp4_to_fp8 as m
    src = prepare_checkpoint(tmp_path / "mx", preset("tiny"), dtype="mxfp4-experts", seed=0,
                             max_shard_bytes=1_000_000)
    opened, open_now = [], [0]
    real = m.safe_open

    class Tracked:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            open_now[0] += 1
            opened.append(open_now[0])
            return self.f.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.f.__exit__(*exc)

    monkeypatch.setattr(m, "safe_open", Tracked)
    m.convert_mxfp4_to_fp8(src, tmp_path / "out", progress_bar=False)
    assert len(opened) >= 4 and max(opened) == 1
