"""Parameter names, shapes, holders and dtypes of the megatron model = the weight contract's native names."""

from __future__ import annotations

import pytest
import torch

from backends.megatron.impl import native_state
from core.assembly import assemble
from core.weight_contract import BUFFER, FROZEN_PARAMETER, holder, keeps_fp32, native_names, native_to_hf

from .conftest import run_config


@pytest.fixture(scope="module")
def model(tiny_config):
    return assemble(run_config(tiny_config)).build_model(tiny_config)


def test_names_and_shapes_equal_the_contract(model, tiny_config):
    want = native_names(tiny_config)
    got = native_state(model)
    assert sorted(got) == sorted(want)
    for name, (shape, _) in want.items():
        assert tuple(got[name].shape) == tuple(shape), name


def test_parameter_count_equals_the_contract(model, tiny_config):
    want = native_names(tiny_config)
    n_contract = sum(torch.Size(s).numel() for n, (s, _) in want.items() if holder(n) != BUFFER)
    n_model = sum(p.numel() for _, p in model.named_parameters())
    assert n_model == n_contract
    # every parameter (incl. the frozen tid2eid) is a contract tensor, every buffer in the state is one too
    assert {n for n, _ in model.named_parameters()} == {n for n in want if holder(n) != BUFFER}


def test_holders_and_dtypes(model, tiny_config):
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name in native_names(tiny_config):
        h = holder(name)
        if h == BUFFER:
            assert name in buffers and name not in params, name
        else:
            assert name in params, name
            assert params[name].requires_grad == (h != FROZEN_PARAMETER), name
        t = params.get(name, buffers.get(name))
        if keeps_fp32(name):
            assert t.dtype == torch.float32, name
    # the three alphas are separate [1] parameters; mapping_proj has no bias, the static bias is its own
    # Parameter (upstream Megatron's HyperConnectionModule)
    hc = model.decoder.layers[0].self_attention_hyper_connection
    assert [tuple(getattr(hc, a).shape) for a in ("alpha_pre", "alpha_post", "alpha_res")] == [(1,)] * 3
    assert hc.bias.shape == (tiny_config.hc_mult * (tiny_config.hc_mult + 2),)
    assert not hasattr(hc.mapping_proj, "bias")
    assert isinstance(model.decoder.layers[0].self_attention.linear_o_group_proj, torch.nn.Parameter)


def test_fp32_tensors_survive_a_bf16_cast(tiny_config):
    m = assemble(run_config(tiny_config)).build_model(tiny_config).to(torch.bfloat16)
    state = native_state(m)
    for name, t in state.items():
        if keeps_fp32(name):
            assert t.dtype == torch.float32, name
    assert state["decoder.layers.0.self_attention.linear_q_down_proj.weight"].dtype == torch.bfloat16


def test_native_state_exports_to_the_official_names(model, tiny_config):
    from core.checkpoint import official_tensor_specs

    names = {n for n, _ in native_to_hf(native_state(model).items(), tiny_config)}
    official = {n for n, s in official_tensor_specs(tiny_config, "bf16").items() if not n.endswith(".scale")}
    assert names == official


def test_tensor_parallel_tilelang_and_bshd_are_refused_by_the_table(tiny_config):
    """The megatron implementation's limits live in the combination table alone (core/combinations.py)."""
    from core.combinations import InvalidCombination
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    host = make_host(third_party=False)
    cases = ((dict(tp=2), "tensor-parallel size must be 1 for the megatron implementation"),
             (dict(kernel_backend="tilelang", hardware="nvidia"), "does not serve --impl megatron"),
             (dict(qkv_format="bshd"), "supports only --qkv-format thd"))
    for choices, message in cases:
        with pytest.raises(InvalidCombination, match=message):
            normalize(Choices(impl="megatron", model=tiny_config, **choices), host)


def test_module_names_equal_upstream_megatron(model):
    """Parameters + contract buffers == upstream Megatron-LM's state names (tests/contract/data)."""
    from tests.contract.upstream_names import load

    have = {n for n, _ in model.named_parameters()} | set(native_state(model))
    assert sorted(have) == sorted(load("tiny")["names"])


def test_config_uses_upstream_field_names(model, tiny_config):
    """The DeepSeek-V4 fields upstream Megatron-LM reads are set under its names; ``mhc_eps`` is none of them."""
    import dataclasses

    c = model.config
    fields = {f.name for f in dataclasses.fields(c)}
    assert "mhc_eps" not in fields
    assert c.experimental_attention_variant == "dsv4_hybrid"
    assert c.enable_hyper_connections is True
    assert c.actual_vocab_size == tiny_config.vocab_size
    assert c.mhc_init_gating_factor == 0.01
    assert c.num_residual_streams == tiny_config.hc_mult
    assert list(c.csa_compress_ratios) == list(tiny_config.compress_ratios)
    assert c.moe_n_hash_layers == tiny_config.n_hash_layers


def test_every_rms_norm_takes_the_runs_op_table(model):
    """Every ``engine.layers.RMSNorm`` (layer, attention, compressor, final and MTP norms) holds the model's op
    table, so the backend's ``rms_norm`` (the triton kernel in a triton run) serves it."""
    from engine.layers import RMSNorm

    norms = {n: m for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert any("compressor" in n for n in norms)
    assert norms and all(m.ops is model.ops for m in norms.values()), [n for n, m in norms.items()
                                                                     if m.ops is not model.ops]
