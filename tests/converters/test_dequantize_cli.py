"""`dsv4 dequantize`: FP8 (e8m0 or fp32 scales) -> BF16 through the CLI, as a safe stage."""

import json

import torch
from click.testing import CliRunner

from core.checkpoint import open_checkpoint, prepare_checkpoint, write_checkpoint
from core.checkpoint.formats import e8m0_to_float
from core.config import preset
from launchers.cli import main


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_dequantize_e8m0_checkpoint_and_rerun_is_skipped(tmp_path):
    src = prepare_checkpoint(tmp_path / "fp8", preset("tiny"), dtype="fp8", seed=3, max_shard_bytes=1_500_000)
    out = tmp_path / "bf16"
    result = invoke("dequantize", "--in", str(src), "--out", str(out))
    assert result.exit_code == 0, result.output
    r = open_checkpoint(out)
    assert r.weight_format == "bf16"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    want = dict(open_checkpoint(src).iter_tensors(dequantize=True, dtype=torch.bfloat16))
    got = dict(r.iter_tensors(dequantize=False))
    assert got.keys() == want.keys()
    for n, t in want.items():
        if t.dtype == torch.bfloat16:
            assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], t), n
    stamp = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    again = invoke("dequantize", "--in", str(src), "--out", str(out))
    assert again.exit_code == 0, again.output
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == stamp  # skipped, not rebuilt


def test_dequantize_fp32_scales(tmp_path):
    config = preset("tiny")
    r = open_checkpoint(prepare_checkpoint(tmp_path / "src", config, dtype="fp8", seed=4))

    def tensors():
        for n, t in r.iter_tensors(dequantize=False):
            yield n, (e8m0_to_float(t) * 1.5 if r.specs[n].kind == "scale" else t)

    src32 = write_checkpoint(tmp_path / "src32", config, tensors(), weight_format="fp8")
    assert dict(open_checkpoint(src32).iter_tensors(dequantize=False))["layers.0.attn.wq_a.scale"].dtype == torch.float32
    result = invoke("dequantize", "--in", str(src32), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    want = dict(open_checkpoint(src32).iter_tensors(dequantize=True, dtype=torch.bfloat16))
    got = dict(open_checkpoint(tmp_path / "out").iter_tensors(dequantize=False))
    assert torch.equal(got["layers.0.attn.wq_a.weight"], want["layers.0.attn.wq_a.weight"])


def test_dequantize_refuses_a_bf16_input_and_a_foreign_output(tmp_path):
    bf16 = prepare_checkpoint(tmp_path / "bf16", preset("tiny"), dtype="bf16", seed=0)
    result = invoke("dequantize", "--in", str(bf16), "--out", str(tmp_path / "o"))
    assert result.exit_code != 0 and "already a bf16 checkpoint" in result.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("mine")
    src = prepare_checkpoint(tmp_path / "fp8", preset("tiny"), dtype="fp8", seed=3)
    for extra in ((), ("--overwrite",)):          # a folder of the user's own: --overwrite does not replace it
        result = invoke("dequantize", "--in", str(src), "--out", str(tmp_path / "busy"), *extra)
        assert result.exit_code != 0 and "was not written by" in result.output
        assert "Fix: choose another output folder" in result.output
        assert (tmp_path / "busy" / "x.txt").read_text() == "mine"
