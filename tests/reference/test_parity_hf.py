"""Numeric parity of the reference model with HF transformers' ``DeepseekV4ForCausalLM`` (fp32).

Config: the ``tiny`` preset (layers: window+hash, CSA+hash, HCA+learned, CSA+learned; index_topk 8 so the
Lightning Indexer really selects a subset once S >= 36) with 32 indexer heads instead of 4 (``TIE_FREE``):
transformers takes the indexer's top-k with ``torch.topk``, ours with the stable top-k
(``kernels.reference.topk``: exact ties -> lowest entry id). With 4 heads an entry's score is exactly 0
whenever all four ReLUs are off, the two rules then pick different tied entries and the logits differ
(0.2 at S=128); with 32 heads no score ties, and both rules pick the same set. Sequence lengths cover below / equal to / past the
128-token window, lengths that are not multiples of 4 or 128, and lengths below one CSA block.

Tolerance: max |logits diff| <= 1e-4 and max |log-prob diff| <= 1e-4 in fp32 (observed ~2e-6).

By-design differences (documented, neutralised):
* transformers has no MTP block: ``mtp.*`` weights are not compared (the MTP path is tested in test_model.py).
* transformers always clamps the shared expert (official behaviour = ``shared_expert_clamp=True``); the
  reference-system variant ``shared_expert_clamp=False`` is tested against transformers with
  ``swiglu_limit`` large enough that no clamp binds.
* transformers omits the indexer's Hadamard rotation: it is orthonormal, so scores agree up to rounding.
* transformers renormalises the routing weights with ``+1e-20`` in the denominator (official: none);
  negligible at fp32.
* transformers' RoPE tables are computed in fp32, ours in fp64 (differences ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

import transformers  # noqa: E402  (a test-only dependency, pinned in third_party/requirements.lock)

from core.config import preset  # noqa: E402
from kernels.reference.model import DeepseekV4Model, init_weights  # noqa: E402
from tests.reference.hf_mapping import hf_config_from, hf_to_official, official_to_hf  # noqa: E402

SEQ_LENS = (3, 7, 50, 128, 131, 263)
TOL = 1e-4
TIE_FREE = dict(index_n_heads=32)   # no exact indexer-score ties: torch.topk and the stable top-k agree


def _hf_model(cfg):
    hcfg = hf_config_from(cfg)
    hcfg._attn_implementation = "eager"
    return transformers.DeepseekV4ForCausalLM(hcfg).eval()


@torch.no_grad()
def _randomize_hf(hf, cfg, seed):
    """Random values for every tensor, including the ones HF inits to constants (sinks, ape, hc base,
    router bias), so that every path contributes."""
    g = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        elif "norm" in name or "scale" in name:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        else:  # sinks, position_bias handled above (2-D), hc base
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    for name, b in hf.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.n_activated_experts]
                                 for _ in range(b.shape[0])]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)


@torch.no_grad()
def _randomize_ours(model, seed):
    init_weights(model, seed, std=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.dim() <= 1 or name.endswith(".ape"):
            base = 1.0 if ("norm" in name or name.endswith("_scale")) else 0.0
            t.copy_(base + torch.randn(t.shape, generator=g) * 0.3)


def _compare(hf, ours, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    for S in SEQ_LENS:
        ids = torch.randint(0, cfg.vocab_size, (2, S), generator=g)
        with torch.no_grad():
            a = hf(ids).logits.float()
            b = ours(ids)
        assert b.dtype == torch.float32 and b.shape == a.shape
        err = (a - b).abs().max().item()
        assert err <= TOL, f"S={S}: max |logit diff| {err}"
        la = torch.log_softmax(a[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lb = ours.logprobs(ids)
        assert lb.shape == (2, S - 1)
        assert (la - lb).abs().max().item() <= TOL, f"S={S}: log-prob diff"


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny").replace(**TIE_FREE)


def test_hf_weights_into_reference(cfg):
    hf = _hf_model(cfg)
    _randomize_hf(hf, cfg, seed=0)
    ours = DeepseekV4Model(cfg)
    init_weights(ours, 0)  # fills mtp.* (not in transformers)
    sd = hf_to_official(hf.state_dict())
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert unexpected == []
    assert all(k.startswith("mtp.") for k in missing), missing
    ours.eval()
    _compare(hf, ours, cfg, seed=1)


def test_reference_weights_into_hf(cfg):
    ours = DeepseekV4Model(cfg).eval()
    _randomize_ours(ours, seed=3)
    hf = _hf_model(cfg)
    sd = official_to_hf(ours.state_dict())
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert unexpected == [] and missing == [], (missing, unexpected)
    _compare(hf, ours, cfg, seed=2)


def test_shared_expert_clamp_variant(cfg):
    """``shared_expert_clamp=False`` equals transformers (which clamps) when no clamp binds, and differs
    when the clamp binds (so the switch is real)."""
    small = cfg.replace(n_layers=2, n_mtp_layers=0, compress_ratios=(0, 4), n_hash_layers=1)
    hf = _hf_model(small.replace(swiglu_limit=1e4))
    _randomize_hf(hf, small, seed=5)
    sd = hf_to_official(hf.state_dict())
    ids = torch.randint(0, small.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = DeepseekV4Model(small.replace(swiglu_limit=1e4, shared_expert_clamp=False)).eval()
    ours.load_state_dict(sd)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= TOL
    # a tiny limit binds: official (clamped) and variant (unclamped shared expert) must differ
    a = DeepseekV4Model(small.replace(swiglu_limit=1e-3)).eval()
    b = DeepseekV4Model(small.replace(swiglu_limit=1e-3, shared_expert_clamp=False)).eval()
    a.load_state_dict(sd)
    b.load_state_dict(sd)
    with torch.no_grad():
        assert (a(ids) - b(ids)).abs().max() > 1e-3


def test_mapping_roundtrip(cfg):
    ours = DeepseekV4Model(cfg)
    init_weights(ours, 7)
    sd = {k: v for k, v in ours.state_dict().items() if not k.startswith("mtp.")}
    back = hf_to_official(official_to_hf(sd))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
