"""Unit tests of the pure pieces of the reference model, each against an independently written oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from core.config import preset
from kernels.reference.attention import compressed_visible_indices, sparse_attention_with_sink, window_indices
from kernels.reference.compressor import Compressor, hadamard_transform
from kernels.reference.mhc import hc_head, hc_post, hc_pre, sinkhorn
from kernels.reference.moe import Expert, Gate, swiglu
from kernels.reference.rope import apply_rope, rope_cos_sin, rope_inv_freq, yarn_correction_range

torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------- index builders
@pytest.mark.parametrize("S,W", [(1, 128), (5, 4), (130, 128), (263, 128), (7, 7)])
def test_window_indices_brute_force(S, W):
    idx = window_indices(S, W)
    for t in range(S):
        got = {int(i) for i in idx[t] if i >= 0}
        want = {s for s in range(S) if s <= t and t - s < W}
        assert got == want
        assert len(want) == min(t + 1, W)


@pytest.mark.parametrize("S,m", [(3, 4), (4, 4), (7, 4), (131, 4), (127, 128), (128, 128), (300, 128)])
def test_compressed_visibility_brute_force(S, m):
    idx = compressed_visible_indices(S, m)
    assert idx.shape == (S, S // m)
    for t in range(S):
        got = {int(j) for j in idx[t] if j >= 0}
        # entry j covers tokens [j*m, (j+1)*m-1] and is visible once its last token is <= t
        want = {j for j in range(S // m) if (j + 1) * m - 1 <= t}
        assert got == want


# ------------------------------------------------------------------- sparse attention + sink
def _dense_attention_with_sink(q, kv, allowed, sink, scale):
    """Dense masked softmax over all N rows with the sink logit appended (written independently)."""
    B, S, H, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for t in range(S):
            for h in range(H):
                keys = [s for s in range(kv.shape[1]) if allowed[b, t, s]]
                z = torch.stack([q[b, t, h] @ kv[b, s] * scale for s in keys] + [sink[h]])
                p = torch.exp(z - z.max())
                p = p / p.sum()
                acc = torch.zeros(D, dtype=q.dtype)
                for w, s in zip(p[:-1], keys):
                    acc = acc + w * kv[b, s]
                out[b, t, h] = acc
    return out


def test_sparse_attention_matches_dense_with_gradients():
    g = torch.Generator().manual_seed(0)
    B, S, H, D, N, K = 2, 5, 3, 8, 9, 4
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, N, D, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(S)]) for _ in range(B)])
    idx[0, 0, 1:] = -1  # rows with ignored slots
    idx[1, 2, 0] = -1
    allowed = torch.zeros(B, S, N, dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            for i in idx[b, t]:
                if i >= 0:
                    allowed[b, t, i] = True
    scale = D ** -0.5
    out = sparse_attention_with_sink(q, kv, idx, sink, scale)
    ref = _dense_attention_with_sink(q, kv, allowed, sink, scale)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * go).sum(), (q, kv, sink))
    grads_ref = torch.autograd.grad((ref * go).sum(), (q, kv, sink))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert grads[2].abs().min() > 0  # the sink gets a gradient for every head


def test_sink_only_in_denominator():
    # one key, q.k = 0: p = 1 / (1 + exp(sink)); the sink contributes no value
    q = torch.zeros(1, 1, 2, 4)
    kv = torch.ones(1, 1, 4)
    sink = torch.tensor([0.0, math.log(3.0)])
    o = sparse_attention_with_sink(q, kv, torch.zeros(1, 1, 1, dtype=torch.long), sink, 1.0)
    torch.testing.assert_close(o[0, 0, 0], torch.full((4,), 0.5))
    torch.testing.assert_close(o[0, 0, 1], torch.full((4,), 0.25))


# ----------------------------------------------------------------------------------- mHC
def test_sinkhorn_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 4, generator=g)
    m = sinkhorn(x, iters=20, eps=1e-6)
    assert (m > 0).all()
    torch.testing.assert_close(m.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)  # last step: columns
    torch.testing.assert_close(m.sum(-1), torch.ones(64, 4), atol=1e-3, rtol=0)
    # more iterations converge rows too, even for peaky logits
    m = sinkhorn(x * 3, iters=2000, eps=1e-6)
    torch.testing.assert_close(m.sum(-1), torch.ones(64, 4), atol=2e-4, rtol=0)
    torch.testing.assert_close(m.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)


def test_sinkhorn_steps():
    x = torch.randn(4, 4)
    m = torch.softmax(x, -1) + 1e-6
    m = m / (m.sum(0) + 1e-6)
    for _ in range(2):
        m = m / (m.sum(1, keepdim=True) + 1e-6)
        m = m / (m.sum(0) + 1e-6)
    torch.testing.assert_close(sinkhorn(x, 3, 1e-6), m)


def test_hc_post_orientation():
    """y_k = post_k f + sum_j comb[j, k] x_j (sum over the FIRST index: comb^T X)."""
    n, d = 4, 3
    x = torch.randn(1, 1, n, d)
    comb = torch.arange(n * n, dtype=torch.float32).view(1, 1, n, n)  # non-symmetric
    post = torch.tensor([[[0.5, 1.0, 1.5, 2.0]]])
    f = torch.randn(1, 1, d)
    y = hc_post(f, x, post, comb)
    for k in range(n):
        want = post[0, 0, k] * f[0, 0] + sum(comb[0, 0, j, k] * x[0, 0, j] for j in range(n))
        torch.testing.assert_close(y[0, 0, k], want)


def test_hc_pre_and_head_formulas():
    g = torch.Generator().manual_seed(1)
    n, d = 4, 8
    x = torch.randn(2, 3, n, d, generator=g, dtype=torch.float64)
    fn = torch.randn((2 + n) * n, n * d, generator=g, dtype=torch.float64)
    base = torch.randn((2 + n) * n, generator=g, dtype=torch.float64)
    scale = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    u, post, comb = hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    for b in range(2):
        for s in range(3):
            xh = x[b, s].reshape(-1)
            mix = (fn @ xh) / torch.sqrt((xh ** 2).mean() + 1e-6)
            pre = torch.sigmoid(scale[0] * mix[:n] + base[:n]) + 1e-6
            pst = 2 * torch.sigmoid(scale[1] * mix[n:2 * n] + base[n:2 * n])
            C = (scale[2] * mix[2 * n:] + base[2 * n:]).view(n, n)
            torch.testing.assert_close(u[b, s], (pre[:, None] * x[b, s]).sum(0))
            torch.testing.assert_close(post[b, s], pst)
            torch.testing.assert_close(comb[b, s], sinkhorn(C, 20, 1e-6))
    hfn = torch.randn(n, n * d, generator=g, dtype=torch.float64)
    hb = torch.randn(n, generator=g, dtype=torch.float64)
    hs = torch.rand(1, generator=g, dtype=torch.float64)
    y = hc_head(x, hfn, hs, hb, 1e-6, 1e-6)
    xh = x[1, 2].reshape(-1)
    pre = torch.sigmoid(hs * (hfn @ xh) / torch.sqrt((xh ** 2).mean() + 1e-6) + hb) + 1e-6
    torch.testing.assert_close(y[1, 2], (pre[:, None] * x[1, 2]).sum(0))


# ----------------------------------------------------------------------------------- MoE
def _tiny():
    return preset("tiny")


def test_hash_routing_uses_tid2eid_for_selection_and_scores_for_weights():
    cfg = _tiny()
    gate = Gate(cfg, hash_layer=True)
    assert not hasattr(gate, "bias") and not gate.tid2eid.requires_grad
    assert "tid2eid" in dict(gate.named_parameters())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        gate.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(cfg.vocab_size)]))
    x = torch.randn(5, cfg.dim, generator=g)
    ids = torch.tensor([3, 17, 3, 1000, 0])
    w, idx = gate(x, ids)
    assert torch.equal(idx, gate.tid2eid[ids])
    s = torch.sqrt(F.softplus(x @ gate.weight.T))
    sel = s.gather(1, idx)
    torch.testing.assert_close(w, sel / sel.sum(1, keepdim=True) * cfg.route_scale)


def test_learned_routing_bias_only_for_selection():
    cfg = _tiny()
    gate = Gate(cfg, hash_layer=False)
    assert "bias" in dict(gate.named_buffers()) and "bias" not in dict(gate.named_parameters())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        gate.bias.zero_()
        gate.bias[5] = 100.0  # forces expert 5 into every selection
    x = torch.randn(6, cfg.dim, generator=g)
    w, idx = gate(x)
    s = torch.sqrt(F.softplus(x @ gate.weight.T))
    assert (idx == 5).any(1).all()
    other = torch.where(idx[:, 0] == 5, idx[:, 1], idx[:, 0])
    masked = s.clone()
    masked[:, 5] = -1
    assert torch.equal(other, masked.argmax(1))  # the other pick is the best unbiased score
    sel = s.gather(1, idx)
    torch.testing.assert_close(w, sel / sel.sum(1, keepdim=True) * cfg.route_scale)  # bias not in weights


def test_swiglu_asymmetric_clamp():
    L = 10.0
    g = torch.tensor([-20.0, 20.0, 3.0, 3.0, 3.0])
    v = torch.tensor([1.0, 1.0, 20.0, -20.0, 2.0])
    want = torch.stack([F.silu(torch.tensor(-20.0)) * 1,   # gate has no lower clamp
                        F.silu(torch.tensor(10.0)) * 1,    # gate clamped above
                        F.silu(torch.tensor(3.0)) * 10,    # up clamped to +L
                        F.silu(torch.tensor(3.0)) * -10,   # up clamped to -L
                        F.silu(torch.tensor(3.0)) * 2])
    torch.testing.assert_close(swiglu(g, v, L), want)
    torch.testing.assert_close(swiglu(g, v, 0.0), F.silu(g) * v)  # limit <= 0: no clamp


def test_expert_weight_applied_before_w2():
    e = Expert(16, 8, 10.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 16, generator=g)
    w = torch.tensor([0.5, 2.0, 1.0])
    h = swiglu(x @ e.w1.weight.T, x @ e.w3.weight.T, 10.0)
    torch.testing.assert_close(e(x, w), (h * w[:, None]) @ e.w2.weight.T)


# ---------------------------------------------------------------------------------- RoPE
def test_yarn_correction_range_and_frequencies():
    assert yarn_correction_range(64, 160000.0, 65536, 32.0, 1.0) == (15, 25)
    f = rope_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    base = torch.tensor([160000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    for i in range(32):
        gamma = 1 - min(max((i - 15) / (25 - 15), 0.0), 1.0)
        want = base[i] / 16 * (1 - gamma) + base[i] * gamma
        assert abs(f[i].item() - want.item()) <= 1e-15 * max(1.0, want.item())
    torch.testing.assert_close(f[:16], base[:16])
    torch.testing.assert_close(f[25:], base[25:] / 16)
    # no YaRN when original_seq_len == 0
    torch.testing.assert_close(rope_inv_freq(64, 10000.0), torch.tensor(
        [10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64))


def test_rope_interleaved_trailing_matches_complex_rotation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 12, generator=g, dtype=torch.float64)
    inv = rope_inv_freq(8, 10000.0)
    pos = torch.arange(6)
    cos, sin = rope_cos_sin(inv, pos)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[..., :4], x[..., :4])  # leading nope dims untouched
    z = torch.view_as_complex(x[..., 4:].reshape(2, 6, 3, 4, 2).contiguous())
    rot = torch.polar(torch.ones(6, 4, dtype=torch.float64), pos[:, None].double() * inv[None, :])
    want = torch.view_as_real(z * rot[None, :, None, :]).reshape(2, 6, 3, 8)
    torch.testing.assert_close(y[..., 4:], want)
    torch.testing.assert_close(apply_rope(y, cos, sin, inverse=True), x)


# ------------------------------------------------------------------------- compressor
def test_hadamard_matches_sylvester_matrix():
    Hm = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):
        Hm = torch.cat((torch.cat((Hm, Hm), 1), torch.cat((Hm, -Hm), 1)), 0)
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(x), x @ Hm.T / 4)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x)


def _compressor_oracle(comp, x, inv_freq):
    """Per-entry loop over slots/channels, straight from the math."""
    B, S, _ = x.shape
    m, c = comp.ratio, comp.head_dim
    a = x @ comp.wkv.weight.T
    z = x @ comp.wgate.weight.T
    out = []
    for i in range(S // m):
        slots_a, slots_z = [], []
        if comp.overlap and i > 0:
            for p in range(m):
                slots_a.append(a[:, m * (i - 1) + p, :c])
                slots_z.append(z[:, m * (i - 1) + p, :c] + comp.ape[p, :c])
        for p in range(m):
            lo = c if comp.overlap else 0
            slots_a.append(a[:, m * i + p, lo:lo + c])
            slots_z.append(z[:, m * i + p, lo:lo + c] + comp.ape[p, lo:lo + c])
        A, Z = torch.stack(slots_a, 1), torch.stack(slots_z, 1)
        e = (torch.softmax(Z, dim=1) * A).sum(1)
        e = e / torch.sqrt((e ** 2).mean(-1, keepdim=True) + 1e-6) * comp.norm.weight
        cos, sin = rope_cos_sin(inv_freq, torch.tensor([m * i]))
        e = apply_rope(e[:, None], cos, sin)[:, 0]
        out.append(hadamard_transform(e) if comp.rotate else e)
    return torch.stack(out, 1) if out else x.new_zeros(B, 0, c)


@pytest.mark.parametrize("ratio,rotate,S", [(4, False, 19), (4, True, 16), (8, False, 35), (4, False, 3)])
def test_compressor_matches_loop_oracle(ratio, rotate, S):
    torch.manual_seed(0)
    comp = Compressor(dim=16, head_dim=8, rope_dim=4, ratio=ratio, rotate=rotate).double()
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64))
    x = torch.randn(2, S, 16, dtype=torch.float64)
    inv = rope_inv_freq(4, 160000.0, 16.0, 65536, 32.0, 1.0)
    torch.testing.assert_close(comp(x, inv), _compressor_oracle(comp, x, inv))
