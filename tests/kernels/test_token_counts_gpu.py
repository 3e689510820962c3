"""Token counts do not recompile the triton kernels of a training step (``do_not_specialize``): a GRPO step whose
micro-batch first had a token count off a multiple of 16 compiled four kernels (the indexer's and the weighted RMS
norm's backward, two specializations each) and took 3.2 s against 0.93 (one H200, Flash-shaped,
``triton_compiles`` in ``bench/results/grpo-h200-flash-shaped-compiles-128.json``).

The launchers size a program's row block by the count (its next power of two, capped), and the indexer takes its
few-query kernel below 16 queries: each block size and kernel compiles once, on purpose (a decode step's few rows
take a small block). So each kernel first runs at one count of every block size (the powers of two to 256: 1, and
multiples of 16 from 16 up), then at counts of other divisibility in the same blocks (odd, even, a multiple of 16
where the first was not), and those runs compile nothing (``reporting.kernel_compiles.counted``). An argument
derived from a count that Triton specializes (its value 1 or divisibility by 16) recompiles here. Needs a CUDA GPU
(the interpreter compiles nothing)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _cuda():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return "cuda"


def _runs(fn, warm, counts):
    """``fn(n)`` at each of ``warm``, then at each of ``counts``; the Triton compiles of the second runs."""
    from reporting.kernel_compiles import counted

    for n in warm:
        fn(n)
    torch.cuda.synchronize()
    with counted() as c:
        for n in counts:
            fn(n)
        torch.cuda.synchronize()
    return c.names


WARM = [1, 2, 4, 8, 16, 32, 64, 128, 256]     # one count of each row-block size the launchers pick
COUNTS = [3, 6, 13, 37, 45, 100, 129, 200, 255]   # the indexer's keys are count + 3: 13 and 45 give 16 and 48


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

    assert _runs(step, WARM, COUNTS) == []


def test_the_indexer_takes_any_count_of_queries_and_keys():
    from kernels.triton import indexer

    dev = _cuda()

    def step(n):
        q = torch.randn(n, 64, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n + 3, 128, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, 64, device=dev)
        indexer.indexer_scores_launch(q, k, w, None, None)

    assert _runs(step, WARM, COUNTS) == []
