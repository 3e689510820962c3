"""Deterministic tiny checkpoints and the byte-level stand-in tokenizer."""

import json

import pytest
import torch

from core.config import preset
from core.checkpoint import CheckpointError, load_tokenizer, open_checkpoint, prepare_checkpoint
from core.checkpoint.tiny import balanced_tid2eid, tensor_seed
from core.checkpoint.tokenizer import ByteTokenizer


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4-experts"])
def test_prepare_is_byte_identical(tmp_path, fmt):
    cfg = preset("tiny")
    a = prepare_checkpoint(tmp_path / "a", cfg, dtype=fmt, seed=3, max_shard_bytes=2_000_000)
    b = prepare_checkpoint(tmp_path / "b", cfg, dtype=fmt, seed=3, max_shard_bytes=2_000_000)
    fa, fb = _files(a), _files(b)
    assert fa == fb
    assert {"config.json", "model.safetensors.index.json", "dsv4_byte_tokenizer.json"} <= set(fa)
    assert sum(n.endswith(".safetensors") for n in fa) > 1
    c = prepare_checkpoint(tmp_path / "c", cfg, dtype=fmt, seed=4, max_shard_bytes=2_000_000)
    fc = _files(c)
    assert fc["config.json"] == fa["config.json"]
    assert any(fc[n] != fa[n] for n in fa if n.endswith(".safetensors"))
    r = open_checkpoint(a)
    assert r.weight_format == fmt


def test_prepare_config_json(tmp_path):
    cfg = preset("tiny")
    d = prepare_checkpoint(tmp_path / "ck", cfg, dtype="mxfp4-experts")
    cj = json.loads((d / "config.json").read_text())
    assert cj["expert_dtype"] == "fp4"
    assert cj["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert cj["hidden_size"] == 256 and cj["compress_ratios"] == [0, 4, 128, 4, 0]
    d = prepare_checkpoint(tmp_path / "ck16", cfg, dtype="bf16")
    cj = json.loads((d / "config.json").read_text())
    assert "expert_dtype" not in cj and "quantization_config" not in cj


def test_initial_values(tmp_path):
    cfg = preset("tiny")
    r = open_checkpoint(prepare_checkpoint(tmp_path / "ck", cfg, dtype="bf16", seed=0))
    t = dict(r.iter_tensors(dtype=torch.float32))
    assert (t["norm.weight"] == 1).all() and (t["layers.1.attn.q_norm.weight"] == 1).all()
    assert (t["layers.0.hc_attn_base"] == 0).all() and (t["layers.0.hc_attn_scale"] == 1).all()
    assert (t["hc_head_scale"] == 1).all() and (t["layers.0.attn.attn_sink"] == 0).all()
    assert (t["layers.1.attn.compressor.ape"] == 0).all() and (t["layers.2.ffn.gate.bias"] == 0).all()
    for n in ("embed.weight", "layers.0.attn.wq_a.weight", "layers.3.ffn.experts.7.w2.weight",
              "layers.0.hc_ffn_fn", "mtp.0.e_proj.weight"):
        assert abs(t[n].std().item() - 0.02) < 0.002, n
        assert abs(t[n].mean().item()) < 0.002, n
    assert t["layers.0.hc_ffn_fn"].dtype == torch.float32
    # different tensors get different values
    assert not torch.equal(t["layers.0.ffn.experts.0.w1.weight"], t["layers.0.ffn.experts.1.w1.weight"])
    assert not torch.equal(t["layers.0.ffn.gate.tid2eid"], t["layers.1.ffn.gate.tid2eid"])


def test_tensor_seed_is_stable():
    # sha256-based: fixed across processes and Python versions
    assert tensor_seed(0, "embed.weight") == tensor_seed(0, "embed.weight")
    assert tensor_seed(0, "embed.weight") != tensor_seed(1, "embed.weight")
    # pinned: first 8 bytes (little endian, top bit cleared) of sha256(b"0:embed.weight")
    assert tensor_seed(0, "embed.weight") == 0x588F3BC5BAD8918F


@pytest.mark.parametrize("vocab,n_exp,k", [(1024, 8, 2), (1000, 256, 6), (129, 6, 6), (50, 7, 3)])
def test_balanced_tid2eid(vocab, n_exp, k):
    t = balanced_tid2eid(vocab, n_exp, k, torch.Generator().manual_seed(0))
    assert t.shape == (vocab, k) and t.dtype == torch.int64
    assert ((t >= 0) & (t < n_exp)).all()
    assert (t.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct per token
    counts = torch.bincount(t.flatten(), minlength=n_exp)
    assert counts.max() - counts.min() <= 1


def test_tokenizer_roundtrip(tmp_path):
    tok = ByteTokenizer(1024)
    for text in ["", "hello", "héllo wörld ✓ 漢字", "\x00\xff"]:
        ids = tok.encode(text)
        assert all(2 <= i < 258 for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("A") == [ord("A") + 2]
    assert tok.encode("hi", add_bos=True, add_eos=True) == [0, ord("h") + 2, ord("i") + 2, 1]
    assert tok.decode([0, 106, 107, 1, 900]) == "hi"  # specials and padding ids are skipped
    with pytest.raises(ValueError):
        ByteTokenizer(100)


def test_tokenizer_in_checkpoint(tmp_path):
    d = prepare_checkpoint(tmp_path / "ck", preset("tiny"))
    tok = load_tokenizer(d)
    assert tok.vocab_size == 1024 and tok.decode(tok.encode("abc")) == "abc"
    (d / "dsv4_byte_tokenizer.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="dsv4_byte_tokenizer.json"):
        load_tokenizer(d)
    (d / "dsv4_byte_tokenizer.json").write_text('{"type": "BPE"}')
    with pytest.raises(CheckpointError, match="dsv4-byte-tokenizer"):
        load_tokenizer(d)
