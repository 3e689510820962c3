"""The weight contract: coverage both ways, bit-identical round trips, exact
split/pack and cat/split, and errors that name the tensor."""

from __future__ import annotations

import pytest
import torch

from core import weight_contract as wc
from core.checkpoint.io import open_checkpoint
from core.checkpoint.official_tensors import logical_specs, official_tensor_specs
from core.checkpoint.tiny import prepare_checkpoint
from core.config import preset

TINY = preset("tiny")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return prepare_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", TINY, dtype="bf16", seed=3)


def _meta_official(config):
    return [(n, torch.empty(s.logical_shape, dtype=s.logical_dtype, device="meta"))
            for n, s in logical_specs(official_tensor_specs(config, "bf16")).items()]


# ------------------------------------------------------------------ coverage
@pytest.mark.parametrize("name", ["tiny", "flash-4layer"])
def test_every_official_tensor_is_covered_both_ways(name):
    cfg = preset(name)
    official = _meta_official(cfg)
    native = list(wc.hf_to_native(official, cfg))
    declared = wc.native_names(cfg)
    # no official name without a native name, no native name without an official one
    assert sorted(n for n, _ in native) == sorted(declared)
    assert len({n for n, _ in native}) == len(native) == len(declared)
    for n, t in native:
        assert (tuple(t.shape), t.dtype) == declared[n], n
        assert t.device.type == "meta"
    back = list(wc.native_to_hf(native, cfg, official_dtypes=True))
    assert sorted(n for n, _ in back) == sorted(n for n, _ in official)
    want = dict(official)
    for n, t in back:
        assert tuple(t.shape) == tuple(want[n].shape) and t.dtype == want[n].dtype, n
    for n in declared:
        assert wc.native_to_official_names(n, cfg)
        assert not wc.is_stale_name(n, cfg), n
    for n, _ in official:
        assert set(wc.official_to_native_names(n, cfg)) <= set(declared)


def test_tiny_exercises_every_rule_of_the_table():
    hit = {id(b.rule) for b in wc.iter_bindings(TINY)}
    unused = [r.native for r in wc.TABLE if id(r) not in hit]
    assert not unused


def test_native_names_spot_checks():
    nn = wc.native_names(TINY)
    L = "decoder.layers.3."  # CSA layer (ratio 4), learned routing
    for suffix in [
        "input_layernorm.weight", "pre_mlp_layernorm.weight",
        "self_attention_hyper_connection.mapping_proj.weight", "self_attention_hyper_connection.bias",
        "self_attention_hyper_connection.alpha_pre", "mlp_hyper_connection.alpha_res",
        "self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight",
        "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_proj.weight",
        "self_attention.kv_layernorm.weight", "self_attention.linear_o_group_proj",
        "self_attention.linear_proj.weight", "self_attention.core_attention.attn_sink",
        "self_attention.core_attention.compressor.linear_wkv.weight",
        "self_attention.core_attention.compressor.linear_wgate.weight",
        "self_attention.core_attention.compressor.norm.weight", "self_attention.core_attention.compressor.ape",
        "self_attention.core_attention.indexer.linear_wq_b.weight",
        "self_attention.core_attention.indexer.linear_weights_proj.weight",
        "self_attention.core_attention.indexer.compressor.linear_wkv.weight",
        "mlp.router.weight", "mlp.router.expert_bias", "mlp.experts.linear_fc1.weight7",
        "mlp.experts.linear_fc2.weight0", "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc2.weight",
    ]:
        assert L + suffix in nn, suffix
    assert "decoder.layers.1.mlp.router.tid2eid" in nn and "decoder.layers.1.mlp.router.expert_bias" not in nn
    assert "decoder.layers.3.mlp.router.tid2eid" not in nn
    assert "decoder.layers.0.self_attention.core_attention.compressor.ape" not in nn  # window layer
    assert nn["decoder.layers.0.mlp.router.tid2eid"] == ((TINY.vocab_size, TINY.n_activated_experts), torch.int64)
    I, d = TINY.moe_inter_dim, TINY.dim
    assert nn[L + "mlp.experts.linear_fc1.weight3"] == ((2 * I, d), torch.bfloat16)
    assert nn[L + "self_attention_hyper_connection.alpha_post"] == ((1,), torch.float32)
    assert nn[L + "self_attention.core_attention.compressor.norm.weight"][1] == torch.float32
    assert nn["mtp.layers.0.e_proj.weight"] == nn["mtp.layers.0.h_proj.weight"] == ((d, d), torch.bfloat16)
    for k in ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
              "decoder.hc_head_fn", "decoder.hc_head_base", "decoder.hc_head_scale",
              "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight",
              "mtp.layers.0.hc_head_fn", "mtp.layers.0.hc_head_base", "mtp.layers.0.hc_head_scale",
              "mtp.layers.0.mtp_model_layer.self_attention.linear_o_group_proj",
              "mtp.layers.0.mtp_model_layer.mlp.router.expert_bias"]:
        assert k in nn, k


def test_fp32_and_holder_declarations():
    nn = wc.native_names(TINY)
    fp32 = {n for n in nn if wc.keeps_fp32(n)}
    for n in fp32:
        assert nn[n][1] == torch.float32, n
    expected_fp32_markers = ("attn_sink", ".ape", "compressor.norm.weight", "hyper_connection.", "hc_head_",
                             "expert_bias")
    assert fp32 == {n for n in nn if any(m in n for m in expected_fp32_markers)}
    assert wc.keeps_fp32("layers.0.hc_attn_scale") and wc.keeps_fp32("layers.1.attn.compressor.norm.weight")
    assert not wc.keeps_fp32("layers.0.attn.wq_a.weight") and not wc.keeps_fp32("unknown.name")
    assert wc.holder("decoder.layers.0.mlp.router.tid2eid") == wc.FROZEN_PARAMETER
    assert wc.holder("decoder.layers.2.mlp.router.expert_bias") == wc.BUFFER
    assert wc.holder("decoder.layers.2.mlp.router.weight") == wc.PARAMETER
    assert not wc.is_trainable("decoder.layers.0.mlp.router.tid2eid")
    assert {n for n in nn if not wc.is_trainable(n)} == {n for n in nn if n.endswith(("tid2eid", "expert_bias"))}


def test_atomic_groups_declared():
    g = wc.ATOMIC_EXPORT_GROUPS
    assert g["wqkv_a"]["official"] == ("attn.wq_a.weight", "attn.wkv.weight")
    assert g["compressor_wkv_gate"]["official"] == ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight")
    assert g["indexer_compressor_wkv_gate"]["native"] == (
        "self_attention.core_attention.indexer.compressor.linear_wkv.weight",
        "self_attention.core_attention.indexer.compressor.linear_wgate.weight")
    assert g["self_attention_hc_alphas"]["official"] == ("hc_attn_scale",)
    assert len(g["mlp_hc_alphas"]["native"]) == 3
    assert g["experts_fc1"]["official"] == ("ffn.experts.{e}.w1.weight", "ffn.experts.{e}.w3.weight")
    assert "eh_proj" not in g  # e_proj / h_proj are separate native tensors now (contract v2)
    key, members, official = wc.export_unit("decoder.layers.1.self_attention.linear_kv_proj.weight", TINY)
    assert members == ("decoder.layers.1.self_attention.linear_q_down_proj.weight",
                       "decoder.layers.1.self_attention.linear_kv_proj.weight")
    assert official == ("layers.1.attn.wq_a.weight", "layers.1.attn.wkv.weight")
    _, members, official = wc.export_unit("decoder.layers.1.mlp.experts.linear_fc1.weight5", TINY)
    assert members == ("decoder.layers.1.mlp.experts.linear_fc1.weight5",)
    assert official == ("layers.1.ffn.experts.5.w1.weight", "layers.1.ffn.experts.5.w3.weight")


# --------------------------------------------------------------- round trips
def test_round_trip_bf16_is_bit_identical(tiny_ckpt):
    reader = open_checkpoint(tiny_ckpt)
    src = dict(reader.iter_tensors(dtype=torch.bfloat16))
    assert {t.dtype for t in src.values()} == {torch.bfloat16, torch.float32, torch.int64}
    native = dict(wc.hf_to_native(reader.iter_tensors(dtype=torch.bfloat16), reader.config))
    declared = wc.native_names(reader.config)
    assert {n: (tuple(t.shape), t.dtype) for n, t in native.items()} == declared
    back = dict(wc.native_to_hf(native.items(), reader.config, official_dtypes=True))
    assert back.keys() == src.keys()
    for n, t in src.items():
        assert back[n].dtype == t.dtype, n
        assert torch.equal(back[n], t), n


def test_round_trip_fp32_is_bit_identical(tiny_ckpt):
    reader = open_checkpoint(tiny_ckpt)
    src = dict(reader.iter_tensors(dtype=torch.float32))
    native = dict(wc.hf_to_native(src.items(), TINY))
    back = dict(wc.native_to_hf(native.items(), TINY))
    assert back.keys() == src.keys()
    for n, t in src.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n


def test_round_trip_keeps_fp32_tensors_fp32(tiny_ckpt):
    native = dict(wc.hf_to_native(open_checkpoint(tiny_ckpt).iter_tensors(), TINY))
    back = dict(wc.native_to_hf(native.items(), TINY))  # no cast: what an engine receives
    for n, t in back.items():
        if wc.keeps_fp32(n):
            assert t.dtype == torch.float32, n
        elif n.endswith("tid2eid"):
            assert t.dtype == torch.int64
        else:
            assert t.dtype == torch.bfloat16, n


def test_round_trip_native_first_with_random_values():
    g = torch.Generator().manual_seed(0)
    native = {}
    for n, (shape, dt) in wc.native_names(TINY).items():
        if dt.is_floating_point:
            native[n] = torch.randn(shape, generator=g).to(dt)
        else:
            native[n] = torch.randint(0, TINY.n_routed_experts, shape, generator=g, dtype=dt)
    back = dict(wc.hf_to_native(wc.native_to_hf(native.items(), TINY), TINY))
    assert back.keys() == native.keys()
    for n, t in native.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n


# --------------------------------------------------------- split/pack, cat
def test_alpha_split_and_pack_are_exact():
    scale = torch.tensor([1.2345678e-3, -7.0e12, 3.0e-41], dtype=torch.float32)  # incl. a subnormal
    out = dict(wc.hf_to_native([("layers.2.hc_ffn_scale", scale)], TINY))
    p = "decoder.layers.2.mlp_hyper_connection."
    assert list(out) == [p + "alpha_pre", p + "alpha_post", p + "alpha_res"]
    for i, k in enumerate(out):
        assert out[k].shape == (1,) and out[k].dtype == torch.float32
        assert out[k].view(torch.int32).item() == scale[i : i + 1].view(torch.int32).item()
        assert out[k].untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()  # no aliasing
    # re-packed [pre, post, res] whatever the arrival order
    back = list(wc.native_to_hf([(p + "alpha_res", out[p + "alpha_res"]), (p + "alpha_pre", out[p + "alpha_pre"]),
                                 (p + "alpha_post", out[p + "alpha_post"])], TINY))
    assert [n for n, _ in back] == ["layers.2.hc_ffn_scale"]
    assert torch.equal(back[0][1].view(torch.int32), scale.view(torch.int32))


def test_mtp_alpha_split():
    scale = torch.tensor([1.0, 2.0, 3.0])
    out = dict(wc.hf_to_native([("mtp.0.hc_attn_scale", scale)], TINY))
    p = "mtp.layers.0.mtp_model_layer.self_attention_hyper_connection."
    assert [out[p + s].item() for s in ("alpha_pre", "alpha_post", "alpha_res")] == [1.0, 2.0, 3.0]


def test_fc1_cat_and_split_are_exact():
    g = torch.Generator().manual_seed(1)
    I, d = TINY.moe_inter_dim, TINY.dim
    w1 = torch.randn(I, d, generator=g).to(torch.bfloat16)
    w3 = torch.randn(I, d, generator=g).to(torch.bfloat16)
    w2 = torch.randn(d, I, generator=g).to(torch.bfloat16)
    out = list(wc.hf_to_native([("layers.3.ffn.experts.6.w1.weight", w1), ("layers.3.ffn.experts.6.w2.weight", w2),
                                ("layers.3.ffn.experts.6.w3.weight", w3)], TINY))
    # streaming: w2 is emitted as soon as it arrives, fc1 once both halves are in
    assert [n for n, _ in out] == ["decoder.layers.3.mlp.experts.linear_fc2.weight6",
                                   "decoder.layers.3.mlp.experts.linear_fc1.weight6"]
    fc1 = out[1][1]
    assert fc1.shape == (2 * I, d) and torch.equal(fc1[:I], w1) and torch.equal(fc1[I:], w3)
    back = dict(wc.native_to_hf([out[1]], TINY))
    assert list(back) == ["layers.3.ffn.experts.6.w1.weight", "layers.3.ffn.experts.6.w3.weight"]
    assert torch.equal(back["layers.3.ffn.experts.6.w1.weight"], w1)
    assert torch.equal(back["layers.3.ffn.experts.6.w3.weight"], w3)
    assert back["layers.3.ffn.experts.6.w1.weight"].is_contiguous()


def test_shared_expert_and_mtp_projection_layouts():
    I, d = TINY.moe_inter_dim * TINY.n_shared_experts, TINY.dim
    w1, w3 = torch.full((I, d), 1.0), torch.full((I, d), 3.0)
    (n, fc1), = wc.hf_to_native([("mtp.0.ffn.shared_experts.w3.weight", w3),
                                 ("mtp.0.ffn.shared_experts.w1.weight", w1)], TINY)
    assert n == "mtp.layers.0.mtp_model_layer.mlp.shared_experts.linear_fc1.weight"
    assert torch.equal(fc1, torch.cat([w1, w3]))  # gate (w1) first whatever the arrival order
    e, h = torch.randn(d, d), torch.randn(d, d)
    out = dict(wc.hf_to_native([("mtp.0.e_proj.weight", e), ("mtp.0.h_proj.weight", h)], TINY))
    assert list(out) == ["mtp.layers.0.e_proj.weight", "mtp.layers.0.h_proj.weight"]  # renames, no fusing
    assert torch.equal(out["mtp.layers.0.e_proj.weight"], e) and torch.equal(out["mtp.layers.0.h_proj.weight"], h)
    back = dict(wc.native_to_hf(out.items(), TINY))
    assert torch.equal(back["mtp.0.e_proj.weight"], e) and torch.equal(back["mtp.0.h_proj.weight"], h)


# -------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", ["layers.0.attn.mystery.weight", "bogus", "layers.0.attn.wq_a.scale",
                                  "decoder.layers.0.self_attention.linear_q_down_proj.weight"])
def test_unknown_official_name_raises_with_the_name(name):
    with pytest.raises(wc.WeightContractError, match=name.replace(".", r"\.")):
        list(wc.hf_to_native([(name, torch.zeros(1))], TINY))


@pytest.mark.parametrize("name", ["decoder.layers.0.self_attention.wq_a.weight", "decoder.hc_head_params.hc_head_fn",
                                  "decoder.layers.0.hc_attn_fn", "layers.0.attn.wq_a.weight", "x.y.z",
                                  "decoder.layers.01.input_layernorm.weight"])
def test_unknown_native_name_raises_with_the_name(name):
    with pytest.raises(wc.WeightContractError, match=name.replace(".", r"\.")):
        list(wc.native_to_hf([(name, torch.zeros(1))], TINY))


def test_names_outside_the_config_raise():
    d = TINY.dim
    for name, t in [("layers.9.attn_norm.weight", torch.zeros(d)),                # layer out of range
                    ("layers.0.attn.compressor.ape", torch.zeros(4, 256)),        # window layer: no compressor
                    ("layers.2.ffn.gate.tid2eid", torch.zeros(1024, 2, dtype=torch.int64)),  # not a hash layer
                    ("layers.1.ffn.experts.8.w2.weight", torch.zeros(d, TINY.moe_inter_dim)),  # expert range
                    ("mtp.1.enorm.weight", torch.zeros(d))]:
        with pytest.raises(wc.WeightContractError, match=name.replace(".", r"\.")):
            list(wc.hf_to_native([(name, t)], TINY))


def test_bad_shape_dtype_duplicate_and_incomplete_groups_raise():
    d = TINY.dim
    with pytest.raises(wc.WeightContractError, match=r"layers\.0\.attn_norm\.weight.*shape"):
        list(wc.hf_to_native([("layers.0.attn_norm.weight", torch.zeros(d + 1))], TINY))
    with pytest.raises(wc.WeightContractError, match="integer"):
        list(wc.hf_to_native([("layers.0.ffn.gate.tid2eid", torch.zeros(1024, 2))], TINY))
    with pytest.raises(wc.WeightContractError, match="twice"):
        list(wc.hf_to_native([("norm.weight", torch.zeros(d)), ("norm.weight", torch.zeros(d))], TINY))
    with pytest.raises(wc.WeightContractError, match=r"layers\.1\.ffn\.experts\.2\.w3\.weight"):
        list(wc.hf_to_native([("layers.1.ffn.experts.2.w1.weight", torch.zeros(TINY.moe_inter_dim, d))], TINY))
    p = "decoder.layers.1.self_attention_hyper_connection."
    with pytest.raises(wc.WeightContractError, match=r"alpha_post.*alpha_res|alpha_res.*alpha_post"):
        list(wc.native_to_hf([(p + "alpha_pre", torch.zeros(1))], TINY))


def test_stale_names():
    for n in ["decoder.layers.0.self_attention.wq_a.weight", "decoder.layers.3.hc_attn_fn",
              "decoder.layers.3.hc_ffn_scale", "decoder.hc_head_params.hc_head_fn",
              "decoder.layers.1.self_attention.attn_sink", "decoder.layers.1.self_attention.compressor.wkv.weight",
              "mtp.layers.0.transformer_layer.input_layernorm.weight", "mtp.layers.0.eh_proj.weight",
              "decoder.layers.0.mlp_hyper_connection.mapping_proj.bias", "module.decoder.final_layernorm.weight",
              "layers.0.attn.wq_a.weight", "something.else"]:
        assert wc.is_stale_name(n), n
        assert wc.stale_reason(n)
    assert "core_attention" in wc.stale_reason("decoder.layers.1.self_attention.attn_sink")
    # contract v1 names are refused with the upstream name to use instead
    assert "mtp_model_layer" in wc.stale_reason("mtp.layers.0.transformer_layer.input_layernorm.weight")
    assert "e_proj" in wc.stale_reason("mtp.layers.0.eh_proj.weight")
    assert "_hyper_connection.bias" in wc.stale_reason("decoder.layers.0.mlp_hyper_connection.mapping_proj.bias")
    assert not wc.is_stale_name("mtp.layers.0.mtp_model_layer.input_layernorm.weight", TINY)
    assert not wc.is_stale_name("decoder.layers.1.self_attention.core_attention.attn_sink")
    assert not wc.is_stale_name("decoder.layers.99.input_layernorm.weight")  # structurally fine ...
    assert wc.is_stale_name("decoder.layers.99.input_layernorm.weight", TINY)  # ... but not in this model
    with pytest.raises(wc.WeightContractError, match=r"self_attention\.wq_a\.weight"):
        wc.check_native_state(["decoder.layers.0.self_attention.wq_a.weight"], TINY)


def test_bridge_local_experts_names_are_accepted_on_import():
    c = wc.canonical_native_name
    assert c("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight") == \
        "decoder.layers.3.mlp.experts.linear_fc1.weight7"
    assert c("mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.0.linear_fc2.weight") == \
        "mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc2.weight0"
    for n in ["decoder.layers.3.mlp.shared_experts.linear_fc1.weight", "decoder.final_layernorm.weight"]:
        assert c(n) == n
    assert wc.is_stale_name("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight")  # not a contract name
    assert not wc.is_stale_name(c("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"), TINY)


def _toy_model(tid2eid_as_buffer=False, sink_dtype=torch.float32):
    """A module tree holding a few contract tensors under their native names."""
    root = torch.nn.Module()
    dec = torch.nn.Module()
    root.add_module("decoder", dec)
    layers = torch.nn.ModuleList([torch.nn.Module()])
    dec.add_module("layers", layers)
    mlp, router = torch.nn.Module(), torch.nn.Module()
    layers[0].add_module("mlp", mlp)
    mlp.add_module("router", router)
    router.weight = torch.nn.Parameter(torch.zeros(TINY.n_routed_experts, TINY.dim))
    table = torch.zeros(TINY.vocab_size, TINY.n_activated_experts, dtype=torch.int64)
    if tid2eid_as_buffer:
        router.register_buffer("tid2eid", table)
    else:
        router.tid2eid = torch.nn.Parameter(table, requires_grad=False)
    sa, ca = torch.nn.Module(), torch.nn.Module()
    layers[0].add_module("self_attention", sa)
    sa.add_module("core_attention", ca)
    ca.attn_sink = torch.nn.Parameter(torch.zeros(TINY.n_heads, dtype=sink_dtype))
    ca.register_buffer("scratch", torch.zeros(1))  # not a contract name: ignored
    wrapper = torch.nn.Module()
    wrapper.add_module("module", root)
    return wrapper


def test_module_tensors_checks_holders():
    names = [n for n, _ in wc.module_tensors(_toy_model(), TINY)]
    assert names == ["decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.router.tid2eid",
                     "decoder.layers.0.self_attention.core_attention.attn_sink"]
    with pytest.raises(wc.WeightContractError, match=r"tid2eid.*must be a Parameter"):
        list(wc.module_tensors(_toy_model(tid2eid_as_buffer=True), TINY))
    with pytest.raises(wc.WeightContractError, match=r"attn_sink.*fp32"):
        list(wc.module_tensors(_toy_model(sink_dtype=torch.bfloat16), TINY))
    m = _toy_model()
    m.module.decoder.layers[0].self_attention.wq_a = torch.nn.Linear(2, 2)
    with pytest.raises(wc.WeightContractError, match=r"self_attention\.wq_a\.weight"):
        list(wc.module_tensors(m, TINY))


def test_round_trip_of_a_quantised_checkpoint_read_dequantised(tmp_path):
    path = prepare_checkpoint(tmp_path / "q", TINY, dtype="mxfp4-experts", seed=1)
    reader = open_checkpoint(path)
    with pytest.raises(wc.WeightContractError, match=r"\.scale.*dequantize=True"):
        list(wc.hf_to_native(reader.iter_tensors(dequantize=False), reader.config))
    raw = reader.get_tensor("layers.0.attn.wq_a.weight", dequantize=False)
    with pytest.raises(wc.WeightContractError, match=r"layers\.0\.attn\.wq_a\.weight.*dequantize=True"):
        list(wc.hf_to_native([("layers.0.attn.wq_a.weight", raw)], reader.config))
    src = dict(reader.iter_tensors())
    back = dict(wc.native_to_hf(wc.hf_to_native(src.items(), reader.config), reader.config, official_dtypes=True))
    assert back.keys() == src.keys()
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in src.items())
