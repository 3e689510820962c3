"""Token counts do not recompile the triton kernels of a training step (``do_not_specialize``): a GRPO step whose
micro-batch first had a token count off a multiple of 16 compiled four kernels (the indexer's and the weighted RMS
norm's backward, two specializations each) and took 3.2 s against 0.93 (one H200, Flash-shaped,
``triton_compiles`` in ``bench/results/grpo-h200-flash-shaped-compiles-128.json``). Here each kernel runs at a
first count, then at counts of other divisibility (odd, 1, a multiple of 16), and those runs compile nothing
(``reporting.kernel_compiles.counted``). Needs a CUDA GPU (the interpreter compiles nothing)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _cuda():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return "cuda"


def _runs(fn, counts):
    """``fn(n)`` at each of ``counts``; the Triton compiles of all but the first."""
    from reporting.kernel_compiles import counted

    fn(counts[0])
    torch.cuda.synchronize()
    with counted() as c:
        for n in counts[1:]:
            fn(n)
        torch.cuda.synchronize()
    return c.names


COUNTS = [40, 37, 1, 64, 129]


def test_norms_rope_swiglu_hadamard_take_any_count():
    from kernels.triton import hadamard, norm, rope, swiglu

    dev = _cuda()
    d = 512

    def step(n):
        x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d, device=dev)
        norm.rms_norm_bwd_launch(x, w, x, 1e-6)
        norm.rms_norm_launch(x, w, 1e-6)
        norm.rms_normalize_bwd_launch(x, x, 1e-6)
        norm.rms_normalize_launch(x, 1e-6, torch.bfloat16)
        cos = torch.randn(n, 32, device=dev)
        rope.rope_launch(x[:, :64].contiguous(), cos, cos, 1, False)
        h = torch.randn(n, 2 * d, device=dev, dtype=torch.bfloat16)
        g = torch.rand(n, device=dev)
        swiglu.weighted_swiglu_launch(h, g, 10.0, torch.bfloat16)
        swiglu.weighted_swiglu_bwd_launch(h, g, x, 10.0)
        hadamard.hadamard_launch(x[:, :128].contiguous())

    assert _runs(step, COUNTS) == []


def test_the_indexer_takes_any_count_of_queries_and_keys():
    from kernels.triton import indexer

    dev = _cuda()

    def step(n):
        q = torch.randn(n, 64, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n + 3, 128, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, 64, device=dev)
        indexer.indexer_scores_launch(q, k, w, None, None)

    assert _runs(step, COUNTS) == []
