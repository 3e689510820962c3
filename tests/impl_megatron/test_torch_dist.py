"""megatron-core torch_dist checkpoints under upstream names (issue #19).

A checkpoint written by megatron-core's own ``dist_checkpointing.save`` from a sharded state dict built the
way upstream's modules build theirs (grouped experts with a prepended expert axis, SwiGLU ``linear_fc1``
through megatron's ``apply_swiglu_sharded_factory``) loads into both implementations and scores exactly the
log-probabilities of the HF checkpoint it came from; one written by ``converters.torch_dist`` loads with
megatron-core's ``dist_checkpointing.load``."""

from __future__ import annotations

import json
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


# -- through the CLI -------------------------------------------------------------------------------------------

SEQS = [[0, 72, 105, 33, 5, 9, 11, 200, 3], [0, 50, 7], [4]]


def _dsv4(*args):
    """The CLI in this process (the session's one-rank gloo group is reused)."""
    from click.testing import CliRunner

    from launchers.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def _cli_logprobs(tmp_path, checkpoint, impl, *extra):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(SEQS))
    res = _dsv4("logprobs", "--impl", impl, "--checkpoint", checkpoint, "--tokens", tokens, *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def megatron_written(tmp_path_factory, tiny_config, hf_native):
    """A checkpoint written by megatron-core's own ``dist_checkpointing.save`` from upstream's sharded state
    dict: no config.json beside it, as Megatron writes it."""
    from megatron.core import dist_checkpointing

    ckpt = tmp_path_factory.mktemp("mcore") / "ckpt"
    ckpt.mkdir()
    with cpu_save_context():
        dist_checkpointing.save(_upstream_sharded_state_dict(hf_native, tiny_config), str(ckpt))
    return ckpt


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_dsv4_logprobs_from_torch_dist_equal_the_hf_checkpoints(tmp_path, tiny_checkpoint, tiny_config, hf_native,
                                                                 megatron_written, impl):
    want = _cli_logprobs(tmp_path, tiny_checkpoint, impl)
    assert [len(x) for x in want] == [8, 2, 0]
    # megatron-core wrote it (no config.json): the model is named with --model
    assert _cli_logprobs(tmp_path, megatron_written, impl, "--model", "tiny") == want
    # save_torch_dist wrote it (megatron-core's save, config.json beside it): --checkpoint alone
    ours = save_torch_dist(tmp_path / "ours", hf_native, tiny_config)
    assert _cli_logprobs(tmp_path, ours, impl) == want
    # packed into one THD stream, the same path the several-process scorers take
    packed = _cli_logprobs(tmp_path, ours, impl, "--qkv-format", "thd")
    assert all(abs(a - b) <= 1e-5 for x, y in zip(packed, want) for a, b in zip(x, y))


def test_a_megatron_written_checkpoint_without_a_model_is_refused_with_the_fix(tmp_path, megatron_written):
    tokens = tmp_path / "t.json"
    tokens.write_text("[[0, 1, 2]]")
    res = _dsv4("logprobs", "--checkpoint", megatron_written, "--tokens", tokens)
    assert res.exit_code == 1
    assert "without config.json" in res.output and "--model PRESET" in res.output
    wrong = _dsv4("logprobs", "--checkpoint", megatron_written, "--tokens", tokens, "--model", "flash-shaped")
    assert wrong.exit_code == 1 and "does not hold this model's tensors" in wrong.output


def test_convert_format_torch_dist_loads_with_megatron_core(tmp_path, tiny_checkpoint, tiny_config, hf_native):
    from megatron.core import dist_checkpointing

    out = tmp_path / "tdist"
    res = _dsv4("convert", "--format", "torch_dist", "--hf", tiny_checkpoint, "--out", out)
    assert res.exit_code == 0, res.output
    assert is_torch_dist_checkpoint(out) and (out / "config.json").is_file()
    assert (out / "dsv4_byte_tokenizer.json").is_file()  # the tokenizer travels with the weights
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".dsv4-locks"]
    assert not left  # no temporaries left beside it
    loaded = dist_checkpointing.load(_upstream_sharded_state_dict(hf_native, tiny_config, empty=True), str(out))
    for n, t in hf_native.items():
        assert torch.equal(loaded[n].to(t.dtype), t), n  # the HF file's bf16 values, exactly
    again = _dsv4("convert", "--format", "torch_dist", "--hf", tiny_checkpoint, "--out", out)
    assert again.exit_code == 0 and "already converted" in again.output
    # a native conversion into the same folder is another stage's output: refused, nothing replaced
    other = _dsv4("convert", "--hf", tiny_checkpoint, "--out", out)
    assert other.exit_code == 1 and "--overwrite" in other.output and is_torch_dist_checkpoint(out)
    # inspect reads its config
    res = _dsv4("inspect", "--checkpoint", out, "--json")
    assert json.loads(res.stdout)["total"] == json.loads(_dsv4("inspect", "--preset", "tiny", "--json").stdout)["total"]


def test_train_starts_from_a_torch_dist_checkpoint(tmp_path, tiny_checkpoint, tiny_config, hf_native):
    """`dsv4 train --model TORCH_DIST_DIR`: the first step's loss is the HF checkpoint's."""
    from tests.cli_process import run_module

    ours = save_torch_dist(tmp_path / "ours", hf_native, tiny_config)

    def first_loss(model, run_dir):
        proc = run_module("launchers.cli", ["train", "--impl", "megatron", "--mode", "sft", "--steps", "1", "--model",
                                            model, "--run-dir", run_dir], timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "torch_dist" in proc.stderr if model == ours else True
        return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    assert first_loss(ours, tmp_path / "r1") == first_loss(tiny_checkpoint, tmp_path / "r2")
