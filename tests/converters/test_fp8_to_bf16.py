"""FP8 -> BF16: block dequant with fp32 and e8m0 scales, narrowed error handling."""

import json

import pytest
import torch

import converters.fp8_to_bf16 as f2b
from converters.fp8_to_bf16 import convert_fp8_to_bf16, convert_into
from core.checkpoint import CheckpointError, open_checkpoint, prepare_checkpoint, write_checkpoint
from core.checkpoint.formats import e8m0_to_float
from core.checkpoint.tokenizer import TOKENIZER_FILE
from core.config import preset


def _reference_dequant(q, s):
    """Straightforward loop over 128x128 blocks."""
    out_f, in_f = q.shape
    y = torch.empty(out_f, in_f, dtype=torch.float32)
    sf = e8m0_to_float(s) if s.dtype == torch.float8_e8m0fnu else s.float()
    for i in range(0, out_f, 128):
        for j in range(0, in_f, 128):
            y[i:i + 128, j:j + 128] = q[i:i + 128, j:j + 128].float() * sf[i // 128, j // 128]
    return y.to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    return prepare_checkpoint(d / "ck", preset("tiny"), dtype="fp8", seed=3, max_shard_bytes=1_500_000)


def test_convert_e8m0_scales(fp8_ckpt, tmp_path):
    out = convert_fp8_to_bf16(fp8_ckpt, tmp_path / "bf16", progress_bar=False)
    r = open_checkpoint(out)
    assert r.weight_format == "bf16"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg
    assert not any(n.endswith(".scale") for n in r.weight_map)
    assert (out / TOKENIZER_FILE).is_file()
    rin = open_checkpoint(fp8_ckpt)
    raw = dict(rin.iter_tensors(dequantize=False))
    got = dict(r.iter_tensors(dequantize=False))
    for n, spec in rin.specs.items():
        if spec.kind == "scale":
            continue
        if spec.quant == "fp8":
            assert got[n].dtype == torch.bfloat16
            assert torch.equal(got[n], _reference_dequant(raw[n], raw[n[:-len("weight")] + "scale"])), n
        else:
            assert torch.equal(got[n].view(torch.uint8), raw[n].view(torch.uint8)), n


def test_convert_fp32_scales(tmp_path):
    config = preset("tiny")
    src = prepare_checkpoint(tmp_path / "src", config, dtype="fp8", seed=4)
    r = open_checkpoint(src)

    def tensors():
        for n, t in r.iter_tensors(dequantize=False):
            if r.specs[n].kind == "scale":
                t = e8m0_to_float(t) * 1.5   # not a power of two: a true fp32 scale
            yield n, t

    src32 = write_checkpoint(tmp_path / "src32", config, tensors(), weight_format="fp8")
    raw = dict(open_checkpoint(src32).iter_tensors(dequantize=False))
    assert raw["layers.0.attn.wq_a.scale"].dtype == torch.float32
    out = convert_fp8_to_bf16(src32, tmp_path / "out", progress_bar=False)
    got = dict(open_checkpoint(out).iter_tensors(dequantize=False))
    for n in ("layers.0.attn.wq_a.weight", "layers.1.ffn.experts.2.w2.weight", "mtp.0.e_proj.weight"):
        assert torch.equal(got[n], _reference_dequant(raw[n], raw[n[:-len("weight")] + "scale"]))


def test_mxfp4_experts_are_dequantized_too(tmp_path):
    src = prepare_checkpoint(tmp_path / "mx", preset("tiny"), dtype="mxfp4-experts", seed=0)
    out = convert_fp8_to_bf16(src, tmp_path / "out", progress_bar=False)
    a = dict(open_checkpoint(src).iter_tensors(dequantize=True, dtype=torch.bfloat16))
    b = dict(open_checkpoint(out).iter_tensors(dequantize=False))
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_failure_inside_dequant_is_not_swallowed(fp8_ckpt, tmp_path, monkeypatch):
    class Boom(RuntimeError):
        pass

    calls = []

    def broken(q, scale, **kw):
        calls.append(q.shape)
        raise Boom("kernel failed")

    monkeypatch.setattr(f2b, "fp8_block_dequantize", broken)
    with pytest.raises(Boom, match="kernel failed"):
        convert_fp8_to_bf16(fp8_ckpt, tmp_path / "out", progress_bar=False)
    assert len(calls) == 1
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]

    # a KeyError raised inside dequant must not be mistaken for a missing scale either
    monkeypatch.setattr(f2b, "fp8_block_dequantize", lambda *a, **k: {}["oops"])
    with pytest.raises(KeyError, match="oops"):
        convert_fp8_to_bf16(fp8_ckpt, tmp_path / "out", progress_bar=False)


def test_missing_scale_is_a_hard_error(fp8_ckpt, tmp_path):
    # drop one scale from the index and its shard (validate=False: skip the official-table check)
    import shutil
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(fp8_ckpt, bad)
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = "layers.1.attn.wkv.scale"
    shard = idx["weight_map"].pop(victim)
    d = load_file(str(bad / shard))
    del d[victim]
    save_file(d, str(bad / shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="missing scale") as ei:
        convert_into(bad, tmp_path / "o", validate=False, progress_bar=False)
    assert ei.value.tensor == "layers.1.attn.wkv.weight"
    with pytest.raises(CheckpointError, match="missing scale"):
        convert_fp8_to_bf16(bad, tmp_path / "o2", progress_bar=False)  # validation catches it too


def test_scale_in_another_shard(tmp_path):
    """A weight whose scale is stored in a different shard is still dequantized."""
    import shutil
    from safetensors.torch import load_file, save_file
    config = preset("tiny")
    src = prepare_checkpoint(tmp_path / "src", config, dtype="fp8", seed=0, max_shard_bytes=1_500_000)
    moved = tmp_path / "moved"
    shutil.copytree(src, moved)
    idx = json.loads((moved / "model.safetensors.index.json").read_text())
    victim = "layers.0.attn.wq_a.scale"
    files = sorted(set(idx["weight_map"].values()))
    a = idx["weight_map"][victim]
    b = next(f for f in files if f != a)
    da, db = load_file(str(moved / a)), load_file(str(moved / b))
    db[victim] = da.pop(victim)
    save_file(da, str(moved / a), metadata={"format": "pt"})
    save_file(db, str(moved / b), metadata={"format": "pt"})
    idx["weight_map"][victim] = b
    (moved / "model.safetensors.index.json").write_text(json.dumps(idx))
    out = convert_fp8_to_bf16(moved, tmp_path / "out", progress_bar=False)
    ref = open_checkpoint(src).get_tensor("layers.0.attn.wq_a.weight", dtype=torch.bfloat16)
    assert torch.equal(open_checkpoint(out).get_tensor("layers.0.attn.wq_a.weight"), ref)
