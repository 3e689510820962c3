"""The triton ``attention_inverse_rope`` (``kernels/triton/attention.py``): a decode step's sparse attention with its
output rotated back in the kernel's epilogue, one launch where ``sparse_attention_with_sink`` and ``apply_rope(...,
inverse=True)`` were two. Checked against its torch contract (``kernels.reference.attention.attention_inverse_rope``)
within a rounding of the dtype, and against the two triton launches bit for bit: a window layer's rows (``-1``
before the ring is full), an HCA layer's (entries not completed yet ``-1``), a CSA-like row split over several
programs (the combine kernel's epilogue, a share whose rows are all ``-1``, a token with none), a rope width that is
not a power of two; the angles of positions up to past YaRN's original length. With no GPU, ``TRITON_INTERPRET=1``
runs them on small heads in fp16 (the interpreter multiplies bf16 tiles wrongly); the sm_90 compiles need triton
alone and no interpreter."""

import pytest
import torch

from ._backends import CountedLaunches, ptxas_report, spilled_bytes, triton_device

pytestmark = pytest.mark.gpu

# name: slots, window W, entries after the ring (HCA ratio), or random rows K (CSA-like), rope width
CASES = {
    "window": dict(B=3, W=16, ratio=0, entries=0, K=0, r=32),
    "hca": dict(B=2, W=16, ratio=4, entries=40, K=0, r=32),
    "split": dict(B=3, W=16, ratio=0, entries=0, K=400, r=32),
    "rope-24": dict(B=3, W=16, ratio=4, entries=8, K=0, r=24),
}
POSITIONS = [0, 5, 1000, 70000]           # before the ring is full, ..., past YaRN's original length (65536)


def _inputs(case, dev):
    """``(q, kv, indices, sink, scale, cos, sin)`` as ``kernels.reference.decode._attend`` passes them: the slots' query
    heads ``[B, 1, H, D]``, their caches ``[B, rows, D]``, int64 rows ``[B, 1, K]``, fp32 sink and angles."""
    from kernels.reference.rope import rope_cos_sin, rope_inv_freq
    from kernels.reference.topk import attention_rows

    c = CASES[case]
    B, W = c["B"], c["W"]
    H, D, dt = (20, 64, torch.float16) if dev == "cpu" else (64, 512, torch.bfloat16)
    g = torch.Generator().manual_seed(len(case))
    pos = torch.tensor(POSITIONS[:B], dtype=torch.long)
    if c["K"]:                                         # random rows, one share all -1, the first slot none
        rows = W + c["K"]
        idx = torch.randint(-1, rows, (B, c["K"]), generator=g)
        idx[1, 128:256] = -1
        idx[0] = -1
    else:
        rows = W + c["entries"]
        idx = attention_rows(pos, W, c["ratio"], c["entries"])
    q = torch.randn(B, 1, H, D, generator=g).to(dt)
    kv = torch.randn(B, rows, D, generator=g).to(dt)
    sink = torch.randn(H, generator=g)
    inv = rope_inv_freq(c["r"], 160000.0, 16.0, 65536, 32.0, 1.0)     # a compressed layer's YaRN angles
    cos, sin = rope_cos_sin(inv, pos[:, None], torch.float32)
    return [t.to(dev) for t in (q, kv, idx[:, None], sink)] + [D ** -0.5, cos.to(dev), sin.to(dev)]


@pytest.mark.parametrize("case", CASES)
def test_the_op_is_its_torch_contract(case):
    from kernels.reference.attention import attention_inverse_rope as ref
    from kernels.triton.attention import attention_inverse_rope

    args = _inputs(case, triton_device())
    got = attention_inverse_rope(*args)
    want = ref(*[a.cpu() if torch.is_tensor(a) else a for a in args])
    assert got.dtype == want.dtype and got.shape == want.shape == args[0].shape
    err = (got.cpu().float() - want.float()).abs().max().item()
    assert err <= 2 * torch.finfo(got.dtype).eps * want.float().abs().max().item(), err


@pytest.mark.parametrize("case", CASES)
def test_the_same_bits_as_the_attention_then_the_rope(case, monkeypatch):
    """The triton ``sparse_attention_with_sink`` then ``apply_rope(..., inverse=True)``, bit for bit, with no rope
    launch: one attention kernel, or the split one and its combine where the rows are split."""
    from kernels.triton import attention as A
    from kernels.triton import rope as R

    args = _inputs(case, triton_device())
    q, kv, idx, sink, scale, cos, sin = args
    want = R.apply_rope(A.sparse_attention_with_sink(q, kv, idx, sink, scale), cos, sin, inverse=True)
    counted = {n: CountedLaunches(getattr(A, n)) for n in ("_fwd_kernel", "_fwd_split_kernel", "_combine_kernel")}
    counted["_rope_kernel"] = CountedLaunches(R._rope_kernel)
    for name, k in counted.items():
        monkeypatch.setattr(R if name == "_rope_kernel" else A, name, k)
    got = A.attention_inverse_rope(*args)
    split = A.fwd_settings(q.shape[0], q.shape[2], idx.shape[-1])["SPLIT"] > 1
    assert split is (case == "split")
    assert {n: k.calls for n, k in counted.items()} == {"_fwd_kernel": int(not split), "_fwd_split_kernel": int(split),
                                                        "_combine_kernel": int(split), "_rope_kernel": 0}
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_it_refuses_what_it_cannot_serve():
    """One line each, with the reason: a gradient (no backward), more than one token a sequence, angles shared by
    the batch (``[S, r/2]``), float ids, fp32 inputs (the attention's own refusal)."""
    from kernels.triton.attention import attention_inverse_rope

    q, kv, idx, sink, scale, cos, sin = _inputs("window", triton_device())
    bad = {
        "require a gradient": dict(q=q.clone().requires_grad_()),
        "one token a sequence": dict(q=torch.cat((q, q), 1), idx=torch.cat((idx, idx), 1)),
        "one angle row a sequence": dict(cos=cos[0], sin=sin[0]),
        "int32 or int64": dict(idx=idx.float()),
        "bf16/fp16": dict(q=q.float(), kv=kv.float()),
    }
    for why, change in bad.items():
        a = {**dict(q=q, kv=kv, idx=idx, sink=sink, cos=cos, sin=sin), **change}
        with pytest.raises(ValueError, match=why) as e:
            attention_inverse_rope(a["q"], a["kv"], a["idx"], a["sink"], scale, a["cos"], a["sin"])
        assert "\n" not in str(e.value) and str(e.value).startswith("triton attention_inverse_rope: "), e.value


def _ptxas(kernel, types: dict, consts: dict, cfg: dict):
    """``(ptx, registers, spilled bytes)`` of ``kernel`` compiled for sm_90a as the decode step launches it."""
    import re

    consts = dict(consts, PDL=consts.get("ROPE", 0) > 0)        # the decode step's launch (kernels/triton/pdl.py)
    ptx, out = ptxas_report(kernel, types, consts, cfg["num_warps"], num_stages=cfg.get("num_stages", 3))
    return ptx, int(re.search(r"Used (\d+) registers", out).group(1)), sum(spilled_bytes(out))


def test_the_epilogue_compiles_for_sm90_without_spilling_more():
    """``_fwd_kernel`` with the epilogue (Flash's 512-wide heads, 64 rope channels, int64 ids, a cache a sequence)
    at the few-token and the wide settings spills no more than without it (none at the few-token ones, where
    ptxas reported 215 registers either way; the wide ones stored 1,324 bytes of spills before it, 1,144 with it,
    triton 3.6), and without
    the flag has no rotation (the training forward's kernel); the combine kernel's epilogue spills nothing."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from kernels.triton import attention as A

    types = {"Q": "*bf16", "KV": "*bf16", "IDX": "*i64", "SINK": "*fp32", "O": "*bf16", "LSE2": "*fp32",
             "COS": "*fp32", "SIN": "*fp32", "H": "i32", "K": "i32", "scale_log2": "fp32", "stride_kvt": "i32",
             **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kv", "stride_it", "stride_ot", "stride_oh")}}
    rope = dict(ROPE=32, ROUNDED=True)
    plain = dict(COS=None, SIN=None, stride_kvt=None, ROPE=0, ROUNDED=False)
    for cfg in (A.FEW_TOKENS_CONFIG, A.FWD_CONFIG):
        base = dict(BH=cfg["BH"], BK=cfg["BK"], D=512, NUM_STAGES=cfg["num_stages"])
        ptx, regs, spills = _ptxas(A._fwd_kernel, types, {**base, **rope}, cfg)
        ptx0, regs0, spills0 = _ptxas(A._fwd_kernel, types, {**base, **plain}, cfg)
        print(f"BH={cfg['BH']}: {regs} registers, {spills} bytes spilled; without the epilogue {regs0}, {spills0}")
        assert spills <= spills0 and (spills == 0 or cfg is A.FWD_CONFIG)
        assert "mul.rn.f32" in ptx and "mul.rn.f32" not in ptx0
    types = {"PO": "*fp32", "PM": "*fp32", "PL": "*fp32", "SINK": "*fp32", "O": "*bf16", "LSE2": "*fp32",
             "COS": "*fp32", "SIN": "*fp32", "H": "i32", "S": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    ptx, regs, spills = _ptxas(A._combine_kernel, types, dict(BH=16, D=512, **rope), dict(num_warps=4))
    assert spills == 0 and "mul.rn.f32" in ptx
