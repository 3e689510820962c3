"""Reader / writer: round trips, validation of corrupt checkpoints, streaming, atomic writes, load_into."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.config import preset
from core.checkpoint import io as ckio
from core.checkpoint import formats as F
from core.checkpoint import (
    CheckpointError, load_into, official_tensor_specs, open_checkpoint, write_checkpoint,
)
from core.checkpoint.official_tensors import SCALE
from core.checkpoint.tiny import iter_initial_tensors


SHARD = 600_000  # tiny checkpoints split into ~10 shards


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def logical(cfg):
    """Logical (bf16/fp32/int64) tensors of the tiny model."""
    return dict(iter_initial_tensors(cfg, "bf16", seed=7))


@pytest.fixture(scope="module")
def good_fp8(tmp_path_factory, cfg, logical):
    d = tmp_path_factory.mktemp("good") / "fp8"
    write_checkpoint(d, cfg, logical, weight_format="fp8", quantize=True, max_shard_bytes=SHARD)
    return d


def _snapshot(d: Path):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --------------------------------------------------------------------------- round trips

def test_roundtrip_bf16_exact(tmp_path, cfg, logical):
    d = write_checkpoint(tmp_path / "ck", cfg, logical, weight_format="bf16", max_shard_bytes=SHARD)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(idx["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in logical.values())
    cj = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cj and "expert_dtype" not in cj
    r = open_checkpoint(d)
    assert r.weight_format == "bf16" and r.config == cfg.replace(expert_dtype=None, quantization_config=None)
    got = dict(r.iter_tensors(dequantize=True, dtype=torch.bfloat16))
    assert got.keys() == logical.keys()
    for k, v in logical.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert got["layers.0.hc_attn_fn"].dtype == torch.float32


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4-experts"])
def test_roundtrip_quantized(tmp_path, cfg, logical, fmt):
    d = write_checkpoint(tmp_path / "ck", cfg, logical, weight_format=fmt, quantize=True, max_shard_bytes=SHARD)
    cj = json.loads((d / "config.json").read_text())
    assert cj["quantization_config"]["weight_block_size"] == [128, 128]
    assert cj["quantization_config"]["scale_fmt"] == "ue8m0"
    assert cj.get("expert_dtype") == ("fp4" if fmt == "mxfp4-experts" else None)
    r = open_checkpoint(d)
    assert r.weight_format == fmt
    specs = official_tensor_specs(cfg, fmt)
    raw = dict(r.iter_tensors(dequantize=False))
    assert raw.keys() == specs.keys()
    deq = dict(r.iter_tensors(dequantize=True, dtype=torch.float32))
    assert deq.keys() == logical.keys()
    for n, s in specs.items():
        assert raw[n].dtype == s.dtype and tuple(raw[n].shape) == s.shape, n
        if s.kind == SCALE:
            continue
        x = logical[n]
        if s.quant is None:
            assert torch.equal(raw[n], x) and torch.equal(deq[n].to(x.dtype), x), n
            continue
        # stored bytes are exactly the codec's output; dequantised values exactly its inverse
        sc = raw[n[: -len("weight")] + "scale"]
        if s.quant == "fp8":
            q, qs = F.fp8_block_quantize(x)
            y = F.fp8_block_dequantize(q, qs)
            assert (x.float() - y).abs().max() <= x.float().abs().max() * 2 ** -4, n
        else:
            q, qs = F.fp4_quantize(x)
            y = F.fp4_dequantize(q, qs)
            assert (x.float() - y).abs().max() <= x.float().abs().max() * 0.25, n
        assert torch.equal(raw[n].view(torch.uint8), q.view(torch.uint8)), n
        assert torch.equal(sc.view(torch.uint8), qs.view(torch.uint8)), n
        assert deq[n].dtype == torch.float32 and torch.equal(deq[n], y), n
    # bf16 output of a dequantised FP8 weight is exact (e4m3 x power of two fits in bf16)
    w = "layers.0.attn.wq_a.weight"
    assert torch.equal(r.get_tensor(w, dtype=torch.bfloat16).float(), deq[w])
    # re-writing the stored tensors as they are gives the same tensors back
    d2 = write_checkpoint(tmp_path / "ck2", cfg, r.iter_tensors(dequantize=False), weight_format=fmt,
                          max_shard_bytes=SHARD)
    raw2 = dict(open_checkpoint(d2).iter_tensors(dequantize=False))
    assert all(torch.equal(raw2[n].view(torch.uint8), raw[n].view(torch.uint8)) for n in raw)


def test_single_file_checkpoint(tmp_path, cfg, logical):
    d = write_checkpoint(tmp_path / "ck", cfg, logical, weight_format="bf16")
    files = [p.name for p in d.iterdir() if p.suffix == ".safetensors"]
    assert files == ["model-00001-of-00001.safetensors"]
    os.rename(d / files[0], d / "model.safetensors")
    os.remove(d / "model.safetensors.index.json")
    r = open_checkpoint(d)
    assert torch.equal(r.get_tensor("embed.weight"), logical["embed.weight"])


# --------------------------------------------------------------------------- streaming

class _OpenCounter:
    def __init__(self):
        self.open_now = self.max_open = self.opens = 0

    def __call__(self, path, framework="pt", device="cpu"):
        counter = self
        inner = safe_open(path, framework=framework, device=device)

        class _Ctx:
            def __enter__(self):
                counter.open_now += 1
                counter.opens += 1
                counter.max_open = max(counter.max_open, counter.open_now)
                return inner.__enter__()

            def __exit__(self, *exc):
                counter.open_now -= 1
                return inner.__exit__(*exc)

        return _Ctx()


def test_streaming_one_shard_at_a_time(monkeypatch, good_fp8):
    r = open_checkpoint(good_fp8)
    assert len(r.shard_files) > 3
    counter = _OpenCounter()
    monkeypatch.setattr(ckio, "safe_open", counter)
    seen_files = []
    for name, _ in r.iter_tensors():
        assert counter.open_now == 1
        f = r.weight_map[name]
        if not seen_files or seen_files[-1] != f:
            assert f not in seen_files  # each shard visited once, in one go
            seen_files.append(f)
    assert counter.max_open == 1 and counter.open_now == 0
    assert counter.opens == len(r.shard_files)


def test_scale_in_another_shard(monkeypatch, tmp_path, cfg, good_fp8):
    r = open_checkpoint(good_fp8)
    raw = dict(r.iter_tensors(dequantize=False))
    # scales first, weights last: every scale lands in a different shard from its weight
    order = sorted(raw, key=lambda n: (not n.endswith(".scale"), n))
    d = write_checkpoint(tmp_path / "split", cfg, ((n, raw[n]) for n in order), weight_format="fp8",
                         max_shard_bytes=SHARD)
    r2 = open_checkpoint(d)
    w = "layers.0.attn.wq_a.weight"
    assert r2.weight_map[w] != r2.weight_map["layers.0.attn.wq_a.scale"]
    counter = _OpenCounter()
    monkeypatch.setattr(ckio, "safe_open", counter)
    got = dict(r2.iter_tensors(dtype=torch.float32))
    assert counter.max_open == 1
    ref = dict(r.iter_tensors(dtype=torch.float32))
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


# --------------------------------------------------------------------------- corruption

def _copy(good: Path, tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    shutil.copytree(good, d)
    return d


def _rewrite_shard(d: Path, fname: str, edit):
    with safe_open(str(d / fname), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(d / fname), metadata={"format": "pt"})


def _edit_index(d: Path, edit):
    p = d / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    edit(idx["weight_map"])
    p.write_text(json.dumps(idx))


def _expect_error(d: Path, tmp_path: Path, *needles):
    before = _snapshot(d)
    out = tmp_path / "converted"
    with pytest.raises(CheckpointError) as ei:
        r = open_checkpoint(d)
        write_checkpoint(out, r.config, r.iter_tensors(dequantize=False), weight_format=r.weight_format)
    msg = str(ei.value)
    for s in needles:
        assert s in msg, (s, msg)
    assert _snapshot(d) == before and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
    return msg


def _file_of(d: Path, name: str) -> str:
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_wrong_shape(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.1.attn.compressor.ape"
    f = _file_of(d, n)
    _rewrite_shard(d, f, lambda t: t.__setitem__(n, torch.zeros(4, 255)))
    _expect_error(d, tmp_path, n, f, "shape")


def test_wrong_dtype(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.0.attn.wq_b.weight"
    f = _file_of(d, n)
    _rewrite_shard(d, f, lambda t: t.__setitem__(n, t[n].to(torch.bfloat16)))
    _expect_error(d, tmp_path, n, f, "dtype")


def test_missing_scale(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    w, s = "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"
    f = _file_of(d, s)
    _rewrite_shard(d, f, lambda t: t.pop(s))
    _edit_index(d, lambda wm: wm.pop(s))
    _expect_error(d, tmp_path, w, s, _file_of(d, w), "missing scale")


def test_unknown_tensor(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.0.attn.bogus.weight"
    f = _file_of(d, "embed.weight")
    _rewrite_shard(d, f, lambda t: t.__setitem__(n, torch.zeros(3)))
    _edit_index(d, lambda wm: wm.__setitem__(n, f))
    _expect_error(d, tmp_path, n, f, "unknown tensor")


def test_tensor_not_in_index(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.0.attn.extra"
    f = _file_of(d, "embed.weight")
    _rewrite_shard(d, f, lambda t: t.__setitem__(n, torch.zeros(3)))
    _expect_error(d, tmp_path, n, f, "index does not list it")


def test_missing_tensor(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.1.attn.compressor.ape"
    f = _file_of(d, n)
    _rewrite_shard(d, f, lambda t: t.pop(n))
    _edit_index(d, lambda wm: wm.pop(n))
    _expect_error(d, tmp_path, n, "model.safetensors.index.json", "missing tensor")


def test_index_points_to_tensor_absent_from_shard(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.1.attn.compressor.ape"
    f = _file_of(d, n)
    _rewrite_shard(d, f, lambda t: t.pop(n))
    _expect_error(d, tmp_path, n, f, "does not contain it")


def test_truncated_shard(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    f = _file_of(d, "layers.2.attn.wo_b.weight")
    p = d / f
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    _expect_error(d, tmp_path, f, "truncated")


def test_garbage_shard(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    f = _file_of(d, "embed.weight")
    (d / f).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    _expect_error(d, tmp_path, f, "corrupt")
    (d / f).write_bytes(b"abc")
    _expect_error(d, tmp_path, f)


@pytest.mark.parametrize("entry", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/x.safetensors",
                                   "..", "sub\\x.safetensors", ""])
def test_index_entry_outside_folder(tmp_path, good_fp8, entry):
    d = _copy(good_fp8, tmp_path)
    n = "layers.0.attn.wq_a.weight"
    _edit_index(d, lambda wm: wm.__setitem__(n, entry))
    _expect_error(d, tmp_path, n, "outside the checkpoint folder", repr(entry))


def test_index_shard_missing(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    n = "layers.0.attn.wq_a.weight"
    _edit_index(d, lambda wm: wm.__setitem__(n, "model-99999-of-99999.safetensors"))
    _expect_error(d, tmp_path, n, "model-99999-of-99999.safetensors", "does not exist")


def test_malformed_config_json(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    (d / "config.json").write_text('{"vocab_size": 1024,,}')
    _expect_error(d, tmp_path, "config.json", "malformed JSON")
    (d / "config.json").write_text('{"vocab_size": 1024}')
    _expect_error(d, tmp_path, "config.json", "invalid config")


def test_malformed_index(tmp_path, good_fp8):
    d = _copy(good_fp8, tmp_path)
    (d / "model.safetensors.index.json").write_text("{")
    _expect_error(d, tmp_path, "model.safetensors.index.json", "malformed JSON")
    (d / "model.safetensors.index.json").write_text("[]")
    _expect_error(d, tmp_path, "model.safetensors.index.json", "weight_map")


def test_format_mismatch(tmp_path, good_fp8):
    # config says bf16 but the shards hold FP8: the first FP8 tensor is reported
    d = _copy(good_fp8, tmp_path)
    cj = json.loads((d / "config.json").read_text())
    del cj["quantization_config"]
    (d / "config.json").write_text(json.dumps(cj))
    _expect_error(d, tmp_path, ".safetensors", "tensor '")


def test_validation_reads_no_tensor_data(monkeypatch, good_fp8):
    def boom(*a, **k):
        raise AssertionError("safe_open called during validation")
    monkeypatch.setattr(ckio, "safe_open", boom)
    open_checkpoint(good_fp8)


def test_no_pickle_anywhere():
    src = Path(ckio.__file__).parent
    for p in src.glob("*.py"):
        text = p.read_text()
        assert "torch.load(" not in text and "import pickle" not in text and "pickle.load" not in text, p


# --------------------------------------------------------------------------- writer errors, atomicity

def _drop(d, name):
    return {k: v for k, v in d.items() if k != name}


def _expect_write_error(tmp_path, cfg, tensors, *needles, **kw):
    out = tmp_path / "w" / "ck"
    (tmp_path / "w").mkdir(exist_ok=True)
    with pytest.raises(CheckpointError) as ei:
        write_checkpoint(out, cfg, tensors, **kw)
    for s in needles:
        assert s in str(ei.value), (s, str(ei.value))
    assert not out.exists() and list((tmp_path / "w").iterdir()) == []


def test_write_rejects_bad_tensors(tmp_path, cfg, logical, good_fp8):
    n = "layers.0.attn.wkv.weight"
    _expect_write_error(tmp_path, cfg, {**logical, n: torch.zeros(3, 3, dtype=torch.bfloat16)}, n, "shape")
    _expect_write_error(tmp_path, cfg, {**logical, "bogus.weight": torch.zeros(3)}, "bogus.weight", "unknown")
    _expect_write_error(tmp_path, cfg, _drop(logical, n), n, "missing tensor")
    _expect_write_error(tmp_path, cfg, {**logical, n: logical[n].float()}, n, "dtype")
    _expect_write_error(tmp_path, cfg, list(logical.items()) + [(n, logical[n])], n, "twice")
    # stored-format input without a scale
    raw = dict(open_checkpoint(good_fp8).iter_tensors(dequantize=False))
    w = "layers.0.attn.wq_a.weight"
    raw = _drop(raw, "layers.0.attn.wq_a.scale")
    _expect_write_error(tmp_path, cfg, raw, w, "missing scale", weight_format="fp8")


def test_write_failure_midway_leaves_nothing(tmp_path, cfg, logical):
    def gen():
        for i, (k, v) in enumerate(logical.items()):
            if i == 100:
                raise RuntimeError("disk on fire")
            yield k, v
    (tmp_path / "w").mkdir()
    out = tmp_path / "w" / "ck"
    with pytest.raises(RuntimeError):
        write_checkpoint(out, cfg, gen(), max_shard_bytes=SHARD)
    assert list((tmp_path / "w").iterdir()) == []


def test_write_refuses_nonempty_destination_and_overwrites(tmp_path, cfg, logical):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        write_checkpoint(out, cfg, logical)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    write_checkpoint(out, cfg, logical, overwrite=True)
    assert "keep.txt" not in {p.name for p in out.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    open_checkpoint(out)


# --------------------------------------------------------------------------- load_into

def _module_for(specs, float_dtype=torch.bfloat16):
    root = torch.nn.Module()
    for name, s in specs.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        if s.dtype == torch.int64:
            m.register_buffer(leaf, torch.zeros(s.logical_shape, dtype=torch.int32))
        else:
            dt = torch.float32 if s.dtype == torch.float32 else float_dtype
            m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(s.logical_shape, dtype=dt)))
    return root


def test_load_into(good_fp8, logical):
    r = open_checkpoint(good_fp8)
    model = _module_for(r.logical_specs(), float_dtype=torch.float32)
    load_into(model, r)
    sd = model.state_dict()
    ref = dict(r.iter_tensors(dtype=torch.float32))
    for n, t in ref.items():
        assert torch.equal(sd[n], t.to(sd[n].dtype)), n
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert torch.equal(sd["layers.0.ffn.gate.tid2eid"].long(), logical["layers.0.ffn.gate.tid2eid"])


def test_load_into_strict(good_fp8):
    r = open_checkpoint(good_fp8)
    lg = r.logical_specs()
    model = _module_for(_drop(lg, "layers.1.attn.attn_sink"))
    with pytest.raises(CheckpointError, match="no place in the model") as ei:
        load_into(model, r)
    assert "layers.1.attn.attn_sink" in str(ei.value) and ".safetensors" in str(ei.value)
    assert all((t == 0).all() for t in model.state_dict().values())  # nothing loaded
    model = _module_for(lg)
    model.add_module("extra", torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="missing from the checkpoint"):
        load_into(model, r)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4-experts"])
def test_load_into_reference_model(tmp_path, fmt):
    import kernels.reference.model as model_mod
    from core.checkpoint import prepare_checkpoint
    r = open_checkpoint(prepare_checkpoint(tmp_path / "ck", preset("tiny"), dtype=fmt, seed=1))
    model = model_mod.DeepseekV4Model(r.config)
    load_into(model, r)
    sd = model.state_dict()
    for n, t in r.iter_tensors(dtype=torch.float32):
        assert torch.equal(sd[n], t.to(sd[n].dtype)), n
