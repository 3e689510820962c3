"""`dsv4 train --compile --cuda-graphs` on the CPU: what can be checked without a GPU.

* padding (``pad_to_length``, the static shapes CUDA graphs need) leaves an SFT step exact: the padded
  step's loss, MTP loss and every parameter's gradient equal the unpadded step's (fp32, 1e-6), for both
  implementations (miles BSHD; megatron THD, rows packed one segment each);
* a sequence longer than ``pad_to_length`` is refused naming the fix;
* the refusals: without --compile, without pad_to_length, with the indexer KL loss, in GRPO mode, on the
  CPU, with packing, context / tensor / expert parallelism (the combination table's rule
  ``train-cuda-graphs``), micro-batches of unequal rows; each one line through `dsv4 train`.

The GPU run itself (losses of the graphed run against the eager run) is tests/train/test_cuda_graphs_gpu.py.
"""

import dataclasses
import re

import pytest
import torch
from click.testing import CliRunner

from core.config import ConfigError, preset


def small_config():
    # 3 trunk layers (layer 0 hash-routed, 1 CSA with an indexer, 2 learned) + 1 MTP layer
    return preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)


def run_config(impl, **kw):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, model=small_config(), job="train", **kw), make_host(third_party=False),
                     model_name="small")


def one_step(impl, run_dir, **knobs):
    """One SFT step of a fresh run: ``(metrics row, {parameter: gradient})``."""
    from train.sft import sft_step
    from train.trainer import TrainConfig, _Run

    cfg = TrainConfig(batch_size=4, mtp_coef=0.3, grad_clip=1e9, lr=1e-3, **knobs)
    run = _Run(run_config(impl), small_config(), "sft", 1, run_dir, False, cfg, False)
    row = sft_step(run, 1)
    grads = {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}
    return row, grads


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_a_padded_sft_step_equals_the_unpadded_step(impl, tmp_path):
    plain, g_plain = one_step(impl, tmp_path / "plain")
    padded, g_padded = one_step(impl, tmp_path / "padded", pad_to_length=24)
    assert padded["tokens"] == 4 * 24 > plain["tokens"]              # the padding was there
    assert padded["response_tokens"] == plain["response_tokens"]
    assert padded["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=1e-7)
    assert padded["mtp_loss"] == pytest.approx(plain["mtp_loss"], rel=1e-6, abs=1e-7)
    assert padded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    # the whole gradient within 1e-6 of its scale (per element: a few near-zero gradients, sums of many
    # cancelling terms, differ in their last bits when the padded shapes change the summation order)
    assert g_plain.keys() == g_padded.keys() and len(g_plain) > 10
    g = torch.cat([g_plain[n].flatten() for n in g_plain])
    d = torch.cat([(g_padded[n] - g_plain[n]).flatten() for n in g_plain])
    assert float(d.abs().max()) <= 1e-6 * float(g.abs().max())
    assert float(d.norm()) <= 1e-6 * float(g.norm())


def test_a_sequence_longer_than_pad_to_length_is_refused_naming_the_fix(tmp_path):
    from core.errors import UserInputError

    with pytest.raises(UserInputError, match=r"longer than pad_to_length=8\. Fix: raise pad_to_length to \d+"):
        one_step("miles", tmp_path / "run", pad_to_length=8)


def _knobs(**kw):
    from train.trainer import TrainConfig

    return TrainConfig(**kw)


@pytest.mark.parametrize("knobs, match", [
    (dict(cuda_graphs=True), "add --compile"),
    (dict(cuda_graphs=True, compile_blocks=True), "set pad_to_length=N"),
    (dict(cuda_graphs=True, compile_blocks=True, pad_to_length=64, dsa_indexer_loss_coeff=0.1), "indexer KL"),
    (dict(pad_to_length=64, dsa_indexer_loss_coeff=0.1), "padding included"),
    (dict(pad_to_length=64, max_tokens_per_rank=256), "give one of them"),
    (dict(pad_to_length=1), "pad_to_length"),
])
def test_knobs_that_cannot_give_static_graphs_are_refused(knobs, match):
    with pytest.raises(ConfigError, match=match):
        _knobs(**knobs)


def test_cuda_graphs_and_padding_are_sft_only_and_need_equal_micro_batches():
    from train.config_checks import check_mode, check_static_shapes

    cfg = _knobs(cuda_graphs=True, compile_blocks=True, pad_to_length=64, micro_batch_size=3)
    check_mode("sft", cfg)
    with pytest.raises(ConfigError, match="applies to --mode sft"):
        check_mode("grpo", cfg)
    with pytest.raises(ConfigError, match="leaves a last micro-batch of 2 of this rank's 8 sequences"):
        check_static_shapes(cfg, packed=False, rows=8)
    check_static_shapes(cfg, packed=False, rows=9)
    with pytest.raises(ConfigError, match="pads rows, and this run packs them"):
        check_static_shapes(dataclasses.replace(cfg, micro_batch_size=None), packed=True, rows=8)


@pytest.mark.parametrize("choices, match", [
    (dict(hardware="cpu"), "need a GPU \\(got --hardware cpu\\). Fix: use --hardware nvidia"),
    (dict(hardware="nvidia", impl="megatron", max_tokens_per_rank=256, qkv_format="thd"), "packed \\(THD\\)"),
    (dict(hardware="nvidia", impl="megatron", cp=2, qkv_format="thd", world=2), "packed \\(THD\\)"),
    (dict(hardware="nvidia", ep=2), "expert parallelism exchanges"),
    (dict(hardware="nvidia", tp=2, world=2), "Fix: use --tp 1 --ep 1"),
])
def test_the_table_refuses_cuda_graphs_where_they_cannot_apply(choices, match):
    from core.combinations import InvalidCombination
    from launchers.builtin_plugins import make_host
    from train.config_checks import check_train_options

    cfg = _knobs(cuda_graphs=True, compile_blocks=True, pad_to_length=64)
    rc = run_config(**{"impl": "miles", **choices})
    with pytest.raises(InvalidCombination, match=match):
        check_train_options(rc, cfg, make_host(third_party=False))
    check_train_options(rc, dataclasses.replace(cfg, cuda_graphs=False))   # the same run without graphs is fine
    check_train_options(run_config("miles", hardware="nvidia"), cfg)        # one GPU, BSHD: graphs apply


@pytest.mark.parametrize("args, match", [
    (["--cuda-graphs"], "add --compile"),
    (["--compile", "--cuda-graphs", "pad_to_length=64"], "applies to --mode sft"),
    (["--compile", "--cuda-graphs", "pad_to_length=64", "--mode", "sft"], "need a GPU"),
])
def test_dsv4_train_refuses_in_one_line_before_any_work(tmp_path, args, match):
    from launchers.cli import main

    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--hardware", "cpu", "--run-dir", str(run), *args])
    assert res.exit_code != 0 and "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and len(res.stderr.strip().splitlines()) <= 2, res.stderr
    assert re.search(match, errors[0]), errors[0]
    assert not run.exists()


def test_print_config_shows_the_knobs():
    from launchers.cli import main

    res = CliRunner().invoke(main, ["train", "--hardware", "cpu", "--mode", "sft", "--compile", "--cuda-graphs",
                                    "pad_to_length=64", "--print-config"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert "cuda_graphs = true" in lines and "pad_to_length = 64" in lines and "compile_blocks = true" in lines
