"""Pipeline parallelism (``dsv4 train --pp 2``) on the CPU: two gloo ranks, one stage each, through the CLI, for
both implementations (the megatron model runs each micro-batch's rows as one THD segment each, as its one-rank
run does: ``backends.megatron.stage``).

* SFT with the MTP loss (the token embeddings travel to the last stage) and ``--pp 2`` takes the one-rank steps
  (with four ranks, 2 stages x expert parallel 2, the two-rank expert-parallel run's): on the tiny model (4
  decoder layers: 2 per stage) with three micro-batches of unequal rows (``micro_batch_size=3`` of 8 sequences:
  3, 3, 2, so the padded stream exchange is exercised), every step's loss, MTP loss and gradient norm and the
  final fp32 weights of the run's checkpoint equal the one-rank run's; so do the miles ``--vpp 2`` steps with
  ``recompute=full`` (each rank checkpoints its own blocks) and the megatron implementation's ``--pp 2`` and
  ``--vpp 2`` steps against its own one-rank run (in the resume tests below); so does
  ``dsv4 full-train --pp 2``'s first step. Tolerance: 1e-6 relative for the loss and the norm, 1e-6 absolute on
  every weight after three AdamW steps; both runs are fp32 and each stage runs the one-rank ops on the same rows
  in the same order (the streams travel in fp32, losslessly), so only the gradient norm's fp64 sum of squares is
  added in another order (over the stages); on this machine every value came out identical.
* A ``--pp 1`` checkpoint resumes at ``--pp 2``, and that ``--pp 2`` run, SIGKILLed in step 3 (every rank, in
  the training phase), resumes at ``--pp 1`` from step 2's checkpoint, for both implementations (global names,
  DCP reshards; the optimizer's step counts of every stage are written): each resumed step and the weights after
  it equal the uninterrupted run's (the weights after the step depend on the restored Adam moments and step
  counts).
* GRPO with ``--pp 2`` (megatron also with ``--vpp 2``): tests/train/test_pipeline_grpo.py.
* ``--pp 2 --vpp 2`` (megatron-core's interleaved 1F1B, two chunks of the layers per rank), both implementations:
  two SFT steps equal the one-rank steps and resume at ``--pp 1``; a one-rank checkpoint resumes at ``--vpp 2``.
* ``dsv4 logprobs --pp 2`` prints the one-rank scores, for both implementations.
* The refusals (the combination table's rules ``impl-pipeline-parallel``, ``pipeline-train``, ``train-pipeline``
  and the trainer options ``--pp`` does not build: ``compile_blocks``, ``train_impl``, megatron's
  ``dsa_indexer_loss_coeff``), one line each naming the fix.
"""

import json

import pytest
import torch

from ._cli import metrics_rows, train_cli

def _sft(impl: str) -> tuple:
    # keep_last=3: the one-rank runs keep every checkpoint, for the resume tests that start from a copy (_stopped_at)
    return ("--impl", impl, "--mode", "sft", "--lr", "1e-3", "--save-every", "1", "keep_last=3", "micro_batch_size=3",
            "mtp_coef=0.3")


SFT = _sft("miles")
PP2 = ("--pp", "2", "--nproc-per-node", "2")


def _weights(run_dir, step: int) -> dict:
    """The fp32 native weights of the run's checkpoint of ``step``."""
    from core.native_checkpoint import load_native

    state, _meta = load_native(run_dir / "checkpoints" / f"step_{step:06d}" / "model")
    return state


def _assert_same_run(got_dir, want_dir, steps):
    got, want = metrics_rows(got_dir), metrics_rows(want_dir)
    assert [r["step"] for r in got] == list(steps)
    for a, b in zip(got, want[steps[0] - 1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), a["step"]
        assert a["mtp_loss"] == pytest.approx(b["mtp_loss"], rel=1e-6), a["step"]
    w_got, w_want = _weights(got_dir, steps[-1]), _weights(want_dir, steps[-1])
    assert w_got.keys() == w_want.keys() and len(w_got) > 100
    worst = max(float((w_got[k].double() - w_want[k].double()).abs().max()) for k in w_got)
    assert worst <= 1e-6


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Three SFT steps of one rank of an implementation (each run once, when first asked for): what every
    pipeline run of it must reproduce."""
    runs = {}

    def run(impl: str):
        if impl not in runs:
            runs[impl] = tmp_path_factory.mktemp(f"pp1-{impl}") / "run"
            train_cli(runs[impl], *_sft(impl), "--steps", "3")
        return runs[impl]

    return run


def _stopped_at(run_dir, step: int, dest):
    """A copy of the one-rank run ``run_dir`` as if it had stopped after ``step`` (its later checkpoints and
    metrics rows dropped): what ``--steps STEP`` of the same job leaves, without running it again (the steps up
    to ``step`` do not depend on how many follow: the test_layouts reference says the same of step 1)."""
    import shutil

    from reporting.metrics import truncate_after

    shutil.copytree(run_dir, dest)
    for folder in (dest / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > step:
            shutil.rmtree(folder)
    (dest / "checkpoints" / "latest").write_text(f"step_{step:06d}\n")    # train.checkpointing.LATEST
    truncate_after(dest, step)
    assert [r["step"] for r in metrics_rows(dest)] == list(range(1, step + 1))
    return dest


@pytest.fixture(scope="module")
def straight(one_rank):
    """The miles implementation's one-rank SFT run."""
    return one_rank("miles")


@pytest.fixture(scope="module")
def straight_ep2(tmp_path_factory):
    """Three SFT steps of two expert-parallel (and so data-parallel) ranks, no stages."""
    d = tmp_path_factory.mktemp("ep2") / "run"
    train_cli(d, *SFT, "--nproc-per-node", "2", "--ep", "2", "--steps", "3")
    return d


def test_sft_with_two_stages_takes_the_one_rank_steps(tmp_path, straight):
    """Three steps from the HF checkpoint at --pp 2 (the miles implementation; megatron's two stages start from it
    in the --vpp 2 test and train a --pp 2 step in the checkpoint test; recompute=full: the miles --vpp 2 test)."""
    train_cli(tmp_path / "run", *SFT, *PP2, "--steps", "3")
    assert metrics_rows(tmp_path / "run")[0]["world_size"] == 2
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["layout"]["pp"] == 2 and state["layout"]["dp"] == 1
    _assert_same_run(tmp_path / "run", straight, [1, 2, 3])


@pytest.mark.parametrize("impl,knobs", [("miles", ("recompute=full",)), ("megatron", ())],
                         ids=["miles-recompute", "megatron"])
def test_virtual_stages_take_the_one_rank_steps_and_resume_on_one_rank(tmp_path, one_rank, impl, knobs):
    """`--pp 2 --vpp 2` (megatron-core's interleaved 1F1B; each rank holds two chunks of one layer: rank 0 layers 0
    and 2, rank 1 layers 1 and 3, the streams and embeddings passing rank 0 -> 1 -> 0 -> 1) over three
    micro-batches (not a multiple of --pp: the schedule runs them as one group per chunk): two SFT steps equal the
    one-rank run's, and their checkpoint (global names, each rank's chunks) resumes at --pp 1 into the
    uninterrupted run's step 3 and weights. The miles run has recompute=full (each rank checkpoints the blocks of
    its chunks; the same ops again, so the same steps): a --pp 2 run of its own before (2026-12-04)."""
    train_cli(tmp_path / "run", *_sft(impl), *PP2, "--vpp", "2", "--steps", "2", *knobs)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["layout"]["pp"] == 2 and state["layout"]["vpp"] == 2
    train_cli(tmp_path / "run", *_sft(impl), "--steps", "3", "--resume", *knobs)
    _assert_same_run(tmp_path / "run", one_rank(impl), [1, 2, 3])


def test_full_train_runs_the_stages_on_its_converted_checkpoint(tmp_path, straight):
    """`dsv4 full-train --pp 2` (prepare -> convert -> train): the converted native checkpoint holds the very
    weights `dsv4 train` reads from the HF checkpoint, so its first step is the one-rank run's."""
    train_cli(tmp_path / "run", *SFT, *PP2, "--steps", "1", command="full-train")
    got, want = metrics_rows(tmp_path / "run")[0], metrics_rows(straight)[0]
    assert got["world_size"] == 2 and got["step"] == 1
    for key in ("loss", "grad_norm", "mtp_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


def test_sft_with_two_stages_and_two_expert_parallel_ranks_takes_the_expert_parallel_steps(tmp_path, straight,
                                                                                           straight_ep2):
    """Four ranks: 2 stages x expert parallel 2 (the two data-parallel ranks of a stage hold half of its experts
    each and exchange their tokens). Against the two-rank expert-parallel run the weights agree as tightly as
    above; against one rank only its losses and norms do (data parallelism sums the ranks' gradients in another
    order, and AdamW's m / sqrt(v) turns the last bits of near-zero gradients into update differences: the plain
    two-rank run's weights differ from one rank's by about 5e-5 after three steps too)."""
    train_cli(tmp_path / "run", *SFT, "--pp", "2", "--ep", "2", "--nproc-per-node", "4", "--steps", "3")
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["layout"]["pp"] == 2 and state["layout"]["dp"] == 2 and state["layout"]["ep"] == 2
    assert state["layout"]["world"] == 4
    _assert_same_run(tmp_path / "run", straight_ep2, [1, 2, 3])
    for a, b in zip(metrics_rows(tmp_path / "run"), metrics_rows(straight)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                 rel=1e-6)


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_checkpoints_move_between_one_rank_and_two_stages(tmp_path, one_rank, impl):
    """One run folder across layouts: step 1 on one rank; its checkpoint resumes at --pp 2 (each stage reads its
    own tensors and optimizer state), whose step 2 and the weights after it are the uninterrupted run's; then
    every rank is SIGKILLed in step 3's training phase (stage 0 may be waiting on stage 1's gradients), and step
    2's checkpoint, written by both stages, resumes at --pp 1: step 3 and its weights are the uninterrupted
    run's (the weights after a resumed step depend on the restored Adam moments and step counts). Megatron's
    plain --pp 2 step is this one (a three-step run of its own before, 2026-12-04)."""
    run = _stopped_at(one_rank(impl), 1, tmp_path / "run")          # step 1 on one rank
    killed = train_cli(run, *_sft(impl), *PP2, "--steps", "3", "--resume", env={"DSV4_TRAIN_KILL_AT": "3:train"},
                       check=False)
    assert killed.returncode == 1 and "error: rank" in killed.stderr and "Traceback" not in killed.stderr
    assert (run / "checkpoints" / "step_000002").exists(), killed.stderr[-3000:]
    assert not (run / "checkpoints" / "step_000003").exists()
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["layout"]["pp"] == 2 and state["layout"]["world"] == 2
    _assert_same_run(run, one_rank(impl), [1, 2])          # a --pp 1 checkpoint resumed at --pp 2
    train_cli(run, *_sft(impl), "--steps", "3", "--resume")
    _assert_same_run(run, one_rank(impl), [1, 2, 3])       # a --pp 2 checkpoint resumed at --pp 1


def test_a_one_rank_checkpoint_resumes_at_two_virtual_stages(tmp_path, one_rank):
    """--pp 2 --vpp 2: each rank reads the tensors of its two chunks."""
    _stopped_at(one_rank("miles"), 2, tmp_path / "run")                # two steps on one rank
    train_cli(tmp_path / "run", *_sft("miles"), *PP2, "--vpp", "2", "--steps", "3", "--resume")
    _assert_same_run(tmp_path / "run", one_rank("miles"), [1, 2, 3])


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_logprobs_on_two_stages_prints_the_one_rank_scores(tmp_path, straight, impl):
    """`dsv4 logprobs --pp 2` on the run's trained native checkpoint (each stage reads its own tensors): every
    sequence is a row of its own through megatron-core's schedule (lengths 9, 2, 1, 0 and 40: unequal rows, the
    streams padded to the longest), and the output is `--pp 1`'s (same ops on the same rows; 1e-5 for another
    thread count's rounding). The megatron model runs each row as one THD segment (`backends.megatron.stage`),
    and its `--pp 1` packs every sequence into one stream: the same values per segment."""
    from tests.cli_process import run_cli

    seqs = [[0, 5, 6, 7, 8, 9, 10, 11, 12], [0, 3], [9], [], [(i * 37) % 1000 for i in range(40)]]
    (tmp_path / "t.json").write_text(json.dumps(seqs))
    args = ("logprobs", "--impl", impl, "--checkpoint", str(straight / "checkpoints" / "step_000003" / "model"),
            "--tokens", str(tmp_path / "t.json"))
    one, staged = (run_cli(*args, *more, env={"OMP_NUM_THREADS": "1"}) for more in ((), ("--pp", "2")))
    assert one.returncode == 0 and staged.returncode == 0, staged.stderr[-2000:]
    assert "on 2 pipeline stages" in staged.stderr
    want, got = json.loads(one.stdout), json.loads(staged.stdout)
    assert [len(x) for x in got] == [len(x) for x in want] == [8, 1, 0, 0, 39]
    assert max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a, b)) <= 1e-5


def test_stages_hold_contiguous_even_layer_ranges():
    from engine.pipeline import stage_layers

    assert [list(stage_layers(4, 2, s)) for s in range(2)] == [[0, 1], [2, 3]]
    assert [list(stage_layers(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="Fix: use --pp 2 or fewer"):
        stage_layers(2, 3, 0)


def test_virtual_stages_interleave_the_chunks_over_the_ranks():
    """--pp 2 --vpp 2 on 4 layers: chunk v of rank s is the (v x 2 + s)-th range (megatron's order); the
    embedding on rank 0, the head and MTP on the last rank; the interleaved schedule's group of micro-batches per
    chunk (megatron refuses a last group smaller than --pp), and a step with fewer micro-batches than --pp
    refused in one line."""
    from backends.cpu.megatron_shims import apply_megatron_cpu_shims
    from core.pp_layout import chunk_layers, rank_layers, stage_of
    from engine import layout as L
    from engine.pipeline import _group_size, _schedule_config

    assert [[list(chunk_layers(4, 2, s, v, 2)) for v in (0, 1)] for s in (0, 1)] == [[[0], [2]], [[1], [3]]]
    assert rank_layers(8, 2, 1, 2) == [2, 3, 6, 7] and rank_layers(5, 2, 0) == [0, 1, 2]
    assert [stage_of(f"decoder.layers.{i}.x", 4, 2, 2) for i in range(4)] == [0, 1, 0, 1]
    assert stage_of("embedding.word_embeddings.weight", 4, 2, 2) == 0 and stage_of("mtp.layers.0.x", 4, 2, 2) == 1
    assert [_group_size(m, 2) for m in (2, 3, 4, 5, 7)] == [2, 3, 2, 3, 4]
    before = L._STATE["layout"]
    L._STATE["layout"] = L.ParallelLayout(world=2, pp=2, vp=2)
    try:
        with pytest.raises(ValueError, match=r"needs at least --pp 2 micro-batches .* has 1\. Fix: set micro_batch"):
            _schedule_config(8, 1)
        apply_megatron_cpu_shims()               # megatron-core importable on the CPU
        cfg = _schedule_config(8, 3)
        assert cfg.virtual_pipeline_model_parallel_size == 2 and cfg.microbatch_group_size_per_vp_stage == 3
    finally:
        L._STATE["layout"] = before


def _normalize(**kw):
    from core.config import preset
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    choices = dict(impl="miles", model=preset("tiny"), job="train", pp=2, world=2)
    return normalize(Choices(**{**choices, **kw}), make_host(third_party=False), model_name="tiny")


@pytest.mark.parametrize("kw,message", [
    (dict(impl="megatron", qkv_format="thd", max_tokens_per_rank=512), "Fix: drop --max-tokens-per-rank"),
    (dict(job=None), "built for dsv4 train and dsv4 logprobs only"),
    (dict(job="score", ep=2), "Fix: use --tp 1 --cp 1 --ep 1 --qkv-format bshd, or --pp 1"),
    (dict(job="score", impl="megatron", qkv_format="thd", ep=2, world=4), "--ep 1 --qkv-format thd, or --pp 1"),
    (dict(pp=8, world=8), "the model has 4. Fix: use --pp 4 or fewer"),
    (dict(cp=2, world=4), "Fix: use --cp 1, or use --pp 1"),
    (dict(tp=2, world=6), "(got 6 ranks). Fix: use a rank count that is a multiple of 4"),
    (dict(ep=2, world=2), "and 2 ranks with --tp 1 --cp 1 --pp 2 give 1. Fix: use --ep 1, or 4 x N ranks"),
    (dict(world=3), "Fix: use a rank count that is a multiple of 2"),
    (dict(qkv_format="thd"), "Fix: use --qkv-format bshd"),
    (dict(vpp=2, pp=1, world=1), "--vpp 2 interleaves the stages of --pp, and the run has --pp 1. Fix: add --pp 2"),
    (dict(vpp=3), "cuts the decoder layers into 6 equal chunks, and the model's 4 layers do not divide into them. "
                  "Fix: use --vpp 2, or drop --vpp"),
    (dict(job="score", vpp=2), "--vpp 2: virtual pipeline stages are built for dsv4 train and full-train only"),
])
def test_layouts_pipeline_stages_do_not_run_are_refused(kw, message):
    from core.combinations import InvalidCombination

    with pytest.raises(InvalidCombination) as err:
        _normalize(**kw)
    assert message in str(err.value) and "Fix:" in str(err.value)


def test_virtual_stages_with_fewer_micro_batches_than_stages_are_refused_before_any_rank_starts():
    from core.errors import UserInputError
    from train.distributed import check_virtual_stages
    from train.trainer import TrainConfig

    run = _normalize(vpp=2)
    with pytest.raises(UserInputError, match=r"steps have 1\. Fix: set micro_batch_size=4 or less, or drop --vpp\.$"):
        check_virtual_stages(run, "sft", TrainConfig())              # 8 sequences, one micro-batch
    # GRPO's token budget (micro_batch_tokens) splits one group of 4 into a micro-batch per stage or more;
    # fewer samples than stages cannot be
    check_virtual_stages(run, "grpo", TrainConfig(prompts_per_step=1))
    with pytest.raises(UserInputError, match=r"steps have 1\. Fix: give each rank 2 or more samples"):
        check_virtual_stages(run, "grpo", TrainConfig(prompts_per_step=1, group_size=1))
    check_virtual_stages(run, "sft", TrainConfig(micro_batch_size=3))
    check_virtual_stages(run, "grpo", TrainConfig())                 # two groups


def test_an_implementation_that_declares_no_stages_is_refused():
    """The rule ``impl-pipeline-parallel``, for a plugin's implementation that does not declare
    ``pipeline_parallel`` (both built-in ones do)."""
    import dataclasses

    from core.combinations import violations
    from launchers.builtin_plugins import make_host

    sel = _normalize().selection
    plain = dataclasses.replace(sel.impl, name="plain", pipeline_parallel=False)
    assert violations(dataclasses.replace(sel, impl=plain), make_host(third_party=False)) == [
        "--impl plain does not support pipeline parallelism (got --pp 2). Fix: use --pp 1, or --impl megatron or miles."]


@pytest.mark.parametrize("knob", [dict(compile_blocks=True), dict(train_impl="reference"),
                                  dict(dsa_indexer_loss_coeff=0.1)])
def test_trainer_options_pipeline_stages_do_not_build_are_refused(knob):
    from core.config import ConfigError
    from train.config_checks import check_train_options
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match=f"{next(iter(knob))}.*--pp 2: not built .*Fix: drop"):
        check_train_options(_normalize(), TrainConfig(**knob))


def test_the_cli_refuses_an_unbuilt_pipeline_layout_in_one_line(tmp_path):
    proc = train_cli(tmp_path / "run", "--impl", "miles", "--mode", "sft", "--steps", "1", "--pp", "2",
                     "--nproc-per-node", "2", "--cp", "2", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--pp 2 runs with data, tensor and expert parallelism only" in proc.stderr
    assert "Fix: use --cp 1, or use --pp 1" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_an_uneven_split_keeps_global_names_and_the_stages_compose_to_the_whole_model(impl):
    """3 decoder layers on 2 stages (stage 0: layers 0-1 and the embedding; stage 1: layer 2, the head and the MTP
    block), cut from one model in one process: every contract tensor is on exactly one stage under its global
    name, and stage 0's streams fed to stage 1 give the whole model's logits (fp32, exactly): for megatron, the
    stages' row API (``backends.megatron.stage``) against the whole model's own packed forward of the rows
    (a segment per row), and its MTP logits likewise."""
    from types import SimpleNamespace

    from core import weight_contract as wc
    from engine.pipeline import OtherStage, split_stage
    from train.model import build_train_model

    from ._impl_helpers import run_config, small_config

    config = small_config()

    def build():          # the same seed: the same weights every time
        return build_train_model(config, run_config(impl, config), seed=3).module.eval()

    whole = build()
    stages = [split_stage(build(), config.n_layers, SimpleNamespace(pp=2, pp_rank=s)) for s in (0, 1)]
    names = [{n for n, _ in wc.module_tensors(m, config)} for m in stages]
    assert not names[0] & names[1] and names[0] | names[1] == {n for n, _ in wc.module_tensors(whole, config)}
    assert any(n.startswith("embedding.") for n in names[0]) and not any(n.startswith("embedding.") for n in names[1])
    assert {n.split(".")[2] for n in names[0] if n.startswith("decoder.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in names[1] if n.startswith("decoder.layers.")} == {"2"}
    assert any(n.startswith("output_layer.") for n in names[1]) and any(n.startswith("mtp.") for n in names[1])
    assert not any(n.startswith(("output_layer.", "mtp.", "decoder.final_layernorm", "decoder.hc_head"))
                   for n in names[0])
    assert isinstance(stages[0].decoder.layers[2], OtherStage) and isinstance(stages[1].decoder.layers[0], OtherStage)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    if impl == "miles":
        with torch.no_grad():
            streams = stages[0].hidden_streams(ids)
            assert torch.equal(stages[1](ids, streams=streams), whole(ids))
        return
    first, last = stages[0].row_stage, stages[1].row_stage
    cu = torch.arange(3) * 12
    with torch.no_grad():
        logits, h = last(ids, streams=first.hidden_streams(ids), return_hidden_streams=True)
        assert torch.equal(logits, whole(ids.reshape(-1), cu).reshape(2, 12, -1))
        mtp = last.mtp_logits(ids, h, embedded=first.embedding(ids))
        want = whole.mtp_logits(ids.reshape(-1), cu)
    assert len(mtp) == len(want) == 1 and torch.equal(mtp[0], want[0][0].reshape(2, 11, -1))
