"""Context parallelism for the megatron implementation: cp 2 and 4 (gloo processes on the CPU) give the
same per-token log-probs of a packed stream, the same loss and the same gradients as cp 1; with the
indexer KL loss on, the ranks' shares add up to the cp-1 loss and give the indexer the cp-1 gradients."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_ranks import PORT, spawn_cpu_ranks

from . import _cp_worker
from ._common import build, cu_seqlens, grads_official, saved_official_weights, packed_loss, single_process_group, stream

LP_TOL = 1e-5
GRAD_TOL = 1e-6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    single_process_group()
    tmp = tmp_path_factory.mktemp("megatron_cp")
    official, weights = saved_official_weights(tmp)
    m = build("megatron", official, qkv_format="thd")
    cu, ids = cu_seqlens(), stream()
    with torch.no_grad():
        lp = m.logprobs(ids, cu)
    loss = packed_loss(m, "megatron", ids, cu, 1, 0)
    loss.backward()
    return dict(tmp=tmp, weights=weights, logprobs=lp, loss=loss.item(), grads=grads_official(m))


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_matches_cp1(setup, cp):
    out = setup["tmp"] / f"cp{cp}.pt"
    spawn_cpu_ranks(_cp_worker.run, (cp, PORT, "megatron", str(setup["weights"]), str(out)), cp)
    res = torch.load(out)
    assert (res["logprobs"] - setup["logprobs"]).abs().max().item() <= LP_TOL
    assert abs(res["loss"] - setup["loss"]) <= LP_TOL
    grads = setup["grads"]
    assert set(grads) <= set(res["grads"])
    for name, g in res["grads"].items():
        want = grads.get(name, torch.zeros_like(g))
        assert (g - want).abs().max().item() <= GRAD_TOL, name
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "compressor" in n)


@pytest.fixture(scope="module")
def setup_kl(setup):
    m = build("megatron", torch.load(setup["weights"]), qkv_format="thd", indexer_coeff=0.5)
    cu, ids = cu_seqlens(), stream()
    loss = packed_loss(m, "megatron", ids, cu, 1, 0)
    kl = m.last_indexer_loss.item()
    loss.backward()
    return dict(loss=loss.item(), kl=kl, grads=grads_official(m))


def test_cp_indexer_kl_loss_matches_cp1(setup, setup_kl):
    assert setup_kl["kl"] > 1e-3 and abs(setup_kl["loss"] - setup["loss"] - setup_kl["kl"]) <= LP_TOL
    out = setup["tmp"] / "cp2_kl.pt"
    spawn_cpu_ranks(_cp_worker.run, (2, PORT, "megatron", str(setup["weights"]), str(out), 0.5), 2)
    res = torch.load(out)
    assert abs(res["loss"] - setup_kl["loss"]) <= LP_TOL
    grads = setup_kl["grads"]
    indexer = [n for n in grads if ".indexer." in n and grads[n].abs().sum() > 0]
    assert indexer  # the KL loss is what trains the indexer
    for name, g in res["grads"].items():
        want = grads.get(name, torch.zeros_like(g))
        assert (g - want).abs().max().item() <= GRAD_TOL, name
