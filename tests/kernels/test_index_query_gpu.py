"""The triton ``index_query`` (``kernels/triton/index_query.py``): the Lightning Indexer's decode query after its
GEMM (RoPE, the fp32 Hadamard transform, the cast) in one launch, against the torch contract
(``kernels.reference.index_query.index_query``): within a rounding step of the output dtype. With no GPU,
``TRITON_INTERPRET=1`` runs it; otherwise it skips."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B,H,D,r", [(3, 4, 128, 64), (2, 2, 32, 16), (5, 1, 64, 64)])
def test_the_query_is_the_torch_contract(B, H, D, r):
    from kernels.reference.index_query import index_query as ref
    from kernels.triton.index_query import index_query

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    if dev == "cuda":
        H *= 16                                              # Flash's indexer: 64 heads of 128
    g = torch.Generator().manual_seed(B * H + D)
    q = (torch.randn(B, 1, H, D, generator=g) * 2).to(dt)
    ang = torch.rand(B, 1, r // 2, generator=g, dtype=torch.float64) * 50
    cos, sin = ang.cos().float(), ang.sin().float()
    got = index_query(q.to(dev), cos.to(dev), sin.to(dev), dt).cpu()
    want = ref(q, cos, sin, dt)
    assert got.dtype == dt and got.shape == q.shape
    assert (got.float() - want.float()).abs().max() <= 2 * torch.finfo(dt).eps * want.float().abs().max()
    got32 = index_query(q.to(dev), cos.to(dev), sin.to(dev), torch.float32).cpu()
    want32 = ref(q, cos, sin, torch.float32)
    assert (got32 - want32).abs().max() <= 1e-5 * want32.abs().max()


def test_the_kernel_refuses_what_it_cannot_serve():
    from kernels.triton.index_query import index_query

    dev = triton_device()
    cos = sin = torch.zeros(2, 1, 8, device=dev)
    with pytest.raises(ValueError, match="power of two"):
        index_query(torch.zeros(2, 1, 4, 48, dtype=torch.float16, device=dev), cos, sin, torch.float16)
    with pytest.raises(ValueError, match="float32"):
        index_query(torch.zeros(2, 1, 4, 64, device=dev), cos, sin, torch.float16)


@pytest.mark.parametrize("D", [128, 512])
def test_the_kernel_compiles_for_sm90(D):
    """V4's indexer heads (128) and a wider row compile to PTX for sm_90 with triton alone, no GPU."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import index_query as K

    consts = dict(D=D, LOG_D=D.bit_length() - 1, HALF=32, ROUNDED=True)
    sig = {"Q": "*bf16", "COS": "*fp32", "SIN": "*fp32", "OUT": "*bf16", "R": "i32", "HEADS": "i32", "scale": "fp32",
           **{k: "constexpr" for k in consts}}
    compiled = compile(ASTSource(K._index_query_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=1 if D <= 256 else 4))
    assert ".entry" in compiled.asm["ptx"]
