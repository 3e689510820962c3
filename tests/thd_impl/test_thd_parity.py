"""Packed sequences (THD) in both implementations, against the reference model run on each sample alone.

Segments: 1-token samples, samples shorter than a compress ratio, exactly one ratio-128 group, past the
128-token window, and a trailing pad segment. fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from ._common import LENGTHS, build, cu_seqlens, grads_official, official_weights, packed_loss, reference, samples, \
    single_process_group, stream

TOL = 1e-4


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    single_process_group()
    return official_weights(tmp_path_factory.mktemp("thd"))


@pytest.fixture(scope="module")
def alone(weights):
    """Reference log-probs of each sample run alone (``[L-1]``; empty for 1-token samples)."""
    ref = reference(weights)
    with torch.no_grad():
        return [ref.logprobs(s[None])[0] if s.numel() > 1 else torch.zeros(0) for s in samples()]


def _segments(lp: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample ``[L-1]`` slices of a packed ``[T]`` log-prob vector."""
    cu = cu_seqlens().tolist()
    return [lp[cu[i]:cu[i + 1] - 1] for i in range(len(LENGTHS))]


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_packed_equals_each_sample_alone(weights, alone, impl):
    m = build(impl, weights, qkv_format="thd")
    with torch.no_grad():
        lp = m.logprobs(stream(), cu_seqlens())
    assert lp.shape == (int(cu_seqlens()[-1]),)
    for i, (got, want) in enumerate(zip(_segments(lp), alone)):
        assert got.shape == want.shape, i
        assert (got - want).abs().max().item() <= TOL if want.numel() else True, (i, LENGTHS[i])


def test_miles_bshd_and_thd_agree(weights):
    bshd = build("miles", weights, qkv_format="bshd")
    thd = build("miles", weights, qkv_format="thd")
    with torch.no_grad():
        packed = _segments(thd.logprobs(stream(), cu_seqlens()))
        for i, s in enumerate(samples()):
            if s.numel() < 2:
                continue
            one = bshd.logprobs(s[None])[0]
            assert (one - packed[i]).abs().max().item() <= TOL, (i, LENGTHS[i])
        # a padded BSHD batch of equal-length samples equals the same samples packed
        batch = torch.stack([s[:128] for s in samples() if s.numel() >= 128])
        lens = [128] * batch.shape[0]
        lp = thd.logprobs(batch.reshape(-1), cu_seqlens(lens, None))
        want = bshd.logprobs(batch)
        assert (lp.view(len(lens), 128)[:, :-1] - want).abs().max().item() <= TOL


def test_miles_thd_gradients_equal_per_sample_sum(weights):
    """Gradients of the packed loss (trunk + MTP) equal the sum over samples run alone (BSHD)."""
    m = build("miles", weights, qkv_format="thd")
    cu, ids = cu_seqlens(total=None), stream(total=None)
    packed_loss(m, "miles", ids, cu, 1, 0).backward()
    packed = grads_official(m)

    b = build("miles", weights, qkv_format="bshd")
    n1 = float(sum(max(n - 1, 0) for n in LENGTHS))
    n2 = float(sum(max(n - 2, 0) for n in LENGTHS))
    for s in samples():
        if s.numel() < 2:
            continue
        x = s[None]
        logits, streams = b(x, return_hidden_streams=True)
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        loss = -lp.sum() / n1
        if s.numel() > 2:
            ml = b.mtp_logits(x, streams)[0]
            lp2 = torch.log_softmax(ml[:, :-1], -1).gather(-1, x[:, 2:, None]).squeeze(-1)
            loss = loss - 0.3 * lp2.sum() / n2
        loss.backward()
    alone_grads = grads_official(b)
    assert set(alone_grads) == set(packed)
    for name, g in packed.items():
        assert (g - alone_grads[name]).abs().max().item() <= 1e-6, name
