"""launchers.scoring.score_packed: every sequence packed into one THD stream (optionally over CP or EP gloo
processes) scores exactly like the unpacked reference scorer, in the same format."""

from __future__ import annotations

import pytest
import torch

from ._common import TINY, single_process_group

LENGTHS = (0, 1, 5, 140, 300, 2)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from core.checkpoint import load_into, open_checkpoint, prepare_checkpoint
    from kernels.reference.model import DeepseekV4Model

    single_process_group()
    ckpt = prepare_checkpoint(tmp_path_factory.mktemp("score") / "ckpt", TINY, dtype="bf16", seed=0)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    ref = DeepseekV4Model(TINY)
    load_into(ref, open_checkpoint(ckpt))
    with torch.no_grad():  # the unpacked scorer: each sequence alone, [] below 2 tokens
        want = [ref.logprobs(torch.tensor([s]))[0].tolist() if len(s) > 1 else [] for s in seqs]
    return ckpt, seqs, want


def _run(impl: str, ckpt, **sizes):
    """The normalized run of `dsv4 logprobs --impl IMPL --qkv-format thd ...` on the checkpoint's config."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from launchers.stages import checkpoint_config

    return normalize(Choices(impl=impl, qkv_format="thd", model=checkpoint_config(ckpt), job="score", **sizes),
                     make_host(third_party=False))


def _close(got, want):
    assert [len(x) for x in got] == [len(x) for x in want]
    for a, b in zip(got, want):
        if b:
            assert (torch.tensor(a) - torch.tensor(b)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_packed_scores_match_unpacked(case, impl):
    from launchers.scoring import score_packed

    ckpt, seqs, want = case
    _close(score_packed(ckpt, seqs, _run(impl, ckpt)), want)


def test_packed_scores_over_cp2(case, monkeypatch, caplog):
    """Also: rank 0's port, picked free, is taken by another process before rank 0 binds it (a socket of this
    test listens there); the ranks start again on another (``core.ports.on_free_port``)."""
    import socket

    import core.ports
    from launchers.scoring import score_packed

    ckpt, seqs, want = case
    real = core.ports.free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(core.ports, "free_port", lambda: next(picks, None) or real())
        _close(score_packed(ckpt, seqs, _run("miles", ckpt, cp=2)), want)
    assert any(f"port {taken} was taken" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_scores_over_ep2(case, impl):
    """Expert parallel 2: each rank scores every other sequence with half the experts (tokens of both ranks
    cross in every MoE layer); the results come back in the caller's order."""
    from launchers.scoring import score_packed

    ckpt, seqs, want = case
    _close(score_packed(ckpt, seqs, _run(impl, ckpt, ep=2)), want)


def test_ep_scoring_with_an_idle_rank(case):
    """One sequence over EP 4: three ranks score only a pad stream, yet their experts serve the fourth."""
    from launchers.scoring import score_packed

    ckpt, seqs, want = case
    _close(score_packed(ckpt, seqs[3:4], _run("miles", ckpt, ep=4)), want[3:4])


def test_pack_stream_pads_for_cp():
    from launchers.scoring import pack_stream

    ids, cu, kept = pack_stream([[5] * 3, [], [7] * 200], (4, 128), cp=2)
    assert kept == [0, None, 1]
    assert ids.numel() % 256 == 0 and ids.numel() // 2 >= 128
    assert cu.tolist()[:3] == [0, 3, 203] and cu.tolist()[-1] == ids.numel()


@pytest.mark.parametrize("sizes", [dict(tp=2), dict(ep=2)])
def test_a_native_checkpoint_scores_like_its_hf_source(case, tmp_path, sizes):
    """``dsv4 logprobs --checkpoint NATIVE`` over two ranks (``engine.loading.load_weights``: each rank reads
    its tensor-parallel slices, or its experts, from the stored chunks): the HF checkpoint's scores."""
    import torch

    from core.checkpoint import open_checkpoint
    from core.native_checkpoint import save_native
    from core.weight_contract import hf_to_native
    from launchers.scoring import score_packed

    ckpt, seqs, want = case
    reader = open_checkpoint(ckpt)
    native = save_native(tmp_path / "native", dict(hf_to_native(reader.iter_tensors(
        dequantize=True, dtype=torch.bfloat16, progress=False), TINY)), impl="miles", config=TINY)
    _close(score_packed(native, seqs, _run("miles", native, **sizes)), want)
