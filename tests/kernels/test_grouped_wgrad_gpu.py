"""The routed experts' weight-gradient kernel (``kernels/triton/grouped_wgrad.py``: ``main[e] (+)= g[rows_e]^T @
x[rows_e]`` summed in fp32 into the fp32 buffer) against an fp64 reference, per expert.

Tolerance: a product of two bf16 numbers is exact in fp32, so the kernel and the fp64 reference differ only in how
the fp32 sum of an expert's products is rounded. Each rounding is within 2^-24 of a partial sum, and a partial sum is
at most ``S = sum_k |g[k, o] x[k, i]|``; the tensor cores add each 16-product MMA into the accumulator, so an expert
of n rows rounds about n/16 times. A few thousand rows give a worst case of a few 1e-5 S; the errors have random
signs, so the test holds the kernel to ``1e-5 * S`` (about 170 rounding steps), plus ``1e-5 |main|`` for the one
fp32 addition into the buffer when accumulating. Under ``TRITON_INTERPRET=1`` (no GPU) the small cases run on the
CPU; the Flash-shaped ones (E 32; w1 O 4096, I 4096; w2 O 4096, I 2048; 24576 and 49152 routed rows spread
unevenly, some experts empty) need a GPU. Each test asks ``triton_device()`` before it imports the kernel, so it
skips (with the reason) where triton or a GPU is missing.
"""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu

TOL = 1e-5
FLASH = {"w1": (4096, 4096), "w2": (4096, 2048)}


def uneven_counts(E: int, N: int, empty, seed: int) -> torch.Tensor:
    """``N`` rows over ``E`` experts, unevenly (softmax of random logits), none for the experts in ``empty``."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(E, generator=gen), 0)
    probs[list(empty)] = 0
    picks = torch.multinomial(probs, N, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=E)


def inputs(counts, O: int, I: int, extra_rows: int, dev: str, seed: int, ends_dtype=torch.int32):
    """``x [N, I]``, ``g [N, O]`` (bf16; the ``extra_rows`` past ``ends[-1]`` are NaN: no expert reads them),
    ``ends [E]`` and a random fp32 ``main [E, O, I]``."""
    gen = torch.Generator().manual_seed(seed)
    n = int(counts.sum())
    x = (torch.randn(n + extra_rows, I, generator=gen) * 2).bfloat16()
    g = torch.randn(n + extra_rows, O, generator=gen).bfloat16()
    x[n:], g[n:] = float("nan"), float("nan")
    main = torch.randn(len(counts), O, I, generator=gen)
    ends = counts.cumsum(0).to(ends_dtype)
    return main.to(dev), x.to(dev), g.to(dev), ends.to(dev)


def check_against_fp64(main, before, x, g, ends, accumulate: bool, what: str):
    """Every expert's block of ``main`` within the tolerance (module docstring) of the fp64 reference; an expert
    with no rows bit for bit unchanged (accumulate) or zero (overwrite)."""
    bounds = [0] + ends.tolist()
    worst = 0.0
    for e in range(main.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if t == s:
            if accumulate:
                assert torch.equal(main[e].view(torch.int32), before[e].view(torch.int32)), f"{what}: expert {e}"
            else:
                assert torch.equal(main[e], torch.zeros_like(main[e])), f"{what}: expert {e} not zeroed"
            continue
        gs, xs = g[s:t].double(), x[s:t].double()
        want = gs.T @ xs
        scale = gs.abs().T @ xs.abs()
        if accumulate:
            want += before[e].double()
            scale += before[e].double().abs()
        rel = ((main[e].double() - want).abs() / (scale + 1e-300)).max().item()
        worst = max(worst, rel)
        assert rel <= TOL, f"{what}: expert {e} ({t - s} rows) off by {rel:.2e} of sum |g x|"
    print(f"{what}: worst error {worst:.2e} of sum |g x| (tolerance {TOL:.0e})")


SMALL = [  # (O, I, counts, rows past ends[-1])
    (64, 64, [37, 0, 81, 5], 9),
    (96, 200, [0, 64, 0, 33], 0),
    (200, 96, [1, 130, 0, 7, 66], 3),
    (1, 3, [2, 0, 5], 1),
    (72, 136, [0, 0, 0], 4),
]


@pytest.mark.parametrize("O,I,counts,extra", SMALL, ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
@pytest.mark.parametrize("ends_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_small_odd_shapes_match_fp64(O, I, counts, extra, accumulate, ends_dtype):
    dev = triton_device()
    from kernels.triton.grouped_wgrad import grouped_wgrad_into
    main, x, g, ends = inputs(torch.tensor(counts), O, I, extra, dev, seed=O * I, ends_dtype=ends_dtype)
    before = main.clone()
    assert grouped_wgrad_into(main, x, g, ends, accumulate) is None
    check_against_fp64(main, before, x, g, ends, accumulate, f"O={O} I={I} counts={counts}")


@pytest.mark.parametrize("config", [dict(BLOCK_O=128, BLOCK_I=256, BLOCK_K=64, num_warps=8, num_stages=3),
                                    dict(BLOCK_O=128, BLOCK_I=128, BLOCK_K=64, num_warps=8, num_stages=4),
                                    dict(BLOCK_O=32, BLOCK_I=64, BLOCK_K=16, num_warps=4, num_stages=2)],
                         ids=["flash-tile", "square-tile", "narrow-tile"])
def test_other_launch_settings_on_row_sliced_views(config):
    """Large tiles (the first is the Flash shapes' default) on a shape they do not divide, and the row strides of
    column slices."""
    dev = triton_device()
    from kernels.triton.grouped_wgrad import grouped_wgrad_into
    counts, O, I = torch.tensor([70, 0, 100]), 200, 136
    main, x, g, ends = inputs(counts, O + 24, I + 8, 5, dev, seed=1)
    x, g, main = x[:, 8:], g[:, :O], main[:, :O, 8:].contiguous()
    before = main.clone()
    grouped_wgrad_into(main, x, g, ends, True, config=config)
    check_against_fp64(main, before, x, g, ends, True, f"row-sliced views, {config}")


def test_an_empty_expert_is_zeroed_by_overwrite_and_kept_by_accumulate():
    dev = triton_device()
    from kernels.triton.grouped_wgrad import grouped_wgrad_into
    main, x, g, ends = inputs(torch.tensor([0, 40, 0, 25]), 64, 96, 2, dev, seed=2)
    main[0] = -0.0                                          # kept with its sign: the buffer is not rewritten
    main[2] = float("nan")
    before = main.clone()
    grouped_wgrad_into(main, x, g, ends, True)
    for e in (0, 2):
        assert torch.equal(main[e].view(torch.int32), before[e].view(torch.int32))
    grouped_wgrad_into(main, x, g, ends, False)
    for e in (0, 2):
        assert torch.equal(main[e], torch.zeros_like(main[e])) and not main[e].signbit().any()


def test_no_rows_at_all():
    dev = triton_device()
    from kernels.triton.grouped_wgrad import grouped_wgrad_into
    main, x, g, ends = inputs(torch.tensor([0, 0]), 16, 24, 0, dev, seed=3)
    before = main.clone()
    grouped_wgrad_into(main, x, g, ends, True)
    assert torch.equal(main, before)
    grouped_wgrad_into(main, x, g, ends, False)
    assert not main.any()


@pytest.mark.parametrize("rows", [4096 * 6, 8192 * 6])
@pytest.mark.parametrize("weight", sorted(FLASH))
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
def test_flash_shapes_match_fp64(weight, rows, accumulate):
    dev = triton_device()
    from kernels.triton.grouped_wgrad import grouped_wgrad_into
    if dev != "cuda":
        pytest.skip("Flash-shaped: too large for Triton's CPU interpreter")
    O, I = FLASH[weight]
    counts = uneven_counts(32, rows, empty=(0, 13, 31), seed=rows)
    main, x, g, ends = inputs(counts, O, I, 0, dev, seed=rows + O + I)
    before = main.clone()
    grouped_wgrad_into(main, x, g, ends, accumulate)
    check_against_fp64(main, before, x, g, ends, accumulate, f"{weight} O={O} I={I} rows={rows}")


def test_refusals_name_the_reason():
    dev = triton_device()
    from kernels.triton.grouped_wgrad import grouped_wgrad_into, grouped_wgrad_refusal
    main, x, g, ends = inputs(torch.tensor([3, 5]), 16, 24, 0, dev, seed=4)
    assert grouped_wgrad_refusal(main, x, g, ends) == ""
    cases = [
        ((main, x.float(), g, ends), "bf16 x and g"),
        ((main.bfloat16(), x, g, ends), "fp32 buffer"),
        ((main[:, :, :8], x, g, ends), "do not match"),
        ((main, x, g[:5], ends), "do not match"),
        ((main, x, g, ends[:1]), "do not match"),
        ((main, x, g, ends.float()), "int32 or int64"),
        ((main.transpose(1, 2).contiguous().transpose(1, 2), x, g, ends), "not contiguous"),
        ((main, x.t().contiguous().t(), g, ends), "column stride"),
        ((main, x[None], g, ends), "shapes"),
    ]
    for args, reason in cases:
        assert reason in grouped_wgrad_refusal(*args), reason
        with pytest.raises(ValueError, match=reason):
            grouped_wgrad_into(*args, accumulate=False)
