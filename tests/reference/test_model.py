"""Whole-model behaviour of the reference model: shapes, names, dtypes, causality, MTP, init."""

from __future__ import annotations

import time

import pytest
import torch

from core.config import preset
from kernels.reference.indexer import Indexer
from kernels.reference.model import DeepseekV4Model, balanced_tid2eid, init_weights
from kernels.reference.rope import layer_inv_freq
from tests.reference.tiny_models import tiny_reference_model


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_reference_model()


def test_any_sequence_length(tiny_model):
    ids = torch.randint(0, 1024, (1, 140), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for S in (1, 2, 3, 4, 5, 127, 128, 129, 133):
            out = tiny_model(ids[:, :S])
            assert out.shape == (1, S, 1024) and out.dtype == torch.float32
            assert torch.isfinite(out).all()


def test_causality(tiny_model):
    """Changing tokens after position p must not change logits at positions <= p (window, compressed
    entries, indexer and MTP included)."""
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 1024, (1, 270), generator=g)
    b = a.clone()
    p = 150
    b[:, p + 1:] = torch.randint(0, 1024, (1, 270 - p - 1), generator=g)
    with torch.no_grad():
        la, lb = tiny_model(a), tiny_model(b)
        assert (la[:, : p + 1] - lb[:, : p + 1]).abs().max() < 1e-5
        assert (la[:, p + 1:] - lb[:, p + 1:]).abs().max() > 1e-3
        ma, mb = tiny_model.mtp_logits(a)[0], tiny_model.mtp_logits(b)[0]
        # mtp row i sees tokens <= i+1
        assert (ma[:, :p] - mb[:, :p]).abs().max() < 1e-5
        assert (ma[:, p:] - mb[:, p:]).abs().max() > 1e-3


def test_mtp_composition(tiny_model):
    """mtp_logits = head(mtp.norm(hc_head_mtp(Block_mtp(e_proj(enorm(E t_{i+1})) + h_proj(hnorm(H_i))))))."""
    m = tiny_model
    ids = torch.randint(0, 1024, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, streams = m(ids, return_hidden_streams=True)
        torch.testing.assert_close(logits, m(ids))
        blk = m.mtp[0]
        e = blk.enorm(m.embed.weight[ids[:, 1:]])
        x = (e @ blk.e_proj.weight.T)[:, :, None, :] + blk.hnorm(streams[:, :-1]) @ blk.h_proj.weight.T
        from kernels.reference.model import Block
        x = Block.forward(blk, x, ids[:, 1:])
        want = blk.collapse(x) @ m.head.weight.T
        got = m.mtp_logits(ids)
    assert len(got) == 1 and got[0].shape == (2, 36, 1024)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    assert blk.attn.ratio == 0 and not blk.ffn.gate.hash  # window-only, learned routing with bias


def test_logprobs(tiny_model):
    ids = torch.randint(0, 1024, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lp = tiny_model.logprobs(ids)
        logits = tiny_model(ids)
    assert lp.shape == (2, 19)
    want = torch.log_softmax(logits[0, 4], -1)[ids[0, 5]]
    torch.testing.assert_close(lp[0, 4], want)


def test_indexer_topk_brute_force():
    cfg = preset("tiny")
    idx_mod = Indexer(cfg).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in idx_mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    S = 61
    x = torch.randn(1, S, cfg.dim, generator=g, dtype=torch.float64)
    cq = torch.randn(1, S, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    inv = layer_inv_freq(cfg, 1)
    torch.set_grad_enabled(False)
    try:
        _check_indexer(cfg, idx_mod, x, cq, inv, S)
    finally:
        torch.set_grad_enabled(True)


def _check_indexer(cfg, idx_mod, x, cq, inv, S):
    got = idx_mod(x, cq, inv)
    k = min(cfg.index_topk, S // 4)
    assert got.shape == (1, S, k)
    # oracle scores without the Hadamard rotation (orthonormal and an involution: undo it on K, skip it on q)
    from kernels.reference.compressor import hadamard_transform
    from kernels.reference.rope import apply_rope, rope_cos_sin
    K = hadamard_transform(idx_mod.compressor(x, inv)[0])
    cos, sin = rope_cos_sin(inv, torch.arange(S))
    q = apply_rope((cq @ idx_mod.wq_b.weight.T).view(1, S, cfg.index_n_heads, cfg.index_head_dim), cos, sin)[0]
    w = (x @ idx_mod.weights_proj.weight.T)[0] / (cfg.index_head_dim * cfg.index_n_heads) ** 0.5
    for t in range(S):
        visible = (t + 1) // 4
        scores = [sum(w[t, h] * torch.relu(torch.dot(q[t, h], K[j])) for h in range(cfg.index_n_heads))
                  for j in range(visible)]
        row = got[0, t].tolist()
        picked = [j for j in row if j >= 0]
        assert len(set(picked)) == len(picked) == min(k, visible)
        assert all(j < visible for j in picked)
        assert row.count(-1) == k - min(k, visible)
        # the picked entries carry the k largest scores (compare values: exact ties may pick either)
        best = sorted((float(s) for s in scores), reverse=True)[: len(picked)]
        got_scores = sorted((float(scores[j]) for j in picked), reverse=True)
        assert max((abs(a - b) for a, b in zip(best, got_scores)), default=0.0) < 1e-9


def test_fp32_params_survive_bf16_cast():
    m = DeepseekV4Model(preset("tiny"))
    init_weights(m, 0)
    m = m.to(torch.bfloat16)
    sd = m.state_dict()
    for name, t in sd.items():
        keep = (name.endswith(("attn_sink", ".ape", "norm.weight", "gate.bias"))
                or name.split(".")[-1].startswith("hc_") or name.startswith("hc_"))
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64, name
        elif keep:
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    ids = torch.randint(0, 1024, (1, 40))
    with torch.no_grad():
        out = m(ids)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert m.half().layers[0].hc_attn_fn.dtype == torch.float32


def test_meta_construction_and_official_shapes():
    t0 = time.time()
    m = DeepseekV4Model(preset("flash"), device="meta")
    assert time.time() - t0 < 30
    sd = m.state_dict()
    shapes = {
        "embed.weight": (129280, 4096), "head.weight": (129280, 4096), "norm.weight": (4096,),
        "hc_head_fn": (4, 16384), "hc_head_base": (4,), "hc_head_scale": (1,),
        "layers.0.hc_attn_fn": (24, 16384), "layers.0.hc_ffn_base": (24,), "layers.0.hc_ffn_scale": (3,),
        "layers.0.attn.attn_sink": (64,), "layers.0.attn.wq_a.weight": (1024, 4096),
        "layers.0.attn.q_norm.weight": (1024,), "layers.0.attn.wq_b.weight": (32768, 1024),
        "layers.0.attn.wkv.weight": (512, 4096), "layers.0.attn.kv_norm.weight": (512,),
        "layers.0.attn.wo_a.weight": (8192, 4096), "layers.0.attn.wo_b.weight": (4096, 8192),
        "layers.2.attn.compressor.wkv.weight": (1024, 4096), "layers.2.attn.compressor.wgate.weight": (1024, 4096),
        "layers.2.attn.compressor.ape": (4, 1024), "layers.3.attn.compressor.wkv.weight": (512, 4096),
        "layers.3.attn.compressor.ape": (128, 512), "layers.3.attn.compressor.norm.weight": (512,),
        "layers.2.attn.indexer.wq_b.weight": (8192, 1024), "layers.2.attn.indexer.weights_proj.weight": (64, 4096),
        "layers.2.attn.indexer.compressor.wkv.weight": (256, 4096), "layers.2.attn.indexer.compressor.ape": (4, 256),
        "layers.2.attn.indexer.compressor.norm.weight": (128,),
        "layers.3.ffn.gate.weight": (256, 4096), "layers.3.ffn.gate.bias": (256,),
        "layers.0.ffn.gate.tid2eid": (129280, 6),
        "layers.5.ffn.experts.255.w1.weight": (2048, 4096), "layers.5.ffn.experts.0.w3.weight": (2048, 4096),
        "layers.5.ffn.experts.7.w2.weight": (4096, 2048),
        "layers.5.ffn.shared_experts.w1.weight": (2048, 4096), "layers.5.ffn.shared_experts.w2.weight": (4096, 2048),
        "mtp.0.e_proj.weight": (4096, 4096), "mtp.0.h_proj.weight": (4096, 4096), "mtp.0.enorm.weight": (4096,),
        "mtp.0.hnorm.weight": (4096,), "mtp.0.norm.weight": (4096,), "mtp.0.hc_head_fn": (4, 16384),
        "mtp.0.hc_head_base": (4,), "mtp.0.hc_head_scale": (1,), "mtp.0.ffn.gate.bias": (256,),
        "mtp.0.attn.wkv.weight": (512, 4096), "mtp.0.hc_attn_fn": (24, 16384),
    }
    for k, s in shapes.items():
        assert tuple(sd[k].shape) == s, k
    assert "layers.2.ffn.gate.tid2eid" in sd and "layers.3.ffn.gate.tid2eid" not in sd
    assert "layers.2.ffn.gate.bias" not in sd
    assert not any(k.startswith("mtp.0.attn.compressor") or "mtp.0.embed" in k or "mtp.0.head" in k for k in sd)
    assert "layers.1.attn.compressor.wkv.weight" not in sd and "layers.3.attn.indexer.wq_b.weight" not in sd
    # no stray names: every key matches the official patterns
    import re
    pat = re.compile(
        r"(embed|head|norm)\.weight|hc_head_(fn|base|scale)|"
        r"(layers\.\d+|mtp\.\d+)\.("
        r"(attn_norm|ffn_norm)\.weight|hc_(attn|ffn)_(fn|base|scale)|"
        r"attn\.(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b)\.weight|attn\.attn_sink|"
        r"attn\.(indexer\.)?compressor\.((wkv|wgate|norm)\.weight|ape)|attn\.indexer\.(wq_b|weights_proj)\.weight|"
        r"ffn\.gate\.(weight|bias|tid2eid)|ffn\.(experts\.\d+|shared_experts)\.w[123]\.weight|"
        r"(e_proj|h_proj|enorm|hnorm|norm)\.weight|hc_head_(fn|base|scale))")
    bad = [k for k in sd if not pat.fullmatch(k)]
    assert bad == []


def test_init_deterministic_and_balanced_tid2eid():
    cfg = preset("tiny")
    a, b = DeepseekV4Model(cfg), DeepseekV4Model(cfg)
    init_weights(a, 11)
    init_weights(b, 11)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    sd = a.state_dict()
    assert (sd["layers.0.attn.attn_sink"] == 0).all() and (sd["layers.1.attn.compressor.ape"] == 0).all()
    assert (sd["layers.0.hc_attn_base"] == 0).all() and (sd["layers.0.hc_attn_scale"] == 1).all()
    assert (sd["norm.weight"] == 1).all() and abs(sd["embed.weight"].std().item() - 0.02) < 1e-3
    t = sd["layers.0.ffn.gate.tid2eid"]
    assert not torch.equal(t, sd["layers.1.ffn.gate.tid2eid"])  # each hash layer has its own table
    assert t.shape == (1024, 2) and (t[:, 0] != t[:, 1]).all()
    counts = torch.bincount(t.flatten(), minlength=8)
    assert counts.max() - counts.min() <= 1
    big = balanced_tid2eid(5000, 256, 6, torch.Generator().manual_seed(0))
    assert all(len(set(r)) == 6 for r in big.tolist())
    c = torch.bincount(big.flatten(), minlength=256)
    assert c.max() - c.min() <= 1


def test_backward():
    m = DeepseekV4Model(preset("tiny"))
    init_weights(m, 0)
    ids = torch.randint(0, 1024, (1, 131), generator=torch.Generator().manual_seed(0))  # >= one HCA block
    loss = -m.logprobs(ids).mean() - m.mtp_logits(ids)[0].log_softmax(-1)[..., 0].mean()
    loss.backward()
    no_grad = sorted(n for n, p in m.named_parameters() if p.requires_grad and p.grad is None)
    # the Lightning Indexer only feeds a (non-differentiable) top-k; unused experts get no gradient
    assert all(".attn.indexer." in n or ".ffn.experts." in n for n in no_grad), no_grad
    assert m.layers[0].attn.attn_sink.grad is not None and m.layers[2].attn.compressor.ape.grad is not None
    assert m.layers[0].ffn.gate.tid2eid.grad is None


def test_meta_context_then_materialize():
    """Build under ``torch.device('meta')``, ``to_empty`` + init, and get the same model as a CPU build;
    fp64 casting is allowed (whole model in double precision)."""
    cfg = preset("tiny")
    with torch.device("meta"):
        m = DeepseekV4Model(cfg)
    assert m.embed.weight.is_meta
    m = m.to_empty(device="cpu")
    init_weights(m, 5)
    ref = DeepseekV4Model(cfg)
    init_weights(ref, 5)
    ids = torch.randint(0, 1024, (1, 133), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = m(ids), ref(ids)
        assert torch.equal(a, b)
        c = m.double()(ids)
    assert c.dtype == torch.float64 and (c - a.double()).abs().max() < 1e-4
