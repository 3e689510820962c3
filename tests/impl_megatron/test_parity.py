"""Forward parity (fp32, CPU): the megatron implementation vs the single-device reference model, both
loaded from the same prepared tiny checkpoint. Tolerance: per-token log-probs, max abs diff <= 1e-4."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.impl_megatron.conftest import load_pair

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tiny_config, tiny_checkpoint):
    ref, meg = load_pair(tiny_config, tiny_checkpoint)
    return ref.eval(), meg.eval()


def _ref_logprobs(ref, ids):
    return torch.log_softmax(ref(ids[None])[0], dim=-1)


@pytest.mark.parametrize("seq_len", [37, 140])
def test_logprob_parity_single_sequence(pair, seq_len):
    """37: window only + a few compressed groups; 140: past the 128 window, with one HCA (ratio 128)
    entry and 35 CSA entries, so window, CSA (indexer top-k 8 of 35) and HCA paths all run."""
    ref, meg = pair
    ids = torch.randint(0, 1024, (seq_len,), generator=torch.Generator().manual_seed(seq_len))
    with torch.no_grad():
        want = _ref_logprobs(ref, ids)
        got = torch.log_softmax(meg(ids), dim=-1)
        tok_ref = want[:-1].gather(-1, ids[1:, None])
        tok_meg = meg.logprobs(ids)[:-1, None]
    assert got.shape == want.shape == (seq_len, 1024)
    assert (got - want).abs().max().item() <= TOL
    assert (tok_meg - tok_ref).abs().max().item() <= TOL


def test_logprob_parity_packed_stream(pair):
    """Two samples packed in one THD stream (cu_seqlens [0, 37, 177]) = each sample run alone."""
    ref, meg = pair
    g = torch.Generator().manual_seed(11)
    a, b = torch.randint(0, 1024, (37,), generator=g), torch.randint(0, 1024, (140,), generator=g)
    cu = torch.tensor([0, 37, 177])
    with torch.no_grad():
        got = torch.log_softmax(meg(torch.cat((a, b)), cu), dim=-1)
        want = torch.cat((_ref_logprobs(ref, a), _ref_logprobs(ref, b)))
    assert (got - want).abs().max().item() <= TOL


def test_parity_is_sensitive_to_the_alpha_split(pair):
    """Guard against a vacuous parity: swapping alpha_pre and alpha_post of one layer must change the output."""
    ref, meg = pair
    ids = torch.randint(0, 1024, (37,), generator=torch.Generator().manual_seed(5))
    hc = meg.decoder.layers[1].self_attention_hyper_connection
    with torch.no_grad():
        base = meg(ids)
        pre, post = hc.alpha_pre.clone(), hc.alpha_post.clone()
        try:
            hc.alpha_pre.copy_(post)
            hc.alpha_post.copy_(pre)
            moved = meg(ids)
        finally:
            hc.alpha_pre.copy_(pre)
            hc.alpha_post.copy_(post)
    assert (moved - base).abs().max().item() > 1e-3


def test_mtp_logits_parity(pair):
    """The MTP block (window-only layer, separate e_proj and h_proj) on one sequence and on a packed stream."""
    ref, meg = pair
    g = torch.Generator().manual_seed(13)
    a, b = torch.randint(0, 1024, (37,), generator=g), torch.randint(0, 1024, (20,), generator=g)
    with torch.no_grad():
        want_a, want_b = ref.mtp_logits(a[None])[0][0], ref.mtp_logits(b[None])[0][0]
        (got_a, cu_a), = meg.mtp_logits(a)
        (got_ab, cu_ab), = meg.mtp_logits(torch.cat((a, b)), torch.tensor([0, 37, 57]))
    assert cu_a.tolist() == [0, 36] and cu_ab.tolist() == [0, 36, 55]
    lsm = lambda x: torch.log_softmax(x, -1)  # noqa: E731
    assert (lsm(got_a) - lsm(want_a)).abs().max().item() <= TOL
    assert (lsm(got_ab) - lsm(torch.cat((want_a, want_b)))).abs().max().item() <= TOL


def test_layout_is_fully_derived_before_the_blocks(tiny_config, tiny_checkpoint):
    """The model prepares its layout eagerly (``ThdLayout.prepare``) before any block runs, so compiled
    blocks only read kept tensors (a tensor derived inside a CUDA graph is overwritten by the next replay).
    Guard: a forward and backward with the indexer KL loss derives nothing the preparation did not."""
    from core.thd import ThdLayout

    _, meg = load_pair(tiny_config, tiny_checkpoint, dsa_indexer_loss_coeff=0.1)
    ids = torch.randint(0, 1024, (177,), generator=torch.Generator().manual_seed(3))
    layout = ThdLayout(torch.tensor([0, 37, 177]))
    layout.prepare(meg.config.csa_window_size, meg.config.csa_compress_ratios)
    prepared = set(layout._derived)
    assert {("groups", 4), ("groups", 128), ("ranges", 4), ("visible", 4, None, 0)} <= prepared
    logits, kl = meg.train()(ids, layout=layout, return_indexer_loss=True)
    (logits.float().logsumexp(-1).mean() + kl).backward()
    assert kl is not None and set(layout._derived) == prepared


class _NoHostRead(TorchDispatchMode):
    """Raises on an op that reads tensor data on the host (on a GPU: a synchronisation): ``.item()`` / ``int(t)`` /
    ``bool(t)``, ``nonzero``, boolean-mask indexing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        bad = name in ("aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.masked_select")
        if name in ("aten.index", "aten.index_put", "aten._index_put_impl") and len(args) > 1:
            bad = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        assert not bad, f"host read: {func}"
        return func(*args, **(kwargs or {}))


def test_a_kept_layout_reads_nothing_on_the_host(tiny_config, tiny_checkpoint):
    """The trainer keeps one layout per micro-batch shape (``train.model``): a forward and backward on it after the
    first, the MTP depth included, reads nothing on the host (each read is a host synchronisation on a GPU; the MTP
    depth's kept rows and layout cost 6 per micro-batch before they were kept with the layout), and gives the same
    numbers as the first."""
    from core.thd import ThdLayout, pack_rows

    _, meg = load_pair(tiny_config, tiny_checkpoint, perturb=False)
    meg.train()
    ids = torch.randint(0, 1024, (2 * 144,), generator=torch.Generator().manual_seed(4))
    layout = ThdLayout(torch.tensor([0, 144, 288]))      # two rows of 144 (pack_rows): compressed groups tile

    def step():
        meg.zero_grad(set_to_none=True)
        streams, _, lay = meg.hidden_streams(ids, layout=layout)
        (mtp, cu), = meg.mtp_from_streams(ids, streams, lay)
        y = meg.decoder.collapse(streams)[:, 0]
        (meg._logits(y).logsumexp(-1).mean() + mtp.logsumexp(-1).mean()).backward()
        return cu, {n: p.grad.clone() for n, p in meg.named_parameters() if p.grad is not None}

    cu, first = step()
    with _NoHostRead():
        cu_again, again = step()
        stream, rows_cu = pack_rows(ids.view(2, 144))       # the trainer's packing of [B, S] rows: no check read
    assert torch.equal(stream, ids) and rows_cu.tolist() == layout.cu_seqlens.tolist()
    assert cu.tolist() == cu_again.tolist() == [0, 143, 286]
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)


@pytest.mark.parametrize("lengths", [(144, 144), (37, 140)], ids=["tiling", "tails"])
def test_compressor_slots_view_equals_gather(tiny_config, tiny_checkpoint, monkeypatch, lengths):
    """Where the compressed groups tile the stream the compressors take their slots as a view of the projections
    (``backends.megatron.attention._group_slots``); the gather of the general case gives the same values and
    gradients, bit for bit (``tails``: the gather runs both times, a control)."""
    import backends.megatron.attention as attention
    from core.thd import ThdLayout

    _, meg = load_pair(tiny_config, tiny_checkpoint, dsa_indexer_loss_coeff=0.1)   # the indexer's compressor learns
    ids = torch.randint(0, 1024, (sum(lengths),), generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, lengths[0], sum(lengths)])

    def run():
        meg.zero_grad(set_to_none=True)
        logits, kl = meg.train()(ids, layout=ThdLayout(cu), return_indexer_loss=True)
        (logits.logsumexp(-1).mean() + kl).backward()
        return logits, {n: p.grad.clone() for n, p in meg.named_parameters() if "compressor" in n}

    assert attention._groups_tile_stream(ThdLayout(cu), 4) == (lengths == (144, 144))
    got, got_grads = run()
    monkeypatch.setattr(attention, "_groups_tile_stream", lambda layout, ratio: False)
    want, want_grads = run()
    assert torch.equal(got, want) and got_grads.keys() == want_grads.keys() and len(want_grads) > 0
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)
