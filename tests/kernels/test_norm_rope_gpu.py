"""The triton ``norm_rope`` (``kernels/triton/norm_rope.py``): a decode step's query norm and rotation, and its
key's norm, rotation and write into the ring, one launch each, against the torch contract
(``kernels.reference.norm_rope.norm_rope``: the reference ``rms_normalize`` / ``rms_norm`` then ``apply_rope``):
within a rounding step of the dtype, the ring's other rows untouched. With no GPU, ``TRITON_INTERPRET=1`` runs it
on small shapes; otherwise it skips."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


def _angles(B, r, g, dev):
    ang = torch.rand(B, 1, r // 2, generator=g, dtype=torch.float64) * 100
    return ang.cos().float().to(dev), ang.sin().float().to(dev)


@pytest.mark.parametrize("B,H,D,r", [(3, 4, 64, 32), (5, 2, 128, 64), (1, 1, 32, 32)])
def test_the_query_is_the_torch_contract(B, H, D, r):
    from kernels.reference.norm_rope import norm_rope as ref
    from kernels.triton.norm_rope import norm_rope

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    if dev == "cuda":
        H, D = H * 16, D * 4                               # Flash's query: 64 heads of 512
    g = torch.Generator().manual_seed(B * H + D)
    q = (torch.randn(B, 1, H, D, generator=g) * 3).to(dt)
    cos, sin = _angles(B, r, g, dev)
    got = norm_rope(q.to(dev), None, 1e-6, cos, sin)
    want = ref(q, None, 1e-6, cos.cpu(), sin.cpu())
    assert got.dtype == dt and got.shape == q.shape
    assert (got.float().cpu() - want.float()).abs().max() <= 2 * torch.finfo(dt).eps * want.float().abs().max()


@pytest.mark.parametrize("B,D,W,r", [(4, 64, 8, 32), (2, 128, 16, 64)])
def test_the_key_goes_to_its_ring_slot(B, D, W, r):
    """Weighted norm, rotation, and row ``b`` written at ``pos[b] % W`` of slot ``b`` (positions before and past
    one turn of the ring); every other row of the buffer (the ring's and the compressed entries' after it, and a
    spare slot) untouched."""
    from kernels.reference.norm_rope import norm_rope as ref
    from kernels.triton.norm_rope import norm_rope

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(B * D + W)
    kv = (torch.randn(B, 1, D, generator=g) * 2).to(dt)
    w = 1 + 0.1 * torch.randn(D, generator=g)
    cos, sin = _angles(B, r, g, dev)
    ring = torch.randn(B + 1, W + 3, D, generator=g).to(dt)
    pos = torch.tensor([0, W + 3, 2 * W - 1, 5][:B])
    got, want = ring.clone().to(dev), ring.clone()
    assert norm_rope(kv.to(dev), w.to(dev), 1e-6, cos, sin, got, pos.to(dev), W) is None
    ref(kv, w, 1e-6, cos.cpu(), sin.cpu(), want, pos, W)
    written = torch.zeros(B + 1, W + 3, dtype=torch.bool)
    written[torch.arange(B), pos % W] = True
    assert torch.equal(got.cpu()[~written], ring[~written])
    tol = 2 * torch.finfo(dt).eps * want.float().abs().max()
    assert (got.float().cpu()[written] - want.float()[written]).abs().max() <= tol


def test_the_kernel_refuses_what_it_cannot_serve():
    from kernels.triton.norm_rope import norm_rope

    dev = triton_device()
    cos = sin = torch.zeros(2, 1, 8, device=dev)
    with pytest.raises(ValueError, match="power of two"):
        norm_rope(torch.zeros(2, 1, 48, dtype=torch.float16, device=dev), None, 1e-6, cos, sin)
    with pytest.raises(ValueError, match="one angle row"):
        norm_rope(torch.zeros(3, 1, 64, dtype=torch.float16, device=dev), None, 1e-6, cos, sin)
    with pytest.raises(ValueError, match="int64 pos"):
        norm_rope(torch.zeros(2, 1, 64, dtype=torch.float16, device=dev), None, 1e-6, cos, sin,
                  torch.zeros(2, 9, 64, dtype=torch.float16, device=dev), torch.zeros(2, dtype=torch.int32,
                                                                                   device=dev), 8)


@pytest.mark.parametrize("D,weighted,into", [(512, False, False), (512, True, True), (128, False, False)])
def test_the_kernel_compiles_for_sm90(D, weighted, into):
    """Flash's query (64 heads of 512, weightless) and key (weighted, into the ring), and a 128-wide row, compile to
    PTX for sm_90 with triton alone, no GPU."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import norm_rope as K

    consts = dict(D=D, HALF=32, BR=K.ELEMENTS_PER_PROGRAM // D, WEIGHTED=weighted, INTO=into, ROUNDED=True)
    sig = {"X": "*bf16", "W": "*fp32", "COS": "*fp32", "SIN": "*fp32", "OUT": "*bf16", "POS": "*i64", "R": "i32",
           "HEADS": "i32", "eps": "fp32", "stride_ob": "i32", "RING": "i32", **{k: "constexpr" for k in consts}}
    compiled = compile(ASTSource(K._norm_rope_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    assert ".entry" in compiled.asm["ptx"]
