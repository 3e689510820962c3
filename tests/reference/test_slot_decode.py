"""The static-slot decode step (``kernels.reference.slots``) against the dynamic one (``decode.decode_step``).

Same model as tests/reference/test_decode.py (tiny preset, fp32, non-trivial sinks / ape / mHC bases, its 4
indexer heads: exact score ties at the top-k boundary, broken by the stable top-k's lowest-id rule). Three prompts of 3, 120 and 62 tokens are prefilled
once; the dynamic path decodes them as one batch, the static path from slots 4, 0 and 2 of six (slots 1, 3
and 5 are inactive: they hold zeros and must not disturb the others or advance), teacher-forced for 12 steps
(the 120-token row completes an HCA block, every row completes CSA blocks while decoding). The prompt of 3
tokens is retired after 5 steps on both paths. Logits, next-token log-probabilities, greedy tokens and the
learned-routing experts must agree (fp32: |d logp| <= 1e-5). The same holds for the step's device work
(``static_step_body``) traced by ``torch.compile(fullgraph=True)`` as the rollout engine's ``compile`` option
does (the ``eager`` backend here: dynamo's trace and guards without code generation), so the reference step
has no graph break (no host sync, nothing dynamo cannot trace).
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference.decode import decode_step, prefill
from kernels.reference.moe import routing_hook
from kernels.reference.slots import (SlotCache, moe_decode, stack_expert_weights, static_decode_step,
                                     static_step_body, static_step_checks)

from tests.reference.tiny_models import RouteRecorder, tiny_reference_model

LENGTHS = (3, 120, 62)
SLOTS = (4, 0, 2)
STEPS = 12
RETIRE = 5            # row 0 stops being fed after this many decode steps
ATOL = 1e-5


def _model(dtype=torch.float32):
    return tiny_reference_model(dtype).requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    m = _model()
    stack_expert_weights(m)
    return m


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 1024, (L + STEPS,), generator=g) for L in LENGTHS]


def _compiled_step():
    body = torch.compile(static_step_body, backend="eager", dynamic=False, fullgraph=True)
    return lambda model, cache, tokens, active: body(model, cache, tokens, active,
                                                     static_step_checks(model, tokens))


@pytest.mark.parametrize("compiled", [False, True])
def test_static_slots_equal_the_dynamic_step(model, seqs, compiled):
    c = model.config
    step = _compiled_step() if compiled else static_decode_step
    learned = [i for i in range(c.n_layers) if not c.is_hash_layer(i)]
    max_len = max(LENGTHS) + STEPS
    with torch.no_grad():
        dyn, logits0 = prefill(model, [s[:L].tolist() for s, L in zip(seqs, LENGTHS)], max_len=max_len)
        slots = SlotCache.like(dyn, 6)
        slots.load(SLOTS, dyn, range(len(LENGTHS)))
        rows = list(range(len(LENGTHS)))
        for t in range(STEPS - 1):
            if t == RETIRE:                                   # row 0 finished: it leaves the dynamic batch
                dyn, rows = dyn.select([1, 2]), [1, 2]
            fed = torch.stack([seqs[r][LENGTHS[r] + t] for r in rows])
            routes = RouteRecorder()
            with routing_hook(routes):
                want = decode_step(model, dyn, fed)
            tokens = torch.zeros(6, dtype=torch.long)
            active = torch.zeros(6, dtype=torch.bool)
            for r, tok in zip(rows, fed):
                tokens[SLOTS[r]], active[SLOTS[r]] = tok, True
            got, got_routes = step(model, slots, tokens, active)
            pick = torch.tensor([SLOTS[r] for r in rows])
            got = got[pick]
            nxt = torch.stack([seqs[r][LENGTHS[r] + t + 1] for r in rows])[:, None]
            lp_got = torch.log_softmax(got, -1).gather(-1, nxt)
            lp_want = torch.log_softmax(want, -1).gather(-1, nxt)
            assert float((lp_got - lp_want).abs().max()) <= ATOL, t
            assert float((got - want).abs().max() / want.abs().max()) <= ATOL, t
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            assert torch.equal(got_routes[pick], torch.stack([routes.calls[i][0] for i in learned], 1)), t
        assert slots.pos[list(SLOTS)].tolist() == [LENGTHS[0] + RETIRE] + [L + STEPS - 1 for L in LENGTHS[1:]]
        assert slots.pos[[1, 3, 5]].tolist() == [0, 0, 0]                  # inactive slots never advanced
    del logits0


def test_the_eager_step_shares_its_layers_position_work(model, seqs):
    """The eager step's layers share what the positions give them (``decode.step_once``: the ring slots, the
    window mask, the angles of each set of RoPE frequencies, a compressor ratio's blocks): fewer ops than layers
    that compute their own (what a compiled layer does), and the same outputs bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels.reference.slots import StepRegions, decode_layer

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += func.overloadpacket.__name__ in ("arange", "remainder", "cos", "sin", "floor_divide")
            return func(*args, **(kwargs or {}))

    def own(*args):                      # a layer without the step's memo, as a compiled layer runs
        return decode_layer(*args)

    with torch.no_grad():
        dyn, _ = prefill(model, [s[:L].tolist() for s, L in zip(seqs, LENGTHS)], max_len=max(LENGTHS) + STEPS)
    tokens, active = torch.tensor([5, 6, 7]), torch.ones(3, dtype=torch.bool)
    outs, counts = [], []
    for regions in (None, StepRegions(layer=own)):
        slots = SlotCache.like(dyn, 3)
        slots.load([0, 1, 2], dyn, [0, 1, 2])
        paths = static_step_checks(model, tokens)
        with Count() as c:
            outs.append(static_step_body(model, slots, tokens, active, paths, **({} if regions is None else
                                                                                 dict(regions=regions))))
        counts.append(c.ops)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert counts[0] < counts[1], counts


def test_the_attention_reads_the_layers_buffer_without_a_copy(model, seqs):
    """On a compressed layer the window ring and the compressor's entries are one buffer (``LayerCache.window``
    ``[B, W + N, D]``): the step's sparse attention is handed that buffer itself, not a concatenation made per
    step (a copy of every row's cache that grows with the context)."""
    from core.kernel_ops import OpTable
    from kernels.reference.attention import sparse_attention_with_sink
    from kernels.reference.backend import reference_functions
    from kernels.reference.model import ops_in_use

    seen = []

    def attend(q, kv, idx, sink, scale):
        seen.append(kv.data_ptr())
        return sparse_attention_with_sink(q, kv, idx, sink, scale)

    table = OpTable("test", {**reference_functions(), "sparse_attention_with_sink": attend})
    with torch.no_grad():
        dyn, _ = prefill(model, [s[:L].tolist() for s, L in zip(seqs, LENGTHS)], max_len=max(LENGTHS) + STEPS)
        slots = SlotCache.like(dyn, 3)
        slots.load([0, 1, 2], dyn, [0, 1, 2])
        with ops_in_use(model, table):
            static_decode_step(model, slots, torch.tensor([5, 6, 7]), torch.ones(3, dtype=torch.bool))
    c = model.config
    for lc, ratio in zip(slots.layers, c.compress_ratios[:c.n_layers]):
        want = c.window_size + (slots.max_len // ratio if ratio else 0)
        assert lc.window.shape[1] == want and (lc.compressor is None or lc.compressor.entries is None)
    assert seen == [lc.window.data_ptr() for lc in slots.layers]


def test_grouped_moe_equals_dense_and_the_reference_moe():
    """The two sync-free MoE paths against ``MoE.forward`` (bf16: the grouped path's dtype; runs on the CPU
    build of ``torch._grouped_mm``)."""
    m = _model(torch.bfloat16)
    stack_expert_weights(m)
    moe = m.layers[3].ffn                                   # a learned-routing layer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1, m.config.dim, generator=g).to(torch.bfloat16)
    ids = torch.randint(2, 1024, (16, 1), generator=g)
    with torch.no_grad():
        want = moe(x, ids).float()
        for path in ("grouped", "dense"):
            got, idx = moe_decode(moe, x, ids, path)
            assert idx.shape == (16, m.config.n_activated_experts)
            err = float((got.float() - want).abs().max() / want.abs().max())
            assert err <= 1e-2, (path, err)                 # bf16 rounding of differently ordered sums


@pytest.mark.parametrize("ids", [[], [3], [2, 0, 2, 2, 5, 0, 7, 7, 1], [4] * 9, "random"])
def test_the_counted_expert_order_is_the_stable_sort(ids):
    """``expert_order`` (the grouped MoE's pairs in expert order, counted) against ``argsort(stable=True)`` and the
    sorted ids' end rows, with empty experts (first, middle, last), one expert for all, no pairs, and a decode
    step's 64 tokens x top-6 of 32 experts; and under ``torch.compile`` (the compiled decode step traces it)."""
    from kernels.reference.slots import expert_order

    E = 8 if ids != "random" else 32
    flat = (torch.randint(0, E, (384,), generator=torch.Generator().manual_seed(1)) if ids == "random"
            else torch.tensor(ids, dtype=torch.long))
    want = flat.argsort(stable=True)
    want_ends = torch.searchsorted(flat[want], torch.arange(E), right=True).to(torch.int32)
    for fn in (expert_order, torch.compile(expert_order, fullgraph=True, dynamic=False)):
        order, ends = fn(flat, E)
        assert torch.equal(order, want) and torch.equal(ends, want_ends), (order, want, ends, want_ends)
        assert ends.dtype == torch.int32


def test_unstacked_experts_and_routing_hooks_are_refused(seqs):
    m = _model()
    with torch.no_grad():
        dyn, _ = prefill(m, [seqs[0][:3].tolist()], max_len=8)
        slots = SlotCache.like(dyn, 1)
        with pytest.raises(RuntimeError, match="stack_expert_weights"):
            static_decode_step(m, slots, torch.tensor([5]), torch.tensor([True]))
        stack_expert_weights(m)
        with routing_hook(lambda layer, idx: idx), pytest.raises(RuntimeError, match="routing hook"):
            static_decode_step(m, slots, torch.tensor([5]), torch.tensor([True]))
        with pytest.raises(ValueError, match="max_len=8"):
            SlotCache.like(dyn, 1).load([0], prefill(m, [[2, 3]], max_len=9)[0], [0])
