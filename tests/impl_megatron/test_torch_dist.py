"""megatron-core torch_dist checkpoints under upstream names (issue #19).

A checkpoint written by megatron-core's own ``dist_checkpointing.save`` from a sharded state dict built the
way upstream's modules build theirs (grouped experts with a prepended expert axis, SwiGLU ``linear_fc1``
through megatron's ``apply_swiglu_sharded_factory``) loads into both implementations and scores exactly the
log-probabilities of the HF checkpoint it came from; one written by ``converters.torch_dist`` loads with
megatron-core's ``dist_checkpointing.load``."""

from __future__ import annotations

import re

import pytest
import torch

from converters.torch_dist import cpu_save_context, is_torch_dist_checkpoint, load_torch_dist, save_torch_dist
from core import weight_contract as wc

from .conftest import run_config

_RX = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)\Z")


def _upstream_sharded_state_dict(native, config, *, empty=False):
    """What upstream's GPTModel.sharded_state_dict holds (TP = PP = EP = 1), from contract tensors."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    E = config.n_routed_experts
    sd = {}
    for name, t in native.items():
        t = torch.empty_like(t) if empty else t.detach().clone()
        if name.endswith("tid2eid"):
            t = t.to(torch.int32)
        m = _RX.match(name)
        if m is None:
            sd[name] = ShardedTensor.from_rank_offsets(name, t, replica_id=0)
            continue
        key = f"{m.group(1)}experts.{m.group(2)}.weight"
        offsets = ((0, int(m.group(3)), E),)
        sh = ShardedTensor.from_rank_offsets(key, t, *offsets, replica_id=0, prepend_axis_num=1)
        sd[name] = apply_swiglu_sharded_factory(sh, offsets) if m.group(2) == "linear_fc1" else sh
    return sd


@pytest.fixture(scope="module")
def hf_native(tiny_checkpoint, tiny_config):
    from core.checkpoint import open_checkpoint

    r = open_checkpoint(tiny_checkpoint)
    return dict(wc.hf_to_native(r.iter_tensors(dequantize=True, dtype=torch.float32), tiny_config))


def _logprobs(impl, config, load):
    from launchers.stages import sequence_logprobs

    run = run_config(config) if impl == "megatron" else _miles_run(config)
    from core.assembly import assemble

    model = assemble(run).build_model(config)
    load(model)
    model.eval()
    seqs = [[0, 72, 105, 33, 5, 9, 11, 200, 3], [0, 50, 7]]
    with torch.no_grad():
        return [sequence_logprobs(model, run.qkv_format, s, "cpu") for s in seqs]


def _miles_run(config):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl="miles", kernel_backend="none", model=config), make_host(third_party=False),
                     model_name="test")


@pytest.mark.parametrize("impl", ["megatron", "miles"])
def test_megatron_core_checkpoint_scores_like_the_hf_checkpoint(tmp_path, tiny_checkpoint, tiny_config, hf_native,
                                                                 impl):
    from megatron.core import dist_checkpointing

    from engine.loading import load_hf_checkpoint, load_native_tensors

    ckpt = tmp_path / "mcore"
    ckpt.mkdir()
    with cpu_save_context():
        dist_checkpointing.save(_upstream_sharded_state_dict(hf_native, tiny_config), str(ckpt))
    assert is_torch_dist_checkpoint(ckpt)
    state, _ = load_torch_dist(ckpt, tiny_config)
    assert state.keys() == hf_native.keys()
    for n, t in hf_native.items():
        assert torch.equal(state[n].to(t.dtype), t), n
    want = _logprobs(impl, tiny_config, lambda m: load_hf_checkpoint(m, tiny_checkpoint, tiny_config))
    got = _logprobs(impl, tiny_config, lambda m: load_native_tensors(m, state.items()))
    assert got == want


def test_our_checkpoint_loads_with_megatron_core(tmp_path, tiny_config, hf_native):
    from megatron.core import dist_checkpointing

    out = save_torch_dist(tmp_path / "ours", hf_native, tiny_config)
    assert is_torch_dist_checkpoint(out) and (out / "config.json").is_file()
    loaded = dist_checkpointing.load(_upstream_sharded_state_dict(hf_native, tiny_config, empty=True), str(out))
    for n, t in hf_native.items():
        got = loaded[n]
        assert got.shape == t.shape and torch.equal(got.to(t.dtype), t), n
    # and back through our reader (config from the folder)
    state, cfg = load_torch_dist(out)
    assert cfg == tiny_config and all(torch.equal(state[n], t) for n, t in hf_native.items())


def test_a_checkpoint_of_another_model_is_refused(tmp_path, tiny_config, hf_native):
    from converters.torch_dist import TorchDistError

    out = save_torch_dist(tmp_path / "c", hf_native, tiny_config)
    other = tiny_config.replace(n_routed_experts=4, n_activated_experts=2)
    with pytest.raises(TorchDistError, match=r"experts\.experts\.linear_fc1\.weight.*shape"):
        load_torch_dist(out, other)
    with pytest.raises(TorchDistError, match="not a megatron-core torch_dist checkpoint"):
        load_torch_dist(tmp_path)
