"""The scheme factories return working objects (or say honestly what is not built)."""

import pytest
import torch

from converters import schemes
from core.checkpoint import open_checkpoint, prepare_checkpoint
from core.config import preset


def test_bf16_is_identity():
    s = schemes.bf16()
    assert s.publish_format == "bf16"
    w, b = torch.randn(128, 256), torch.randn(7, dtype=torch.bfloat16)
    names = ["layers.0.attn.wq_a.weight", "layers.1.ffn.experts.0.w1.weight"]
    out = list(s.publish(zip(names, [w, b])))
    assert [n for n, _ in out] == names                      # no scales added, nothing renamed
    for (_, got), want in zip(out, [w, b]):                    # the tensors themselves (detached), not copies
        assert got.dtype == want.dtype and got.data_ptr() == want.data_ptr() and torch.equal(got, want)
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert s.prepare_training(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp8_publish():
    s = schemes.fp8()
    w = torch.randn(128, 256)
    out = dict(s.publish([("layers.0.attn.wq_a.weight", w), ("layers.0.attn.wo_a.weight", w)]))
    assert out["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert out["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    # dequantized by hand (one power-of-two scale per 128x128 block) it is the weight to e4m3's rounding (3
    # mantissa bits: at most 2^-4 relative, or half the smallest subnormal step of its block near zero)
    scale = out["layers.0.attn.wq_a.scale"].float()
    assert scale.shape == (1, 2) and torch.equal(scale, 2.0 ** scale.log2().round())
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    back = out["layers.0.attn.wq_a.weight"].float() * full
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + full * 2 ** -10).all()
    assert out["layers.0.attn.wo_a.weight"] is not None and "layers.0.attn.wo_a.scale" not in out
    s32 = schemes.FP8Scheme(scale_format="fp32")
    assert dict(s32.publish([("mtp.0.h_proj.weight", w)]))["mtp.0.h_proj.scale"].dtype == torch.float32


def test_mxfp4_fp8_prepare(tmp_path):
    s = schemes.mxfp4_fp8()
    assert s.prepare_stage == "prepare-fp8"
    src = prepare_checkpoint(tmp_path / "mx", preset("tiny"), dtype="mxfp4-experts", seed=0)
    out = s.prepare(src, tmp_path / "fp8", progress_bar=False)
    assert open_checkpoint(out).weight_format == "fp8"
    assert s.prepare(src, tmp_path / "fp8", progress_bar=False) == out  # skipped the second time


def test_nvfp4_publish():
    s = schemes.nvfp4()
    w = torch.randn(16, 32)
    out = dict(s.publish([("layers.1.ffn.experts.0.w1.weight", w), ("layers.1.ffn.experts.0.w3.weight", w),
                          ("layers.1.ffn.shared_experts.w1.weight", w)]))
    assert out["layers.1.ffn.experts.0.w1.weight"].dtype == torch.uint8
    assert out["layers.1.ffn.shared_experts.w1.weight"] is w or torch.equal(out["layers.1.ffn.shared_experts.w1.weight"], w)


def test_qat_ops_and_install_refuses_a_model_without_switches():
    s = schemes.qat()
    w = torch.randn(8, 64, requires_grad=True)
    s.fake_quant_expert(w).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    kv = torch.randn(2, 3, 192)
    assert torch.equal(s.fake_quant_kv(kv)[..., -64:], kv[..., -64:])
    # installing into the implementations is tested in tests/train/test_qat.py
    with pytest.raises(ValueError, match="Linear has no fake-quant switches"):
        s.install(torch.nn.Linear(2, 2))


def _records():
    from converters.plugin import dsv4_quant_schemes
    return {r.name: r for r in dsv4_quant_schemes()}


@pytest.mark.parametrize("name,factory,publish_format", [
    ("bf16", schemes.bf16, "bf16"), ("fp8", schemes.fp8, "fp8"), ("mxfp4-fp8", schemes.mxfp4_fp8, "fp8"),
    ("nvfp4", schemes.nvfp4, "nvfp4"), ("qat", schemes.qat, "bf16")])
def test_plugin_records_load_their_scheme(name, factory, publish_format):
    obj = _records()[name].load()()
    assert type(obj) is type(factory()) and obj == factory()
    assert obj.name == name and obj.publish_format == publish_format
