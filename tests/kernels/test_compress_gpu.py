"""The triton ``compressor_step`` (``kernels/triton/compress.py``): a compressor's decode step after its GEMMs in
one kernel, against the torch code it replaces (``kernels.reference.slots._compress_masked`` with the reference
ops): the same slots, previous slots and entries, the entries within a rounding step of their dtype. With no GPU,
``TRITON_INTERPRET=1`` runs it on small shapes; otherwise it skips."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


def _case(m, c, rotate, B, N, first, dt, dev, seed):
    from kernels.reference.compressor import Compressor
    from kernels.reference.decode import CompressorCache
    from kernels.reference.rope import rope_inv_freq

    g = torch.Generator().manual_seed(seed)
    d, rope = 64, min(64, c)
    comp = Compressor(d, c, rope, m, rotate=rotate)
    kc = 2 * c if comp.overlap else c
    with torch.no_grad():
        for p in (comp.wkv.weight, comp.wgate.weight):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        comp.ape.copy_(torch.randn(m, kc, generator=g))
        comp.norm.weight.copy_(1 + 0.1 * torch.randn(c, generator=g))
    comp = comp.to(dev)
    comp.wkv.weight.data, comp.wgate.weight.data = comp.wkv.weight.data.to(dt), comp.wgate.weight.data.to(dt)
    prev_z = torch.randn(B, m, c, generator=g)
    prev_z[0] = float("-inf")                              # row 0 completes block 0: no previous block
    cc = CompressorCache(torch.randn(B, m, kc, generator=g), torch.randn(B, m, kc, generator=g),
                         torch.randn(B, m, c, generator=g) if comp.overlap else None,
                         prev_z if comp.overlap else None, None)
    buf = torch.randn(B + 1, first + N, c, generator=g).to(dt)   # one spare row: the buffer is a slot cache's
    # row 0 completes block 0, row 1 the last block, row 2 a middle one, rows 3+ complete nothing
    pos = torch.tensor([m - 1, N * m - 1, 2 * m - 1, 0, m, 3 * m + m // 2 - 1])
    x = torch.randn(B, 1, d, generator=g).to(dt)
    inv_freq = rope_inv_freq(rope, 160000.0).to(dev)
    return comp, cc, buf, pos, x, inv_freq


def _run(comp, cc, buf, pos, x, inv_freq, first, dev, ops):
    from dataclasses import replace

    from kernels.reference.slots import _compress_masked

    cc = replace(cc, **{k: (None if v is None else v.clone().to(dev)) for k, v in vars(cc).items()})
    buf = buf.clone().to(dev)
    comp.ops = ops
    with torch.no_grad():
        _compress_masked(comp, x.to(dev), cc, pos.to(dev), inv_freq, {"max_len": 64 * comp.ratio},
                         (buf, first))
    return cc, buf


@pytest.mark.parametrize("m,c,rotate,first", [(4, 64, False, 8), (4, 32, True, 0), (8, 64, False, 3),
                                              (128, 128, False, 2)])
def test_the_kernel_is_the_torch_step(m, c, rotate, first):
    """CSA's overlapping compressor (``m = 4``, with and without the indexer's rotation), HCA-like ones (``m = 8``
    and ``128``), entries after a window's ``first`` rows: six rows, three completing a block (the first block,
    with no previous one; the last; a middle one), three not. The kernel ran (its op was called)."""
    from core.kernel_ops import OpTable
    from kernels.reference.backend import reference_functions
    from kernels.triton import compress

    dev = triton_device()
    dt = torch.float16 if dev == "cpu" else torch.bfloat16     # the interpreter truncates bf16 casts
    if dev == "cuda" and c < 128:
        c *= 4                                                  # the real sizes: 512 (attention) and 128 (indexer)
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return compress.compressor_step(*a, **k)

    comp, cc, buf, pos, x, inv_freq = _case(m, c, rotate, 6, 5, first, dt, dev, seed=m * c + first)
    want_cc, want = _run(comp, cc, buf, pos, x, inv_freq, first, dev, None)
    table = OpTable("triton", {**reference_functions(), "compressor_step": counted})
    got_cc, got = _run(comp, cc, buf, pos, x, inv_freq, first, dev, table)
    assert calls == [1]
    for name in ("a", "z", "prev_a", "prev_z"):
        w, h = getattr(want_cc, name), getattr(got_cc, name)
        if w is not None:
            assert torch.equal(w, h), name                    # copies and one fp32 sum: the same values
    step = torch.finfo(dt).eps
    done = (pos + 1) % m == 0
    assert done.sum() == 3
    tol = 2 * step * want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol
    assert torch.equal(got[:, :first], buf[:, :first].to(dev))    # the window's rows untouched
    untouched = ~done
    assert torch.equal(got[:6][untouched.to(dev)], buf[:6][untouched].to(dev))   # rows that completed nothing


def test_the_kernel_refuses_what_it_cannot_serve():
    """Slots of another dtype, entries of a width that is not a power of two, and previous slots of the wrong
    shape are refused with the reason."""
    from kernels.triton.compress import compressor_step

    dev = triton_device()
    B, m, c = 2, 4, 64
    f = dict(device=dev)
    args = dict(kv=torch.zeros(B, 2 * c, **f), gate=torch.zeros(B, 2 * c, **f), ape=torch.zeros(m, 2 * c, **f),
                a=torch.zeros(B, m, 2 * c, **f), z=torch.zeros(B, m, 2 * c, **f), prev_a=torch.zeros(B, m, c, **f),
                prev_z=torch.zeros(B, m, c, **f), pos=torch.zeros(B, dtype=torch.long, **f),
                out=torch.zeros(B, 4, c, dtype=torch.bfloat16, **f), first=0, norm_weight=torch.ones(c, **f),
                eps=1e-6, angles=torch.zeros(2, 4, 32, **f), rotate=False)
    for change, words in ((dict(a=torch.zeros(B, m, 2 * c, dtype=torch.float64, **f)), "a is torch.float64"),
                          (dict(out=torch.zeros(B, 4, 48, dtype=torch.bfloat16, **f)), "power of two"),
                          (dict(prev_a=torch.zeros(B, m, 2 * c, **f)), "previous slots")):
        with pytest.raises(ValueError, match=words):
            compressor_step(**{**args, **change})


@pytest.mark.parametrize("m,c,overlap,rotate", [(4, 512, True, False), (4, 128, True, True), (128, 512, False, False)])
def test_the_kernel_compiles_for_sm90(m, c, overlap, rotate):
    """The kernel at V4's three compressors (CSA's attention and indexer compressors, HCA's) compiles to PTX for
    sm_90 (H100/H200) with triton alone, no GPU (the interpreter runs code the compiler rejects)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import compress as K

    consts = dict(M=m, C=c, HALF=32, OVERLAP=overlap, ROTATE=rotate, LOG_C=c.bit_length() - 1, ROUND=True,
                  ROUNDED=True)
    sig = {**{n: "*fp32" for n in ("KV", "GATE", "APE", "A", "Z", "PA", "PZ")}, "POS": "*i64", "OUT": "*bf16",
           "NORM_W": "*fp32", "ANG": "*fp32", "eps": "fp32", "hadamard_scale": "fp32", "N": "i32", "first": "i32",
           "stride_ob": "i32", "NB": "i32", **{k: "constexpr" for k in consts}}
    compiled = compile(ASTSource(K._compress_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    assert ".entry" in compiled.asm["ptx"]
