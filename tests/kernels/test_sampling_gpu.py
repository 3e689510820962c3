"""The triton backend's sampler (``kernels/triton/sampling.py``) against its rule in torch
(``kernels.reference.sampling.draw_tokens``) and against the engine's torch sampler
(``rollout.reference_engine.sample_tokens`` at top-p 1: ``draw_index`` on ``exp(log_softmax)``).

Oracle: the same draws (token ids equal) and log-probabilities within a few fp32 steps, on rows of random logits
at three temperatures, vocabularies that are and are not a multiple of the block, the Flash vocabulary (129,280)
at one and 64 rows; rows whose tail has no mass (``-inf`` logits) with a uniform next to 1 and of 1, where the draw
must be the last token with mass. With no GPU, ``TRITON_INTERPRET=1`` runs the small shapes; otherwise they skip.
"""

import pytest
import torch

from kernels.reference.sampling import draw_tokens as reference

from ._backends import triton_device

pytestmark = pytest.mark.gpu
BLOCK = 1024

CASES = [
    pytest.param((8, 5000, 1.0), id="v5000-t1"),
    pytest.param((5, 1024, 0.7), id="one-block-t0.7"),
    pytest.param((6, 3001, 1.3), id="partial-block-t1.3"),
    pytest.param((1, 129280, 1.0), id="flash-vocab-one-row"),
    pytest.param((64, 129280, 1.0), id="flash-vocab-64-rows",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]


@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_rule_and_the_engines_torch_sampler(case):
    from kernels.triton.sampling import draw_tokens
    from rollout.reference_engine import SamplingParams, sample_tokens

    N, V, T = case
    g = torch.Generator().manual_seed(V + N)
    dev = triton_device()
    logits = (torch.randn(N, V, generator=g) * 3).to(dev)
    u = torch.rand(N, generator=g, dtype=torch.float64).to(dev)
    tok, lp = draw_tokens(logits, u, T, BLOCK)
    want_tok, want_lp = reference(logits, u, T, BLOCK)
    torch_tok, torch_lp = sample_tokens(logits, u, SamplingParams(temperature=T, max_new_tokens=1))
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    assert torch.equal(tok, want_tok) and torch.equal(tok, torch_tok)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(lp, torch_lp, rtol=0, atol=1e-5)


def test_a_target_at_the_end_draws_the_last_token_with_mass():
    from kernels.triton.sampling import draw_tokens

    dev = triton_device()
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(1))
    logits[0, 1500:] = float("-inf")           # the mass ends inside a block
    logits[1, 2048:] = float("-inf")           # ... at a block's end
    logits[2, :] = float("-inf")
    logits[2, 7] = 0.0                         # one token holds all of it
    for top in (1 - 2 ** -53, 1.0):            # 1.0: the target is the whole mass, past every running sum
        u = torch.tensor([top] * 3, dtype=torch.float64)
        tok, lp = draw_tokens(logits.to(dev), u.to(dev), 1.0, BLOCK)
        assert tok.tolist() == [1499, 2047, 7], top
        assert torch.equal(tok.cpu(), reference(logits, u, 1.0, BLOCK)[0])
        assert lp[2].item() == 0.0


def test_draw_tokens_refuses_what_it_cannot_serve():
    from kernels.triton.sampling import draw_tokens

    dev = triton_device()
    logits, u = torch.randn(2, 100, device=dev), torch.rand(2, dtype=torch.float64, device=dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        draw_tokens(logits.half(), u, 1.0, BLOCK)
    with pytest.raises(ValueError, match="float64 u"):
        draw_tokens(logits, u.float(), 1.0, BLOCK)
    with pytest.raises(ValueError, match="power-of-two block"):
        draw_tokens(logits, u, 1.0, 1000)


@pytest.mark.parametrize("scaled", [False, True])
def test_the_kernels_compile_for_sm90(scaled):
    """The three kernels compile to PTX for sm_90 (H100/H200) with triton alone, no GPU (the interpreter runs code
    the compiler rejects: the float64 running sums among them)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import sampling as K

    nbp = 128                                 # the Flash vocabulary's 127 blocks of 1,024
    kernels = [
        (K._block_stats_kernel, {"L": "*fp32", "M": "*fp32", "S": "*fp32", "temperature": "fp32", "V": "i32",
                                 "NB": "i32"}, dict(SCALED=scaled, B=BLOCK)),
        (K._block_mass_kernel, {"L": "*fp32", "M": "*fp32", "S": "*fp32", "LSE": "*fp32", "TOT": "*fp64",
                                "temperature": "fp32", "V": "i32", "NB": "i32"}, dict(SCALED=scaled, B=BLOCK, NBP=nbp)),
    ]
    draw = {"L": "*fp32", "LSE": "*fp32", "TOT": "*fp64", "U": "*fp64", "TOK": "*i64", "LP": "*fp32",
            "temperature": "fp32", "V": "i32", "NB": "i32", "IDS": "*i64", "TCUR": "*i64", "TOKENS": "*i64",
            "LOGPS": "*fp32", "LAST": "*i64", "ROWS": "*i64", "STEPS": "i32", "STOPS": "*i64", "NSTOPS": "i32",
            "FLAGS": "*i1"}
    kernels += [(K._draw_kernel, draw, dict(SCALED=scaled, B=BLOCK, NBP=nbp, RECORD=record))
                for record in (False, True)]
    for fn, sig, consts in kernels:
        compiled = compile(ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert ".entry" in compiled.asm["ptx"], fn.__name__


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_draw_record_is_the_draw_and_the_engines_records_of_it(T):
    """``draw_record``: the draws of ``draw_tokens`` at the uniforms ``u[ids, t + 1]``, ``t`` moved on in place,
    the token and log-probability written at ``[ids, t]``, the token at ``last[rows]``, the stop flags: what its
    torch contract (``kernels.reference.sampling.draw_record``) leaves, every tensor equal (the log-probabilities
    within fp32 steps of the torch ``lse``)."""
    from kernels.reference.sampling import draw_record as contract
    from kernels.triton.sampling import draw_record, draw_tokens

    dev = triton_device()
    g = torch.Generator().manual_seed(7)
    samples, steps, V = 5, 6, 3001
    logits = (torch.randn(3, V, generator=g) * 3).to(dev)
    u = torch.rand(samples, steps, generator=g, dtype=torch.float64).to(dev)
    ids, rows = torch.tensor([4, 0, 2], device=dev), torch.tensor([1, 3, 0], device=dev)
    t0 = torch.tensor([0, 3, 1], device=dev)
    drawn = draw_tokens(logits, u[ids, t0 + 1], T, BLOCK)[0]
    for stops in (drawn[1:2].clone(), torch.tensor([V + 1, int(drawn[0]), int(drawn[2])], device=dev),
                  torch.zeros(0, dtype=torch.long, device=dev)):
        state = [(t0.clone(), torch.full((samples, steps), -1, device=dev), torch.zeros(samples, steps, device=dev),
                  torch.full((4,), -1, device=dev)) for _ in range(2)]
        got = draw_record(logits, u, ids, *state[0][:3], state[0][3], rows, stops, T, BLOCK)
        want = contract(logits, u, ids, *state[1][:3], state[1][3], rows, stops, T, BLOCK)
        assert torch.equal(got[0], want[0]) and torch.equal(got[0], drawn)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
        assert got[2].dtype == torch.bool and torch.equal(got[2], want[2]), stops
        (t, tokens, logps, last), (wt, wtokens, wlogps, wlast) = state
        assert torch.equal(t, t0 + 1) and torch.equal(t, wt) and torch.equal(tokens, wtokens)
        assert torch.equal(last, wlast) and int((tokens >= 0).sum()) == 3 and last.tolist().count(-1) == 1
        torch.testing.assert_close(logps, wlogps, rtol=0, atol=1e-5)
    assert got[2].tolist() == [False] * 3 and want[2].tolist() == [False] * 3       # no stop ids: none stops


def test_the_engines_probe_compiles_the_draw_every_decode_step_runs():
    """The engine probes ``draw_record`` once at construction (``rollout.engine_ops.record_choice``: a row of the
    model's vocabulary at temperature 1 and another). A decode step's calls (Flash's 129,280 entries, 1 and 64
    rows, 48 steps, no stop ids or two, both temperatures) then run the kernels that probe compiled: no Triton
    compile in the middle of the first decode step (a fresh H100 took 7.1 ms a step in that call, 1.52 after,
    when the probe was a row of 2,049 entries: the blocks' count is a compile-time size). GPU only: the
    interpreter compiles nothing."""
    import triton.runtime.driver as driver

    from kernels.triton import sampling as KS
    from kernels.triton.backend import ops
    from rollout.engine_ops import record_choice

    dev = triton_device()
    if dev == "cpu":
        pytest.skip("the interpreter compiles nothing")
    samples, steps, V = 64, 48, 129280
    _, record, why = record_choice(ops(), torch.device(dev), BLOCK, V)
    assert record is not None, why
    device = driver.active.get_current_device()
    kernels = (KS._block_stats_kernel, KS._block_mass_kernel, KS._draw_kernel)
    compiled = [len(fn.device_caches[device][0]) for fn in kernels]
    g = torch.Generator().manual_seed(3)
    for rows, stops, temperature in ((1, torch.zeros(0, dtype=torch.long), 1.0), (64, torch.tensor([5, 7]), 0.8)):
        logits = torch.randn(rows, V, generator=g).to(dev)
        u = torch.rand(samples, steps, generator=g, dtype=torch.float64).to(dev)
        ids = torch.arange(rows, device=dev)
        record(logits, u, ids, torch.zeros(rows, dtype=torch.long, device=dev),
               torch.zeros(samples, steps, dtype=torch.long, device=dev), torch.zeros(samples, steps, device=dev),
               torch.zeros(rows, dtype=torch.long, device=dev), ids, stops.to(dev), temperature, BLOCK)
    torch.cuda.synchronize()
    assert [len(fn.device_caches[device][0]) for fn in kernels] == compiled


def test_draw_record_refuses_what_it_cannot_serve():
    from kernels.triton.sampling import draw_record

    dev = triton_device()
    logits, u = torch.zeros(2, 64, device=dev), torch.zeros(3, 4, dtype=torch.float64, device=dev)
    ids = t = rows = torch.zeros(2, dtype=torch.long, device=dev)
    tokens, logps = torch.zeros(3, 4, dtype=torch.long, device=dev), torch.zeros(3, 4, device=dev)
    last, stops = torch.zeros(2, dtype=torch.long, device=dev), torch.ones(1, dtype=torch.long, device=dev)
    with pytest.raises(ValueError, match="float64"):
        draw_record(logits, u.float(), ids, t, tokens, logps, last, rows, stops, 1.0, 16)
    with pytest.raises(ValueError, match="one int64 entry a row"):
        draw_record(logits, u, ids[:1], t, tokens, logps, last, rows, stops, 1.0, 16)
    with pytest.raises(ValueError, match="shaped like u"):
        draw_record(logits, u, ids, t, tokens.float(), logps, last, rows, stops, 1.0, 16)
    with pytest.raises(ValueError, match="stops: an int64 vector"):
        draw_record(logits, u, ids, t, tokens, logps, last, rows, stops.int(), 1.0, 16)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        draw_record(logits, u, ids, t, tokens, logps, last[::2], rows, stops, 1.0, 16)
