"""KV-cached generation with the reference model (``kernels.reference.decode``) against the full forward.

The model is the ``tiny`` preset (window, CSA and HCA trunk layers, hash and learned routing, window 128,
HCA ratio 128) with non-trivial sinks / ape / mHC bases, in fp32, with its 4 Lightning-Indexer heads: an
entry's score is exactly 0 whenever all four ReLUs are 0, so the long rows have exact ties at the top-k
boundary. The indexer's stable top-k (``kernels.reference.topk``) breaks them by the lowest entry id on the
cache's ``max_len // 4``-entry rows as on the full forward's, so the cached path must match the full
forward there too (with ``torch.topk`` it does not: ties broke differently for rows of different lengths).

Four prompts of 3, 120, 131 and 62 tokens, right-padded into one prefill, then 14 teacher-forced decode
steps: the ring of the 131-token prompt has wrapped in prefill, the 120-token one completes its first HCA
block while decoding, every row completes CSA blocks while decoding, and the indexer truncates (more than
8 entries visible) on the long rows.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference.decode import decode_step, prefill
from kernels.reference.moe import routing_hook

from tests.reference.tiny_models import RouteRecorder, tiny_reference_model

LENGTHS = (3, 120, 131, 62)
STEPS = 14
RTOL = 1e-5          # max |cached - full| / max |full| per position (fp32)


@pytest.fixture(scope="module")
def model():
    return tiny_reference_model()


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 1024, (L + STEPS,), generator=g) for L in LENGTHS]


def _cached_run(model, seqs):
    """Prefill the prompts, then feed the sequences' next tokens: logits per step, routing, fed positions."""
    fed = []
    hook = model.embed.register_forward_hook(lambda mod, args, out: fed.append(args[0].numel()))
    routes = RouteRecorder()
    try:
        with torch.no_grad(), routing_hook(routes):
            cache, logits = prefill(model, [s[:L].tolist() for s, L in zip(seqs, LENGTHS)],
                                    max_len=max(LENGTHS) + STEPS)
            out = [logits]
            for t in range(STEPS - 1):
                out.append(decode_step(model, cache, torch.stack([s[L + t] for s, L in zip(seqs, LENGTHS)])))
    finally:
        hook.remove()
    return out, routes, fed, cache


@pytest.fixture(scope="module")
def cached(model, seqs):
    return _cached_run(model, seqs)


def test_cached_logits_equal_the_full_forward_at_every_position(model, seqs, cached):
    logits = cached[0]
    with torch.no_grad():
        for b, (s, L) in enumerate(zip(seqs, LENGTHS)):
            full = model(s[None, : L + STEPS - 1])[0]
            for t in range(STEPS):
                want = full[L - 1 + t]
                err = float((logits[t][b] - want).abs().max() / want.abs().max())
                assert err <= RTOL, (L, t, err)


def test_cached_routing_equals_the_full_forwards(model, seqs, cached):
    """Every token's learned-routing experts, recorded when it is fed (prompt in prefill, each new token in
    its decode step), equal the full forward's for that position; hash layers never reach the seam."""
    routes = cached[1]
    c = model.config
    learned = [i for i in range(c.n_layers) if not c.is_hash_layer(i)]
    assert sorted(routes.calls) == learned
    for b, (s, L) in enumerate(zip(seqs, LENGTHS)):
        full = RouteRecorder()
        with torch.no_grad(), routing_hook(full):
            model.hidden_streams(s[None, : L + STEPS - 1])
        for layer in learned:
            want = full.calls[layer][0]                               # [L + STEPS - 1, k]
            prompt = routes.calls[layer][0].view(len(LENGTHS), -1, c.n_activated_experts)[b, :L]
            steps = torch.stack([r[b] for r in routes.calls[layer][1:]])
            got = torch.cat((prompt, steps))
            assert torch.equal(got.sort(-1).values, want.sort(-1).values), (L, layer)


def test_no_prefix_is_recomputed(cached):
    """The embedding sees each prompt position once (one padded prefill) and then one token per row per step."""
    fed, cache = cached[2], cached[3]
    assert fed == [len(LENGTHS) * max(LENGTHS)] + [len(LENGTHS)] * (STEPS - 1)
    assert cache.pos.tolist() == [L + STEPS - 1 for L in LENGTHS]


def test_select_copies_and_drops_rows(model, seqs):
    """A cache row copied to several rows (one prompt's samples) decodes like the original; dropping rows
    (finished samples) leaves the others unchanged."""
    with torch.no_grad():
        cache, _ = prefill(model, [seqs[0][:5].tolist(), seqs[3][:40].tolist()], max_len=48)
        many = cache.select([1, 0, 1])
        tok = torch.tensor([seqs[3][40], seqs[0][5], seqs[3][40]])
        a = decode_step(model, many, tok)
        assert torch.equal(a[0], a[2])
        b = decode_step(model, cache.select([1]), tok[:1])
        assert (a[0] - b[0]).abs().max() <= RTOL * b[0].abs().max()
        kept = many.select([1])                                   # rows 0 and 2 finished
        c = decode_step(model, kept, torch.tensor([seqs[0][6]]))
        full = model(seqs[0][None, :7])[0, -1]
        assert (c[0] - full).abs().max() <= RTOL * full.abs().max()
        assert kept.pos.tolist() == [7]


def test_bad_calls_are_refused(model):
    with pytest.raises(ValueError, match="longest prompt"):
        prefill(model, [[2, 3, 4]], max_len=2)
    with pytest.raises(ValueError, match="at least one token"):
        prefill(model, [[2], []], max_len=4)
    with torch.no_grad():
        cache, _ = prefill(model, [[2, 3]], max_len=3)
        decode_step(model, cache, torch.tensor([5]))
        with pytest.raises(ValueError, match="full"):
            decode_step(model, cache, torch.tensor([6]))
        with pytest.raises(ValueError, match="one per row"):
            decode_step(model, cache.select([0, 0]), torch.tensor([6]))
