"""Fake-quant training (``--quant qat``) on the two real implementations, on the CPU.

With QAT on (the run config's ``quant == "qat"``: ``build_train_model`` installs
``converters.schemes.QATScheme``), the forward equals an independent composition: a high-precision copy
of the model whose routed-expert weights were replaced by ``mxfp4_qdq`` of them and whose window KV and
main-compressor entries pass through ``fp8_act_qdq`` on the nope dims (forward hooks). Gradients reach
the master weights straight through (equal to the copy's gradients at the quantized weights); shared
experts stay high precision; QAT off is bit-identical; a 2-step training run finishes for both."""

import json
import math

import pytest
import torch

from core.config import preset

IMPLS = ("miles", "megatron")


def small_config():
    # 2 trunk layers (layer 0 hash-routed; layer 1 CSA with an indexer and a compressor) + 1 MTP layer
    return preset("tiny").replace(n_layers=2, compress_ratios=(0, 4, 0), n_hash_layers=1)


def run_config(impl: str, config, quant: str = "bf16"):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, model=config, quant=quant), make_host(third_party=False),
                     model_name="small")


def _ids(config, B=2, S=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, S), generator=g)


def _logprobs(model, ids):
    return model.forward_train(ids).logprobs


def _routed(module):
    from engine.moe import DSv4GroupedExperts
    return [m for m in module.modules() if isinstance(m, DSv4GroupedExperts)]


def _plain_copy(model, impl, c):
    """The same weights in a model built without QAT."""
    from train.model import build_train_model

    ref = build_train_model(c, run_config(impl, c))
    ref.module.load_state_dict(model.module.state_dict())
    assert all(ex.qat_expert_format is None for ex in _routed(ref.module))
    return ref


def _independent_qdq_copy(model, impl, c):
    """High-precision copy: routed weights <- mxfp4_qdq(weights); KV nope dims through fp8_act_qdq."""
    from converters.fake_quant import fp8_act_qdq, mxfp4_qdq

    rope_dim = c.rope_head_dim
    ref = _plain_copy(model, impl, c)
    with torch.no_grad():
        for ex in _routed(ref.module):
            for e in range(ex.num_local_experts):
                ex.linear_fc1[e].copy_(mxfp4_qdq(ex.linear_fc1[e]))
                ex.linear_fc2[e].copy_(mxfp4_qdq(ex.linear_fc2[e]))

    class _Straight(torch.autograd.Function):     # value: the reference qdq; backward: identity
        @staticmethod
        def forward(ctx, t):
            return torch.cat((fp8_act_qdq(t[..., :-rope_dim], 64), t[..., -rope_dim:]), dim=-1)

        @staticmethod
        def backward(ctx, g):
            return g

    def nope_qdq(_mod, _inp, out):
        return _Straight.apply(out)

    n = 0
    for name, m in ref.module.named_modules():
        if name.endswith("self_attention.kv_layernorm") or name.endswith("core_attention.compressor"):
            m.register_forward_hook(nope_qdq)
            n += 1
    assert n >= 3    # every layer's KV norm + the CSA layer's main compressor
    return ref


@pytest.mark.parametrize("impl", IMPLS)
def test_qat_forward_and_gradients_match_the_independent_composition(impl):
    from train.model import build_train_model

    c = small_config()
    model = build_train_model(c, run_config(impl, c, "qat"))
    assert all(ex.qat_expert_format == "mxfp4" for ex in _routed(model.module))
    ref = _independent_qdq_copy(model, impl, c)
    plain = _plain_copy(model, impl, c)

    ids = _ids(c)
    lp_q, lp_ref = _logprobs(model, ids), _logprobs(ref, ids)
    assert torch.equal(lp_q, lp_ref)
    with torch.no_grad():
        assert not torch.equal(lp_q, _logprobs(plain, ids))     # the quantization does something

    w = torch.randn(lp_q.shape, generator=torch.Generator().manual_seed(0))
    (lp_q * w).sum().backward()
    (lp_ref * w).sum().backward()
    gq = dict(model.module.named_parameters())
    gr = dict(ref.module.named_parameters())
    n_expert = 0
    for name, p in gq.items():
        if p.grad is None:
            assert gr[name].grad is None, name
            continue
        # straight through: the master weight's gradient is the gradient at the fake-quantized weight
        torch.testing.assert_close(p.grad, gr[name].grad, rtol=1e-5, atol=1e-6, msg=name)
        if ".experts.linear_fc" in name and p.grad.abs().sum() > 0:
            n_expert += 1
        if "linear_kv_proj" in name:
            assert p.grad.abs().sum() > 0, name
    assert n_expert > 0
    # the master weights are not the quantized ones; shared experts were never touched
    for name, p in gq.items():
        if ".experts.linear_fc" in name and "shared" not in name:
            assert not torch.equal(p, gr[name]), name
        elif "shared_experts" in name:
            assert torch.equal(p, gr[name]), name


def test_gate_and_up_quantized_consistently_and_nvfp4_option():
    from converters.fake_quant import mxfp4_qdq, nvfp4_qdq
    from converters.nvfp4 import global_amax
    from train.model import build_train_model

    c = small_config()
    model = build_train_model(c, run_config("miles", c, "qat"))
    ex = _routed(model.module)[0]
    w1, w2 = ex.expert_weights(0)
    gate, up = ex.linear_fc1[0].chunk(2, dim=0)
    assert torch.equal(w1, torch.cat((mxfp4_qdq(gate), mxfp4_qdq(up))))
    assert torch.equal(w2, mxfp4_qdq(ex.linear_fc2[0]))
    ex.qat_expert_format = "nvfp4"
    w1, w2 = ex.expert_weights(0)
    amax = global_amax(gate, up)
    assert torch.equal(w1, torch.cat((nvfp4_qdq(gate, amax), nvfp4_qdq(up, amax))))
    assert torch.equal(w2, nvfp4_qdq(ex.linear_fc2[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_qat_off_is_bit_identical(impl):
    from converters.schemes import qat
    from train.model import build_train_model

    c = small_config()
    model = build_train_model(c, run_config(impl, c))
    assert all(ex.qat_expert_format is None for ex in _routed(model.module))
    ids = _ids(c)
    with torch.no_grad():
        before = _logprobs(model, ids)
        assert qat().install(model.module) > 0
        on = _logprobs(model, ids)
        qat().remove(model.module)
        after = _logprobs(model, ids)
    assert not torch.equal(before, on)
    assert torch.equal(before, after)


def test_install_refuses_a_model_without_switches():
    from converters.schemes import qat
    with pytest.raises(ValueError, match="no fake-quant switches"):
        qat().install(torch.nn.Linear(4, 4))


def test_publish_scheme_of_qat_is_bf16():
    """A QAT run publishes its trained master weights unquantized: the scheme's record says so, and the
    assembled scheme installs the fake quantization in a training model."""
    from core.assembly import assemble

    c = small_config()
    run = run_config("miles", c, "qat")
    assert run.selection.quant.publish_format == "bf16" and assemble(run).scheme.publish_format == "bf16"


@pytest.mark.parametrize("impl", IMPLS)
def test_two_qat_training_steps(impl, tmp_path):
    from reporting.metrics import read_metrics
    from orchestration import run_training

    c = small_config()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "response": f"{2 * i}",
                                        "reward": {"type": "valid_bytes"}}) + "\n" for i in range(8)))
    run_training(run_config(impl, c, "qat"), c, mode="grpo", steps=2, run_dir=tmp_path / "run", data=str(data),
                 max_new_tokens=3, prompts_per_step=1, group_size=3, lr=1e-3, mtp_coef=0.3,
                 export_at_end=False, progress=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("loss", "grad_norm", "reward_mean", "train_rollout_logprob_abs_diff", "mtp_loss"):
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (impl, k, r[k])
        assert r["grad_norm"] > 0
