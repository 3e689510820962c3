"""The triton ``decode_topk`` (``kernels/triton/topk.py``): a decode step's indexer picks in one launch, against the
torch contract (``kernels.reference.topk.decode_topk``: the entries below each row's limit, ``stable_topk``'s
rule): the same ids. Rows with many exact ties (the k-th largest value tied across the cut), ``-inf`` scores,
fewer counted entries than ``k``, no counted entry, ``k`` above the row's length, rows longer than a loop step,
negative and positive scores. With no GPU, ``TRITON_INTERPRET=1`` runs it; otherwise it skips."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [0, 8, 128])
@pytest.mark.parametrize("B,N,k,ratio", [(6, 40, 8, 4), (4, 2500, 512, 4), (3, 7, 16, 4), (5, 300, 300, 1)])
def test_the_kernel_picks_the_contracts_ids(B, N, k, ratio, window):
    """And with a ``window``: the attention's whole rows (the ring's written rows, then the picks past it)."""
    from kernels.reference.topk import decode_topk as ref
    from kernels.triton.topk import decode_topk

    dev = triton_device()
    g = torch.Generator().manual_seed(B * N + k)
    scores = torch.randn(B, N, generator=g)
    scores[0] = torch.round(scores[0] * 2) / 2                     # a handful of values: ties at the cut
    scores[1, ::3] = float("-inf")
    scores[2] = 0.0                                                # every entry tied
    pos = torch.randint(0, N * ratio, (B,), generator=g)
    pos[1] = N * ratio - 1                                         # every entry completed
    pos[-1] = 0 if ratio > 1 else pos[-1]                          # (ratio 4) no entry completed yet
    want = ref(scores, pos, ratio, k, window)
    got = decode_topk(scores.to(dev), pos.to(dev), ratio, k, window).cpu()
    assert got.dtype == torch.int64 and got.shape == want.shape == (B, window + min(k, N))
    assert torch.equal(got, want), (got, want)


def test_the_kernel_refuses_what_it_cannot_serve():
    from kernels.triton.topk import decode_topk

    dev = triton_device()
    with pytest.raises(ValueError, match="float32"):
        decode_topk(torch.zeros(2, 8, dtype=torch.float16, device=dev), torch.zeros(2, dtype=torch.long, device=dev),
                    4, 2)
    with pytest.raises(ValueError, match="int64 pos"):
        decode_topk(torch.zeros(2, 8, device=dev), torch.zeros(2, dtype=torch.int32, device=dev), 4, 2)


def test_the_kernel_compiles_for_sm90():
    """The kernel compiles to PTX for sm_90 (H100/H200) with triton alone, no GPU."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import topk as K

    sig = {"SCORES": "*fp32", "POS": "*i64", "OUT": "*i64", "N": "i32", "K": "i32", "ratio": "i32", "W": "i32",
           "BLOCK": "constexpr"}
    compiled = compile(ASTSource(K._decode_topk_kernel, sig, dict(BLOCK=K.BLOCK)), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    assert ".entry" in compiled.asm["ptx"]


@pytest.mark.parametrize("window,ratio,entries", [(128, 0, 0), (8, 0, 0), (128, 128, 40), (8, 4, 2500), (0, 2, 5)])
def test_attention_rows_are_the_contracts(window, ratio, entries):
    """``attention_rows``: a window layer's rows (the ring rows written) and an HCA layer's (then every entry
    completed), the torch contract's ids (``kernels.reference.topk.attention_rows``) at positions before the ring
    is full, at its edge, past it, and with more entries than a loop step."""
    from kernels.reference.topk import attention_rows as ref
    from kernels.triton.topk import attention_rows

    dev = triton_device()
    top = max(window, (entries + 1) * max(ratio, 1)) + 3
    pos = torch.tensor([0, 1, max(window - 1, 0), window, top // 2, top], dtype=torch.long)
    want = ref(pos, window, ratio, entries)
    got = attention_rows(pos.to(dev), window, ratio, entries).cpu()
    assert got.dtype == torch.int64 and got.shape == want.shape == (6, window + entries)
    assert torch.equal(got, want), (got, want)


def test_attention_rows_refuse_what_they_cannot_serve():
    from kernels.triton.topk import attention_rows

    dev = triton_device()
    with pytest.raises(ValueError, match="int64 pos"):
        attention_rows(torch.zeros(2, dtype=torch.int32, device=dev), 8)
    with pytest.raises(ValueError, match="ratio >= 1 with entries"):
        attention_rows(torch.zeros(2, dtype=torch.long, device=dev), 8, 0, 4)


def test_attention_rows_compile_for_sm90():
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import topk as K

    sig = {"POS": "*i64", "OUT": "*i64", "W": "i32", "N": "i32", "ratio": "i32", "BLOCK": "constexpr"}
    compiled = compile(ASTSource(K._attention_rows_kernel, sig, dict(BLOCK=K.BLOCK)),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert ".entry" in compiled.asm["ptx"]
