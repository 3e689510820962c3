"""Expert parallel 2 and 4 (gloo processes on the CPU) against expert parallel 1, for both implementations:
per-token log-probs, the loss and every gradient (experts gathered from their owners) of one backward, in
fp32. Only the order of floating-point sums differs, so the bounds are fp32 ones."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_ranks import PORT, spawn_cpu_ranks

from . import _worker
from .parity import ep_results

LP_TOL, GRAD_TOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tests.thd_impl._common import saved_official_weights, single_process_group

    single_process_group()
    return saved_official_weights(tmp_path_factory.mktemp("ep"))


@pytest.fixture(scope="module")
def reference():
    """EP-1 results per implementation, computed once."""
    return {}


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_ep_matches_ep1(weights, reference, impl, ep, tmp_path):
    official, path = weights
    if impl not in reference:
        reference[impl] = ep_results(impl, official, 1, 0, torch.device("cpu"))
    want = reference[impl]
    out = tmp_path / f"ep{ep}.pt"
    spawn_cpu_ranks(_worker.run, (ep, PORT, impl, str(path), str(out)), ep)
    got = torch.load(out)
    assert got["local_experts"] * ep == want["local_experts"]    # each rank really holds its share only
    # the full view (weight export, checkpoints) gathers every rank's experts back under their own names
    assert set(got["state"]) == set(want["state"]) == set(official)
    for name, t in official.items():
        assert torch.equal(got["state"][name].to(t.dtype), t), name
    assert (got["logprobs"] - want["logprobs"]).abs().max().item() <= LP_TOL
    assert abs(got["loss"] - want["loss"]) <= LP_TOL
    # under EP an expert without a gradient is gathered as zeros (every rank takes part in the gather):
    # the MTP layer's experts, which this loss does not reach
    assert set(want["grads"]) <= set(got["grads"])
    for name, g in got["grads"].items():
        ref = want["grads"].get(name, torch.zeros_like(g))
        assert (g - ref).abs().max().item() <= GRAD_TOL, name
    # the experts of both ranks carry gradient (tokens crossed ranks both ways)
    experts = [n for n in want["grads"] if ".ffn.experts." in n and ".w1." in n]
    assert all(want["grads"][n].abs().sum() > 0 for n in experts[:2] + experts[-2:])
