"""`core.memory` (the per-GPU estimate of `dsv4 inspect`) against an independent count: the tiny miles model
built on the CPU under the same layout (tensor parallel 2, expert parallel 2: two gloo processes), its
tensors counted on the model; the optimizer's share against Megatron's DistributedOptimizer table; the
activation terms against the tensors a forward really keeps."""

from __future__ import annotations

import pytest
import torch

from core.memory import estimate_memory
from core.ports import free_port
from tests.cpu_ranks import spawn_cpu_ranks

from . import _memory_worker
from ._helpers import TINY, run_config


def _held_per_rank(tmp_path, tp: int, ep: int) -> list:
    world = tp * ep
    prefix = tmp_path / f"tp{tp}-ep{ep}"
    spawn_cpu_ranks(_memory_worker.run, (world, free_port(), tp, ep, str(prefix)), world)
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


def test_layouts_that_do_not_fit_are_refused_with_the_reason():
    from core.errors import UserInputError

    with pytest.raises(UserInputError, match="multiple of tp\\*cp\\*pp = 4"):
        estimate_memory(TINY, tp=2, cp=2, world=6)
    with pytest.raises(UserInputError, match="must divide the 8 routed experts"):
        estimate_memory(TINY, ep=3)
    with pytest.raises(UserInputError, match="tensor-parallel size 8 does not divide"):
        estimate_memory(TINY, tp=8)
    assert estimate_memory(TINY, cp=2, ep=4).world == 4


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
    bad = CliRunner().invoke(main, ["inspect", "--preset", "tiny", "--tp", "2", "--nproc-per-node", "3"])
    assert bad.exit_code == 1 and "do not fit the layout" in bad.output
