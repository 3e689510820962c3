"""The launcher's working stages end to end: prepare, logprobs, inspect, main job."""

import json
import os

import pytest
import torch

from core.checkpoint import load_into, open_checkpoint
from kernels.reference.model import DeepseekV4Model
from tests.cli_process import run_cli as dsv4  # the CLI as a separate process, as a user runs it


def dsv4_here(*args, env=None):
    """The CLI in this process (click's runner): cheap, shares imports with the test."""
    from click.testing import CliRunner

    from launchers.cli import main

    return CliRunner().invoke(main, list(args), env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    proc = dsv4("prepare", "--preset", "tiny", "--out", str(out), "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_logprobs_prints_only_json_equal_to_the_reference_model(tiny, tmp_path, impl):
    sequences = [[0, 72, 105, 33, 5, 9, 11], [0, 50], [7]]
    (tmp_path / "tokens.json").write_text(json.dumps(sequences))
    # relative paths resolve against the user's directory (BUILD_WORKING_DIRECTORY under `bazel run`)
    rel_ckpt = os.path.relpath(tiny, tmp_path)
    proc = dsv4(
        "logprobs", "--impl", impl, "--checkpoint", rel_ckpt, "--tokens", "tokens.json",
        env={"BUILD_WORKING_DIRECTORY": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert [len(x) for x in got] == [6, 1, 0]

    model = DeepseekV4Model(open_checkpoint(tiny).config)
    load_into(model, open_checkpoint(tiny))
    model.eval()
    with torch.no_grad():
        for seq, lp in zip(sequences[:2], got[:2]):
            expected = model.logprobs(torch.tensor([seq]))[0]
            assert torch.allclose(torch.tensor(lp), expected.float(), atol=1e-4)
            assert all(x <= 0 for x in lp)


def test_packed_and_context_parallel_scoring_match_the_unpacked_run(tiny, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps([[0, 5, 6, 7, 8, 9, 10, 11, 12], [0, 3, 4], [9], list(range(2, 150))]))
    args = ("logprobs", "--checkpoint", str(tiny), "--tokens", str(tmp_path / "t.json"))
    plain = json.loads(dsv4(*args).stdout)
    packed = dsv4(*args, "--qkv-format", "thd", "--cp", "2")
    assert packed.returncode == 0, packed.stderr
    got = json.loads(packed.stdout)
    assert [len(x) for x in got] == [len(x) for x in plain] == [8, 2, 0, 147]
    for a, b in zip(got, plain):
        assert all(abs(x - y) <= 1e-4 for x, y in zip(a, b))


def test_logprobs_rejects_bad_token_files(tiny, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    proc = dsv4("logprobs", "--checkpoint", str(tiny), "--tokens", str(bad))
    assert proc.returncode == 1
    assert proc.stderr == f"error: token file {bad} must hold a JSON list of lists of integer token ids\n"
    bad.write_text("[[0, 5000]]")
    proc = dsv4("logprobs", "--checkpoint", str(tiny), "--tokens", str(bad))
    assert proc.returncode == 1
    assert "sequence 0 has ids outside the vocabulary [0, 1024): [5000]" in proc.stderr


def test_logprobs_on_a_truncated_shard_names_the_file(tiny, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (tmp_path / "t.json").write_text("[[0, 1, 2]]")
    proc = dsv4("logprobs", "--checkpoint", str(broken), "--tokens", str(tmp_path / "t.json"))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ")
    assert shard.name in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_convert_writes_a_native_checkpoint_either_implementation_scores(tiny, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps([[0, 72, 105, 33, 5, 9, 11, 300, 2]]))
    native = tmp_path / "native"
    proc = dsv4_here("convert", "--impl", "miles", "--hf", str(tiny), "--out", str(native))
    assert proc.exit_code == 0, proc.output
    meta = json.loads((native / "dsv4_native.json").read_text())
    assert meta["impl"] == "miles" and meta["contract_version"] >= 1
    from_hf = json.loads(dsv4_here("logprobs", "--impl", "megatron", "--checkpoint", str(tiny), "--tokens", str(tmp_path / "t.json")).stdout)
    for impl in ("miles", "megatron"):  # written by miles, read by both
        proc = dsv4_here("logprobs", "--impl", impl, "--checkpoint", str(native), "--tokens", str(tmp_path / "t.json"))
        assert proc.exit_code == 0, proc.output
        # the native checkpoint holds the HF file's bf16 values: identical scores
        assert torch.allclose(torch.tensor(json.loads(proc.stdout)), torch.tensor(from_hf), atol=1e-5)
    inspect = dsv4_here("inspect", "--checkpoint", str(native), "--json")
    assert json.loads(inspect.stdout)["total"] == json.loads(dsv4_here("inspect", "--preset", "tiny", "--json").stdout)["total"]


def test_a_native_checkpoint_under_old_names_is_refused(tiny, tmp_path):
    import shutil

    native = tmp_path / "native"
    assert dsv4("convert", "--impl", "megatron", "--hf", str(tiny), "--out", str(native)).returncode == 0
    stale = tmp_path / "stale"
    shutil.copytree(native, stale)
    meta = json.loads((stale / "dsv4_native.json").read_text())
    meta["contract_version"] = 0
    (stale / "dsv4_native.json").write_text(json.dumps(meta))
    (tmp_path / "t.json").write_text("[[0, 1, 2]]")
    proc = dsv4("logprobs", "--checkpoint", str(stale), "--tokens", str(tmp_path / "t.json"))
    assert proc.returncode == 1
    assert "dsv4 convert --impl" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_reports_the_reference_systems_count():
    proc = dsv4("inspect", "--preset", "flash-4layer", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total"] == 27_390_526_557
    table = dsv4("inspect", "--preset", "pro")
    assert "1,572,999,506,531" in table.stdout


def test_inspect_reads_a_checkpoint_config(tiny):
    from core.config import preset
    from kernels.reference.params import count_parameters

    proc = dsv4("inspect", "--checkpoint", str(tiny), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    memory = report.pop("memory_per_gpu")
    assert report == count_parameters(preset("tiny"))
    from core.memory import estimate_memory

    assert memory == estimate_memory(preset("tiny")).as_dict()  # one GPU, bf16, 4096 tokens


def test_the_main_job_trains_the_embedded_model_with_grpo(tmp_path):
    env = {"DSV4_CACHE": str(tmp_path / "cache"), "BUILD_WORKING_DIRECTORY": str(tmp_path)}
    proc = dsv4_here("--impl=miles", env=env)
    assert proc.exit_code == 0, proc.output
    assert "GRPO on the embedded tiny model with --impl miles" in proc.stdout
    (run_dir,) = (tmp_path / "dsv4-runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 2
    for key in ("reward_mean", "train_rollout_logprob_abs_diff", "train_rollout_kl", "loss", "grad_norm", "tokens_per_s"):
        assert all(r[key] is not None and r[key] == r[key] for r in rows), key  # present and not NaN
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 1e-3
    assert list((run_dir / "plots").glob("*.png"))
    # it trains: a step whose groups all have equal rewards has exactly zero policy gradient (no KL, no MTP in
    # the main job), every other step a nonzero one, and at least one step had a learning signal
    for r in rows:
        assert (r["grad_norm"] == 0.0) == (r["zero_variance_group_frac"] == 1.0), r
    assert any(r["grad_norm"] > 0 for r in rows)
    _assert_trained(tmp_path / "cache" / "tiny-bf16-seed0", run_dir / "hf")
    # it learns (seed 0; tests/train/test_learning.py: another seed, megatron, and the flipped-sign control)
    from launchers import stages

    first, last = stages.reward_trend(run_dir / "metrics.jsonl")
    assert last - first > 0.15, [r["reward_mean"] for r in rows]     # test_learning.py's MARGIN
    assert f"reward_mean: first 5 steps {first:.3f}, last 5 steps {last:.3f}" in proc.stdout
    # a learning signal while it learns: at most 2 steps whose every group tied before the reward reached its final
    # level. A tie once it is there is a converged policy (every sample of a group alike), not a missing signal:
    # on this CPU the run's last 5 steps are such ties at its final reward, on CI's runner 2 or 3 of them.
    plateau = last - 0.1
    assert sum(r["zero_variance_group_frac"] == 1.0 and r["reward_mean"] < plateau for r in rows) <= 2, \
        [(r["step"], r["reward_mean"], r["zero_variance_group_frac"]) for r in rows]


def _assert_trained(start, export):
    """The exported weights moved away from the starting checkpoint's, and the frozen hash tables did not."""
    a = dict(open_checkpoint(start).iter_tensors(progress=False))
    b = dict(open_checkpoint(export).iter_tensors(progress=False))
    assert a.keys() == b.keys()
    moved = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k].float(), b[k].float())]
    assert len(moved) > 0.5 * sum(a[k].is_floating_point() for k in a), f"only {len(moved)} tensors moved"
    frozen = [k for k in a if k.endswith("tid2eid")]
    assert frozen and all(torch.equal(a[k], b[k]) for k in frozen)


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_full_train_skips_completed_stages(tmp_path, impl):
    env = {"DSV4_CACHE": str(tmp_path / "cache")}
    first = dsv4_here("--impl", impl, "full-train", "--steps", "1", "--run-dir", str(tmp_path / "run1"), env=env)
    assert first.exit_code == 0, first.output
    natives = list((tmp_path / "cache").glob(f"*-native-v*-{impl}"))
    assert len(natives) == 1 and (natives[0] / ".dsv4-complete.json").exists()
    stamp = (natives[0] / ".dsv4-complete.json").stat().st_mtime_ns
    second = dsv4_here("--impl", impl, "full-train", "--steps", "1", "--run-dir", str(tmp_path / "run2"), env=env)
    assert second.exit_code == 0, second.output
    assert (natives[0] / ".dsv4-complete.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert "already prepared" in second.stderr


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
