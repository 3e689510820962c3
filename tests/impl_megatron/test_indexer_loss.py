"""The indexer KL loss (dsa_indexer_loss_coeff): value, gradient routing, and the None = off contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from backends.megatron.attention import CompressedSparseAttention, indexer_kl_loss, indexer_teacher_probs
from tests.impl_megatron.conftest import load_pair

IDX = ".core_attention.indexer."


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 1024, (140,), generator=torch.Generator().manual_seed(3))


def _model(tiny_config, tiny_checkpoint, coeff):
    _, meg = load_pair(tiny_config, tiny_checkpoint, dsa_indexer_loss_coeff=coeff)
    return meg.train()


def _naive_teacher(q, kv_all, win, comp, sink, scale):
    """Loop version: per token and head, softmax over {window keys, visible compressed keys, sink};
    compressed probabilities summed over heads, then L1-normalised."""
    T, H, _ = q.shape
    out = torch.zeros(comp.shape, dtype=torch.float64)
    for t in range(T):
        keys = [int(j) for j in win[t] if j >= 0]
        cols = [(c, int(j)) for c, j in enumerate(comp[t]) if j >= 0]
        if not cols:
            continue
        for h in range(H):
            logit = lambda j: float(q[t, h].double() @ kv_all[j].double()) * scale  # noqa: E731
            z = [logit(j) for j in keys] + [logit(j) for _, j in cols] + [float(sink[h])]
            m = max(z)
            denom = sum(math.exp(v - m) for v in z)
            for c, j in cols:
                out[t, c] += math.exp(logit(j) - m) / denom
        out[t] /= out[t].sum()
    return out


def test_teacher_and_kl_against_an_independent_computation():
    g = torch.Generator().manual_seed(0)
    T, H, D, W = 12, 3, 16, 5
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(T + 3, D, generator=g)
    sink = torch.randn(H, generator=g)
    t = torch.arange(T)[:, None]
    win = torch.where(t - W + 1 + torch.arange(W) >= 0, t - W + 1 + torch.arange(W), -1)
    vis = torch.arange(3)[None, :] < (t + 1) // 4
    comp = torch.where(vis, T + torch.arange(3)[None, :], -1)
    p = indexer_teacher_probs(q, kv, win, comp, sink, D ** -0.5)
    torch.testing.assert_close(p.double(), _naive_teacher(q, kv, win, comp, sink, D ** -0.5), atol=1e-6, rtol=1e-5)

    student = torch.randn(T, 3, generator=g)
    loss = indexer_kl_loss(p, student, vis)
    rows = vis.any(-1)
    want = torch.stack([F.kl_div(torch.log_softmax(student[i, vis[i]], -1), p[i, vis[i]], reduction="sum")
                        for i in range(T) if rows[i]]).mean()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    assert loss > 0


def test_kl_is_zero_when_the_indexer_matches_the_teacher():
    g = torch.Generator().manual_seed(1)
    T, G = 9, 4
    mask = torch.arange(G)[None, :] < (torch.arange(T)[:, None] + 1) // 2
    p = torch.softmax(torch.randn(T, G, generator=g).masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    student = torch.log(p).masked_fill(~mask, 0.0) + 3.0  # same distribution, shifted logits
    assert indexer_kl_loss(p, student, mask).abs().item() < 1e-6
    assert indexer_kl_loss(p, torch.zeros(T, G), mask).item() > 1e-3
    assert indexer_kl_loss(p, student, torch.zeros_like(mask)).item() == 0.0  # nothing visible


def test_kl_loss_traces_as_one_graph():
    """No host read, no data-dependent shape: ``fullgraph`` tracing refuses a graph break."""
    g = torch.Generator().manual_seed(2)
    T, G = 9, 4
    mask = torch.arange(G)[None, :] < (torch.arange(T)[:, None] + 1) // 3   # the first rows see nothing
    p = torch.softmax(torch.randn(T, G, generator=g).masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    student = torch.randn(T, G, generator=g, requires_grad=True)
    traced = torch.compile(indexer_kl_loss, fullgraph=True, backend="eager")
    loss = traced(p, student, mask)
    torch.testing.assert_close(loss, indexer_kl_loss(p, student, mask))
    loss.backward()
    assert torch.isfinite(student.grad).all() and (student.grad[~mask] == 0).all()
    assert traced(p, student, torch.zeros_like(mask)).item() == 0.0


def test_model_loss_matches_an_independent_computation(tiny_config, tiny_checkpoint, ids, monkeypatch):
    """The layers' losses, recomputed from the captured inputs with the loop teacher and F.kl_div."""
    meg = _model(tiny_config, tiny_checkpoint, 0.5)
    captured = []
    orig = CompressedSparseAttention._indexer_loss

    def spy(self, q, kv_all, window_idx, scores, top, layout):
        out = orig(self, q, kv_all, window_idx, scores, top, layout)
        captured.append((self, q.detach(), kv_all.detach(), window_idx, scores.detach(), layout, out.detach()))
        return out

    monkeypatch.setattr(CompressedSparseAttention, "_indexer_loss", spy)
    _, loss = meg(ids, return_indexer_loss=True)
    assert len(captured) == 2  # the two CSA layers of tiny (ratios 0 4 128 4)
    from core.thd import compressed_visible_indices

    total = 0.0
    for mod, q, kv_all, win, scores, layout, out in captured:
        T = q.shape[0]
        flat = compressed_visible_indices(layout, 4)
        comp = torch.where(flat >= 0, flat + T, -1)
        p = _naive_teacher(q, kv_all, win, comp, mod.attn_sink.detach(), mod.scale)
        kls = []
        for t in range(T):
            cols = flat[t][flat[t] >= 0]
            if cols.numel():
                kls.append(F.kl_div(torch.log_softmax(scores[t, cols].double(), -1), p[t, :cols.numel()],
                                    reduction="sum"))
        layer = torch.stack(kls).mean()
        assert abs(layer.item() - out.item()) < 1e-5
        total += layer.item()
    assert loss is not None and torch.isfinite(loss) and loss.item() >= 0
    assert abs(loss.item() - 0.5 * total) < 1e-5


def test_gradient_reaches_only_the_indexer(tiny_config, tiny_checkpoint, ids):
    meg = _model(tiny_config, tiny_checkpoint, 1.0)
    logits, loss = meg(ids, return_indexer_loss=True)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    with_grad = {n for n, p in meg.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    indexer = {n for n, p in meg.named_parameters() if IDX in n}
    assert with_grad and with_grad <= indexer
    # every indexer tensor of the two CSA layers learns from the loss
    assert with_grad == {n for n in indexer if meg.get_parameter(n).requires_grad}


def test_lm_loss_gives_the_indexer_no_gradient(tiny_config, tiny_checkpoint, ids):
    meg = _model(tiny_config, tiny_checkpoint, 1.0)
    logits, _ = meg(ids, return_indexer_loss=True)
    F.cross_entropy(logits[:-1], ids[1:]).backward()
    for n, p in meg.named_parameters():
        if IDX in n:
            assert p.grad is None or p.grad.abs().sum() == 0, n
    assert meg.decoder.layers[1].self_attention.linear_q_down_proj.weight.grad.abs().sum() > 0


def test_coefficient_none_means_off(tiny_config, tiny_checkpoint, ids, monkeypatch):
    meg = _model(tiny_config, tiny_checkpoint, None)
    assert meg.config.dsa_indexer_loss_coeff is None

    def boom(*a, **k):
        raise AssertionError("indexer loss computed although dsa_indexer_loss_coeff is None")

    monkeypatch.setattr(CompressedSparseAttention, "_indexer_loss", boom)
    logits, loss = meg(ids, return_indexer_loss=True)
    assert loss is None and meg.last_indexer_loss is None
    F.cross_entropy(logits[:-1], ids[1:]).backward()  # training still works


def test_eval_mode_and_sparse_variant(tiny_config, tiny_checkpoint, ids):
    meg = _model(tiny_config, tiny_checkpoint, 1.0)
    with torch.no_grad():
        _, dense = meg(ids, return_indexer_loss=True)
        meg.config.dsa_indexer_use_sparse_loss = True
        try:
            _, sparse = meg(ids, return_indexer_loss=True)
        finally:
            meg.config.dsa_indexer_use_sparse_loss = False
        meg.eval()
        _, off = meg(ids, return_indexer_loss=True)
    assert off is None
    assert torch.isfinite(sparse) and sparse.item() >= 0 and sparse.item() != dense.item()


@pytest.mark.parametrize("coeff", [None, 1.0])
def test_indexer_scores_build_an_autograd_graph_only_for_the_kl_loss(tiny_config, tiny_checkpoint, ids, coeff):
    """Without the KL loss no loss reads the indexer's scores: an autograd graph behind them would only
    hold activations, and under CUDA-graph trees its changing lifetime made every step record its graphs
    again (megatron's step took 1.2 s instead of 52 ms on an H200)."""
    meg = _model(tiny_config, tiny_checkpoint, coeff)
    seen = []
    for layer in meg.decoder.layers:
        indexer = getattr(layer.self_attention.core_attention, "indexer", None)
        if indexer is not None:
            def record(*a, _scores=indexer.scores, **k):
                out = _scores(*a, **k)
                seen.append(out.requires_grad)
                return out

            indexer.scores = record
    logits, _ = meg(ids, return_indexer_loss=True)
    assert seen == [coeff is not None] * len(seen) and len(seen) == 2
