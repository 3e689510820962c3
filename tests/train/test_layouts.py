"""`dsv4 train` across ranks on the CPU (gloo), through the CLI: the product path of issue #17.

Every layout (data parallel, expert parallel, tensor parallel, context parallel) starts its ranks with
torch.distributed's elastic launcher (``--nproc-per-node`` or the layout's default) and must take the SAME step
as one process: on the CPU the run is fp32, so the first step's loss and gradient norm agree to fp32 rounding.
A run whose ranks are SIGKILLed mid-step resumes on another layout and continues exactly like a run that was
never interrupted (every rank wrote its own pieces of the checkpoint; each rank reads the pieces it holds).
The same test on GPUs (NCCL, bf16, megatron-core's distributed optimizer): tests/multigpu/test_train_gpu.py.
"""

import json
import shutil

import pytest

from ._cli import metrics_rows, train_cli


def _train(run_dir, *args, env=None, check=True):
    return train_cli(run_dir, *args, env=env, check=check)


SFT = ("--mode", "sft", "--steps", "1", "--lr", "1e-3")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, sft_straight):
    """One-process SFT step of each implementation: the reference every layout must reproduce. For miles it is
    the first step of the one-process run the resume tests below compare with (the same SFT job, lr 1e-3: the
    first step does not depend on how many steps follow or on the checkpoints written after it)."""
    d = tmp_path_factory.mktemp("one-megatron")
    _train(d / "run", "--impl", "megatron", *SFT)
    return {"miles": sft_straight[0], "megatron": metrics_rows(d / "run")[0]}


EP2 = ("--nproc-per-node", "2", "--ep", "2")
TP2 = ("--tp", "2")
SFT3 = ("--impl", "miles", "--mode", "sft", "--steps", "3", "--save-every", "1", "--lr", "1e-3")


@pytest.fixture(scope="module")
def killed_sft(tmp_path_factory):
    """:data:`SFT3` at a layout with every rank SIGKILLed in step 3's training phase (each run once, when first
    asked for): its step 2 checkpoint is the sharded one the resume tests below read (each from a copy), and its
    step 1 is that layout's first step, which :func:`test_every_layout_takes_the_one_rank_step` checks (the
    first step does not depend on how many steps follow or on the checkpoints written after it)."""
    runs = {}

    def run(layout):
        if layout not in runs:
            runs[layout] = tmp_path_factory.mktemp("killed") / "run"
            killed = _train(runs[layout], *SFT3, *layout, env={"DSV4_TRAIN_KILL_AT": "3:train"}, check=False)
            assert killed.returncode == 1, killed.stderr[-2000:]
        return runs[layout]

    return run


@pytest.mark.parametrize("impl,layout", [
    ("miles", ("--nproc-per-node", "2")),                          # data parallel 2
    ("miles", EP2),                                                # expert parallel inside data parallel
    ("miles", TP2),                                                # tensor parallel
    ("megatron", ("--cp", "2")),                                   # context parallel (THD)
    ("megatron", ("--ep", "2")),
])
def test_every_layout_takes_the_one_rank_step(tmp_path, one_rank, killed_sft, impl, layout):
    if impl == "miles" and layout in (EP2, TP2):    # the resume tests' killed run of this layout: its step 1
        run = killed_sft(layout)
    else:
        run = tmp_path / "run"
        _train(run, "--impl", impl, *layout, *SFT)
    got, want = metrics_rows(run)[0], one_rank[impl]
    assert got["world_size"] == 2
    assert got["response_tokens"] == want["response_tokens"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_killed_ranks_resume_on_another_layout(tmp_path):
    """GRPO with --ep 2: every rank is SIGKILLed in step 3's training phase; the run resumes with --tp 2
    from step 2's checkpoint and steps 3-4 equal an uninterrupted one-process run's."""
    grpo = ("--impl", "miles", "--mode", "grpo", "--steps", "4", "--save-every", "1", "--lr", "1e-3")
    killed = _train(tmp_path / "run", *grpo, "--ep", "2", env={"DSV4_TRAIN_KILL_AT": "3:train"}, check=False)
    assert killed.returncode == 1, killed.stderr[-2000:]
    assert "error: rank" in killed.stderr and "Traceback" not in killed.stderr
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["layout"]["ep"] == 2 and state["layout"]["world"] == 2
    _train(tmp_path / "run", *grpo, "--tp", "2", "--resume")
    _train(tmp_path / "straight", *grpo)
    resumed, straight = metrics_rows(tmp_path / "run"), metrics_rows(tmp_path / "straight")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed[2:], straight[2:]):
        for key in ("loss", "grad_norm", "reward_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), (a["step"], key)
        # fp32 rounding noise of another layout's sums (~1e-7), not a difference of the weights
        assert a["train_rollout_logprob_abs_diff"] == pytest.approx(b["train_rollout_logprob_abs_diff"], abs=1e-6)


def _chunk_writers(folder):
    """Bytes of the DCP folder's tensor data per writing rank (file ``__<rank>_<n>.distcp``), from its
    metadata read through the allow-list."""
    from core.native_checkpoint import _read_dcp_metadata

    out = {}
    for info in _read_dcp_metadata(folder).storage_data.values():
        rank = int(info.relative_path.split("_")[2])
        out[rank] = out.get(rank, 0) + info.length
    return out


@pytest.fixture(scope="module")
def sft_straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft-straight") / "run"
    _train(d, *SFT3)
    return metrics_rows(d)


@pytest.mark.parametrize("written,other", [(TP2, EP2), (EP2, TP2)], ids=["tp2", "ep2"])
def test_sharded_checkpoint_resumes_on_one_rank_and_on_the_other_layout(tmp_path, sft_straight, killed_sft, written,
                                                                       other):
    """Killed in step 3 at --tp 2 (or --ep 2): step 2's checkpoint holds both ranks' pieces (neither rank wrote
    all of the optimizer state or of the model), and resuming it on one rank and on the other layout gives the
    step 3 of a run that was never interrupted."""
    run = killed_sft(written)
    assert [r["step"] for r in metrics_rows(run)] == [1, 2]
    folder = run / "checkpoints" / "step_000002"
    for part in ("optim", "model"):
        per_rank = _chunk_writers(folder / part)
        assert sorted(per_rank) == [0, 1], (part, per_rank)
        assert max(per_rank.values()) < 0.9 * sum(per_rank.values()), (part, per_rank)
    for name, layout in (("one", ()), ("other", other)):
        d = tmp_path / name
        shutil.copytree(run, d)
        _train(d, *SFT3, *layout, "--resume")
        got = metrics_rows(d)
        assert [r["step"] for r in got] == [1, 2, 3]
        for key in ("loss", "grad_norm"):
            assert got[2][key] == pytest.approx(sft_straight[2][key], rel=1e-4, abs=1e-9), (name, key)


def test_a_rank_count_that_does_not_fit_is_refused_before_anything_starts(tmp_path):
    proc = _train(tmp_path / "run", "--impl", "miles", "--tp", "2", "--nproc-per-node", "3", *SFT, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: 3 ranks do not split into --tp 2")
    assert not (tmp_path / "run").exists()
