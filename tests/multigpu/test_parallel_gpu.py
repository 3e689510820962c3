"""Tensor, context and expert parallelism across GPUs (NCCL, one process per GPU) against the single-GPU run.

Same computations as the CPU (gloo) parity tests, in fp32 with TF32 off (``NvidiaTarget.setup``), so the
tolerances are fp32 ones: only the reduction order differs (NCCL sums, split GEMMs). Stated bounds:
per-token log-probs and loss within 1e-4 absolute; every gradient entry within 1e-6 + 1e-4 x its tensor's
largest entry (absolute plus relative: a near-zero one-element gradient such as hc_head_scale's ~1.6e-5
cannot meet a purely relative 1e-4, which is 1.6e-9 absolute);
gradient norm within 1e-5 relative; miles' loss after one Adam step within 1e-4.

``DSV4_MULTIGPU_REPORT=path.json`` also writes every measured difference there (the recorded run:
bench/results/multigpu-parity-h200x2.json, summarized in docs/parallelism.md)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from . import _worker
from tests.expert_parallel.parity import ep_results

from .parity import cp_results, max_diffs, tp_results

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2+ CUDA GPUs of one host (NCCL); {N_GPUS} visible")]
WORLDS = [w for w in (2, 4) if w <= N_GPUS] or [2]

LP_TOL, LOSS_TOL, NORM_REL_TOL = 1e-4, 1e-4, 1e-5


def _free_port() -> int:
    from core.ports import free_port as free

    return free()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The single-GPU process (cuda:0, world size 1) and the perturbed tiny weights every run loads."""
    from backends.nvidia.target import NvidiaTarget
    from tests.thd_impl._common import saved_official_weights

    NvidiaTarget().init_process_group(0, 1, tp=1)
    tmp = tmp_path_factory.mktemp("multigpu")
    official, weights = saved_official_weights(tmp)
    return {"tmp": tmp, "official": official, "weights": weights, "dev": torch.device("cuda", 0)}


def _record(name: str, diffs: dict) -> None:
    path = os.environ.get("DSV4_MULTIGPU_REPORT")
    if not path:
        return
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[name] = {**diffs, "device": torch.cuda.get_device_name(0), "gpus": N_GPUS}
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def _check(name: str, diffs: dict) -> None:
    _record(name, diffs)
    assert diffs["logprob_max_abs"] <= LP_TOL, diffs
    assert diffs["loss_abs"] <= LOSS_TOL, diffs
    assert diffs["grad_bound_ratio"] <= 1.0, diffs      # |diff| <= GRAD_ATOL + GRAD_RTOL * max|grad|
    assert diffs["grad_norm_rel"] <= NORM_REL_TOL, diffs


@pytest.mark.parametrize("world", WORLDS)
def test_miles_tensor_parallel_matches_one_gpu(setup, world):
    from core.config import preset

    if preset("tiny").o_groups % world:
        pytest.skip(f"tensor parallel {world} does not divide the tiny model's o_groups")
    want = tp_results(setup["official"], 1, setup["dev"])
    out = setup["tmp"] / f"tp{world}.pt"
    mp.spawn(_worker.tensor_parallel, args=(world, _free_port(), str(setup["weights"]), str(out)),
             nprocs=world, join=True)
    got = torch.load(out)
    diffs = max_diffs(got, want)
    diffs["after_abs"] = abs(got["after"] - want["after"])
    _check(f"miles tp{world}", diffs)
    assert diffs["after_abs"] <= LOSS_TOL


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_context_parallel_thd_matches_one_gpu(setup, impl, world):
    want = cp_results(impl, setup["official"], 1, 0, setup["dev"])
    out = setup["tmp"] / f"{impl}-cp{world}.pt"
    mp.spawn(_worker.context_parallel, args=(world, _free_port(), impl, str(setup["weights"]), str(out)),
             nprocs=world, join=True)
    diffs = max_diffs(torch.load(out), want)
    _check(f"{impl} cp{world} thd", diffs)
    if impl == "megatron":  # the indexer KL loss reached the indexer on every layout
        assert any(g.abs().sum() > 0 for n, g in want["grads"].items() if "indexer" in n)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_expert_parallel_matches_one_gpu(setup, impl, world):
    """Rank r trains sequence r with half (world 2) of every layer's experts; tokens cross GPUs by NCCL
    all-to-all (``engine.expert_parallel``)."""
    want = ep_results(impl, setup["official"], 1, 0, setup["dev"], hardware="nvidia")
    out = setup["tmp"] / f"{impl}-ep{world}.pt"
    mp.spawn(_worker.expert_parallel, args=(world, _free_port(), impl, str(setup["weights"]), str(out)),
             nprocs=world, join=True)
    got = torch.load(out)
    assert got["local_experts"] * world == want["local_experts"]
    assert all(torch.equal(got["state"][n], t.cpu()) for n, t in want["state"].items())  # experts gathered back
    _check(f"{impl} ep{world}", max_diffs(got, want))
