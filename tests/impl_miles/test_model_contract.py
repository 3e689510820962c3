"""The miles model's tensors == the weight contract's native tensors for the tiny config;
holders (tid2eid frozen Parameter, expert_bias buffer), fp32-kept tensors, frozen indexer,
and construction through a real RunConfig (kernel ops from its kernel record)."""

from __future__ import annotations

import pytest
import torch

from core import weight_contract as wc

from ._helpers import TINY, run_config


@pytest.fixture(scope="module")
def model():
    from core.assembly import assemble

    return assemble(run_config(1)).build_model(TINY)


def test_names_and_shapes_equal_contract(model):
    want = wc.native_names(TINY)
    have = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert set(have) == set(want)
    assert len(have) == len(want)
    for n, (shape, _) in want.items():
        assert have[n] == tuple(shape), n
    # parameter count = contract count minus the buffers
    n_params = sum(p.numel() for p in model.parameters())
    n_contract = sum(torch.Size(s).numel() for n, (s, _) in want.items() if wc.holder(n) != wc.BUFFER)
    assert n_params == n_contract


def test_holders(model):
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    hash_layers = [i for i in range(TINY.n_layers) if TINY.is_hash_layer(i)]
    assert hash_layers  # tiny has hash layers
    for i in range(TINY.n_layers):
        p = f"decoder.layers.{i}.mlp.router."
        if i in hash_layers:
            t = params[p + "tid2eid"]
            assert isinstance(t, torch.nn.Parameter) and not t.requires_grad
            assert t.dtype == torch.int64 and t.shape == (TINY.vocab_size, TINY.n_activated_experts)
            assert p + "expert_bias" not in buffers
        else:
            assert p + "expert_bias" in buffers and p + "expert_bias" not in params
            assert buffers[p + "expert_bias"].dtype == torch.float32
            assert p + "tid2eid" not in params
    for n in list(params) + list(buffers):
        h = wc.holder(n)
        if h == wc.BUFFER:
            assert n in buffers
        elif h == wc.FROZEN_PARAMETER:
            assert n in params and not params[n].requires_grad
        else:
            assert n in params
            assert params[n].requires_grad == (".indexer." not in n), n  # indexer frozen by default


def test_fp32_kept_after_bf16_cast():
    from core.assembly import assemble

    m = assemble(run_config(1)).build_model(TINY).to(torch.bfloat16)
    tensors = dict(m.named_parameters())
    tensors.update(dict(m.named_buffers()))
    for n, t in tensors.items():
        if wc.keeps_fp32(n) or n.endswith("expert_bias"):
            assert t.dtype == torch.float32, n
        elif wc.is_integer_tensor(n):
            assert t.dtype == torch.int64, n
        else:
            assert t.dtype == torch.bfloat16, n
    ids = torch.randint(0, TINY.vocab_size, (1, 20))
    with torch.no_grad():
        out = m(ids)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_build_through_run_config():
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    from core.assembly import assemble

    rc = normalize(Choices(impl="miles", kernel_backend="none", hardware="cpu", model=TINY), make_host(third_party=False),
                   model_name="tiny")
    m = assemble(rc).build_model(TINY)
    import kernels.reference.attention as ref_attn

    assert m.ops.backend == "none" and m.ops.provider["sparse_attention_with_sink"] == "none"
    assert m.ops.sparse_attention_with_sink.__wrapped__ is ref_attn.sparse_attention_with_sink
    ids = torch.randint(0, TINY.vocab_size, (1, 9))
    with torch.no_grad():
        assert m.logprobs(ids).shape == (1, 8)


def test_module_names_equal_upstream_megatron(model):
    """Parameters + contract buffers == upstream Megatron-LM's state names (tests/contract/data)."""
    from tests.contract.upstream_names import load

    have = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if not wc.stale_reason(n)}
    assert sorted(have) == sorted(load("tiny")["names"])


def test_every_rms_norm_takes_the_runs_op_table(model):
    """Every ``engine.layers.RMSNorm`` (block, attention, compressor and final norms, fp32-kept weights included)
    holds the model's op table, so the backend's ``rms_norm`` (the triton kernel in a triton run) serves it."""
    from engine.layers import RMSNorm

    norms = {n: m for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert any(m.weight.dtype == torch.float32 and "compressor" in n for n, m in norms.items())
    assert norms and all(m.ops is model.ops for m in norms.values()), [n for n, m in norms.items()
                                                                     if m.ops is not model.ops]
