"""`core.memory` (the per-GPU estimate of `dsv4 inspect`) against an independent count: the tiny miles model
built on the CPU under the same layout (tensor parallel 2, expert parallel 2: two gloo processes; a pipeline
stage cut as `dsv4 train --pp` cuts it), its tensors counted on the model; the optimizer's share against
Megatron's DistributedOptimizer table; the activation terms against the tensors a forward really keeps, and
the micro-batches a stage keeps in flight against megatron-core's 1F1B schedule run on two gloo stages."""

from __future__ import annotations

import pytest
import torch

from core.memory import estimate_memory
from tests.cpu_ranks import PORT, spawn_cpu_ranks

from . import _memory_worker
from ._helpers import TINY, run_config


def _held_per_rank(tmp_path, tp: int, ep: int) -> list:
    world = tp * ep
    prefix = tmp_path / f"tp{tp}-ep{ep}"
    spawn_cpu_ranks(_memory_worker.run, (world, PORT, tp, ep, str(prefix)), world)
    return [torch.load(f"{prefix}.{r}") for r in range(world)]


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_weights_per_rank_equal_the_model_built_with_that_layout(tmp_path, tp, ep):
    est = estimate_memory(TINY, tp=tp, ep=ep, dtype="bf16")
    for held in _held_per_rank(tmp_path, tp, ep):  # every rank holds the same amount
        assert held["parameters"] == est.parameters
        assert held["weights"] == est.weights
        assert held["trainable"] == est.trainable_dense + est.trainable_expert
        assert est.gradients == 4 * held["trainable"]  # fp32 main grads
    full = estimate_memory(TINY, dtype="bf16")
    assert est.parameters < full.parameters


def test_one_rank_holds_the_whole_model():
    from core import weight_contract as wc
    from engine.loading import native_tensors

    m = _built(torch.bfloat16)
    held = native_tensors(m)
    est = estimate_memory(TINY, dtype="bf16")
    assert est.parameters == sum(t.numel() for t in held.values()) == sum(
        torch.Size(s).numel() for s, _ in wc.native_names(TINY).values())
    assert est.weights == sum(t.numel() * t.element_size() for t in held.values())


def _built(dtype):
    from core.assembly import assemble

    return assemble(run_config(1)).build_model(TINY, params_dtype=dtype)


def test_optimizer_follows_megatrons_distributed_optimizer_table():
    """Megatron's docs (api-guide/dist_optimizer): bytes per parameter with the distributed optimizer are
    6 + 12/d for bf16 weights with fp32 gradients and 8 + 8/d for fp32 weights and gradients (d: the
    data-parallel ranks the state is sharded over); fp32-kept weights are their own master copy."""
    m = _built(torch.bfloat16)
    low = sum(p.numel() for p in m.parameters() if p.dtype == torch.bfloat16)
    kept = sum(p.numel() for p in m.parameters() if p.dtype == torch.float32)
    for d in (1, 4):
        bf16 = estimate_memory(TINY, dtype="bf16", world=d)
        assert bf16.dense_shards == bf16.expert_shards == d
        expect = (12 * low + 8 * kept) / d
        assert expect <= bf16.optimizer <= expect + 2   # ceil per shard group
        fp32 = estimate_memory(TINY, dtype="fp32", world=d)
        assert 8 * (low + kept) / d <= fp32.optimizer <= 8 * (low + kept) / d + 2
        assert fp32.gradients == bf16.gradients == 4 * (low + kept)
        # adam_moments_dtype=bf16: m and v take 2 bytes each (fp32 master unchanged)
        half = estimate_memory(TINY, dtype="bf16", world=d, moments="bf16")
        assert (8 * low + 4 * kept) / d <= half.optimizer <= (8 * low + 4 * kept) / d + 2
        assert half.moments == "bf16" and half.total == bf16.total - (bf16.optimizer - half.optimizer)
    # experts are sharded over the expert data-parallel group, dense weights over data x context parallel
    e = estimate_memory(TINY, ep=2, cp=2, world=8)
    assert (e.dp, e.dense_shards, e.expert_shards) == (4, 8, 4)


def test_activation_terms_are_the_tensors_a_forward_keeps():
    """Per token: each block's input (hc_mult streams of dim) and each head's fp32 logits, measured."""
    m = _built(torch.bfloat16)
    seen = []
    for layer in [*m.decoder.layers, *(k.mtp_model_layer for k in m.mtp.layers)]:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    ids = torch.randint(0, TINY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, streams = m(ids, return_hidden_streams=True)
        heads = [logits, *m.mtp_logits(ids, streams)]
    assert len(seen) == TINY.n_layers + TINY.n_mtp_layers and len(heads) == 1 + TINY.n_mtp_layers
    per_token = sum(x.numel() * x.element_size() / x[..., 0, 0].numel() for x in seen)
    per_token += sum(2 * h.numel() * h.element_size() / h[..., 0].numel() for h in heads)  # + fp32 log-softmax
    est = estimate_memory(TINY, dtype="bf16", seq=32, micro_batch=2, cp=2, world=2)
    assert est.tokens_per_rank == 32
    assert est.activations == est.tokens_per_rank * per_token


def _stage(s: int, pp: int = 2):
    """Stage ``s`` of ``pp`` cut from the tiny model built whole (``engine.pipeline.split_stage``, as dsv4 train
    cuts it)."""
    from types import SimpleNamespace

    from engine.pipeline import split_stage

    return split_stage(_built(torch.bfloat16), TINY.n_layers, SimpleNamespace(pp=pp, pp_rank=s))


@pytest.mark.parametrize("pp", [2, 3])
def test_a_pipeline_stage_holds_what_the_trainer_cuts_and_the_largest_is_estimated(pp):
    """--pp 2 (2 + 2 layers) and --pp 3 (2 + 1 + 1): each stage's weights, gradients and optimizer state against
    the stage cut from the built model; the default estimate is the stage of the largest total."""
    from engine.loading import native_tensors

    stages = [estimate_memory(TINY, pp=pp, stage=s, dtype="bf16") for s in range(pp)]
    for s, est in enumerate(stages):
        m = _stage(s, pp)
        held = native_tensors(m)
        trainable = sum(p.numel() for p in m.parameters() if p.is_floating_point())
        assert est.parameters == sum(t.numel() for t in held.values()), s
        assert est.weights == sum(t.numel() * t.element_size() for t in held.values()), s
        assert est.trainable_dense + est.trainable_expert == trainable and est.gradients == 4 * trainable
        assert est.layers == sum(1 for layer in m.decoder.layers if sum(p.numel() for p in layer.parameters()))
    whole = estimate_memory(TINY, dtype="bf16")
    assert sum(e.parameters for e in stages) == whole.parameters
    assert sum(e.optimizer for e in stages) == pytest.approx(whole.optimizer, abs=2 * pp)
    largest = estimate_memory(TINY, pp=pp, dtype="bf16")
    assert largest.total == max(e.total for e in stages) and largest == stages[largest.stage]


def test_a_stage_keeps_the_activations_of_the_micro_batches_1f1b_has_in_flight(tmp_path):
    """Measured on megatron-core's schedule (two gloo stages, six micro-batches): stage 0 holds two micro-batches
    between forward and backward, the last stage one; each stage's block inputs are its layers' (measured as in
    the test above), and the last stage alone holds the heads' logits."""
    from core.memory import in_flight_micro_batches

    from . import _memory_worker

    prefix = tmp_path / "flight"
    spawn_cpu_ranks(_memory_worker.in_flight, (2, PORT, 6, str(prefix)), 2)
    measured = [torch.load(f"{prefix}.{r}") for r in range(2)]
    assert measured == [in_flight_micro_batches(2, s) for s in range(2)] == [2, 1]

    m = _built(torch.bfloat16)
    seen = {}
    for i, layer in enumerate([*m.decoder.layers, *(k.mtp_model_layer for k in m.mtp.layers)]):
        layer.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
    ids = torch.randint(0, TINY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, streams = m(ids, return_hidden_streams=True)
        heads = [logits, *m.mtp_logits(ids, streams)]
    per_token = {i: x.numel() * x.element_size() / x[..., 0, 0].numel() for i, x in seen.items()}
    head_bytes = sum(2 * h.numel() * h.element_size() / h[..., 0].numel() for h in heads)
    for s, blocks in enumerate(([0, 1], [2, 3, *range(TINY.n_layers, TINY.n_layers + TINY.n_mtp_layers)])):
        est = estimate_memory(TINY, pp=2, stage=s, dtype="bf16", seq=32, micro_batch=2, world=2)
        want = measured[s] * sum(per_token[i] for i in blocks) + (head_bytes if s == 1 else 0)
        assert est.activations == est.tokens_per_rank * want, s


def test_layouts_that_do_not_fit_are_refused_with_the_reason():
    from core.errors import UserInputError

    with pytest.raises(UserInputError, match="multiple of tp\\*cp\\*pp = 4"):
        estimate_memory(TINY, tp=2, cp=2, world=6)
    with pytest.raises(UserInputError, match="must divide the 8 routed experts"):
        estimate_memory(TINY, ep=3)
    with pytest.raises(UserInputError, match="tensor-parallel size 8 does not divide"):
        estimate_memory(TINY, tp=8)
    assert estimate_memory(TINY, cp=2, ep=4).world == 4
    with pytest.raises(UserInputError, match="the model has 4. Fix: use --pp 4 or fewer"):
        estimate_memory(TINY, pp=8)
    with pytest.raises(UserInputError, match="multiple of tp\\*cp\\*pp = 2 .* and of tp\\*ep\\*pp = 4"):
        estimate_memory(TINY, pp=2, ep=2, world=2)
    assert estimate_memory(TINY, pp=2, ep=2).world == 4


def test_a_training_state_larger_than_the_gpu_is_refused_before_anything_is_built(monkeypatch):
    """Flash-shaped on one 80 GB H100 (which ran out of memory 71 s into a GRPO run,
    bench/results/grpo-h100-flash-shaped-oom-256.json) is refused with the state's size and the fixes; on an H200
    it passes, and the H200's measured train-phase peak of that run is above the state (the check is a lower
    bound: activations, buffers and the engine come on top); expert parallelism over 2 GPUs fits an H100. The
    trainer's check reads the current GPU and skips other schemes and targets."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from core.config import preset
    from core import memory
    from core.memory import StateDoesNotFit, check_state_fits

    flash, gib = preset("flash-shaped"), 2 ** 30
    one = dict(tp=1, cp=1, ep=1, pp=1, world=1, dtype="bf16", moments="fp32")
    h100, h200 = int(79.18 * gib), int(139.8 * gib)
    with pytest.raises(StateDoesNotFit, match=r"needs 97.4 GiB a GPU .* more than the 79.2 GiB of NVIDIA H100") as e:
        check_state_fits(flash, **one, device_bytes=h100, device_name="NVIDIA H100 80GB HBM3")
    assert "--ep" in str(e.value) and "adam_moments_dtype=bf16 (saves 21.6 GiB)" in str(e.value)
    est = check_state_fits(flash, **one, device_bytes=h200, device_name="H200")
    record = Path(__file__).parents[2] / "bench/results/grpo-h200-flash-shaped-decode-kernels-256.json"
    peak = json.loads(record.read_text())["rows"][0]["train_peak_gib"]
    assert (est.weights + est.gradients + est.optimizer) / gib < peak
    check_state_fits(flash, **{**one, "ep": 2, "world": 2}, device_bytes=h100, device_name="H100")

    props = SimpleNamespace(total_memory=h100, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)

    def run(quant="bf16", gpu=True):
        sel = SimpleNamespace(hardware=SimpleNamespace(gpu=gpu), quant=SimpleNamespace(name=quant))
        return SimpleNamespace(selection=sel, tp=1, cp=1, ep=1, pp=1, world=1, dtype="bf16")

    with pytest.raises(StateDoesNotFit, match="97.4 GiB"):
        memory.check_run_fits_gpu(flash, run(), "fp32")
    # bf16 moments: 75.8 GiB, under the card (activations may still not fit: the run's own error says so)
    memory.check_run_fits_gpu(flash, run(), "bf16")
    memory.check_run_fits_gpu(flash, run(quant="fp8"), "fp32")
    memory.check_run_fits_gpu(flash, run(gpu=False), "fp32")


def test_dsv4_inspect_prints_the_estimate_for_any_preset_and_layout():
    import json

    from click.testing import CliRunner

    from core.config import preset
    from launchers.cli import main

    res = CliRunner().invoke(main, ["inspect", "--preset", "flash-shaped", "--tp", "2", "--ep", "4", "--nproc-per-node",
                                    "8", "--seq", "2048", "--micro-batch-size", "2", "--dtype", "bf16", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["memory_per_gpu"]
    assert got == estimate_memory(preset("flash-shaped"), tp=2, ep=4, world=8, seq=2048, micro_batch=2).as_dict()
    assert (got["dp"], got["dense_shards"], got["expert_shards"]) == (4, 4, 1)
    table = CliRunner().invoke(main, ["inspect", "--preset", "flash", "--ep", "64", "--nproc-per-node", "8",
                                      "--nnodes", "16"])
    assert table.exit_code == 0 and "memory per GPU (estimate)" in table.stdout and "GiB" in table.stdout
    staged = CliRunner().invoke(main, ["inspect", "--preset", "flash", "--pp", "4", "--ep", "8", "--nproc-per-node",
                                       "8", "--nnodes", "4", "--json"])
    assert staged.exit_code == 0, staged.output
    got = json.loads(staged.stdout)["memory_per_gpu"]
    assert got == estimate_memory(preset("flash"), pp=4, ep=8, world=32).as_dict()
    assert (got["dp"], got["dense_shards"], got["expert_shards"], got["stage"]) == (8, 8, 1, 3)
    bad = CliRunner().invoke(main, ["inspect", "--preset", "tiny", "--tp", "2", "--nproc-per-node", "3"])
    assert bad.exit_code == 1 and "do not fit the layout" in bad.output
