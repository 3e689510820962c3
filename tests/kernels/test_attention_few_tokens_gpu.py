"""The triton sparse attention's launch settings for few tokens (``kernels.triton.attention.fwd_settings``): a
decode step's tokens run 16-head blocks, one token's rows split over several programs whose partials a second
kernel combines with the sink, and give the reference's output and log-sum-exp as the 64-head blocks do. With
no GPU, ``TRITON_INTERPRET=1`` runs them; otherwise they skip."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


def test_decode_steps_take_the_few_token_settings():
    """One and 64 tokens of V4-Flash's 64 heads take the narrow head blocks (4 programs a token), a prefill of
    512 tokens the wide ones; V4-Pro's 128 heads switch at 64 tokens."""
    pytest.importorskip("triton")
    from kernels.triton import attention as A

    assert A.fwd_settings(1, 64) == A.FEW_TOKENS_CONFIG == A.fwd_settings(64, 64, 640)
    assert A.fwd_settings(512, 64, 640) == A.FWD_CONFIG == A.fwd_settings(64, 128, 640)
    assert A.fwd_settings(63, 128) == A.FEW_TOKENS_CONFIG
    assert A.fwd_settings(1, 64, 640)["SPLIT"] == 5            # 4 head blocks x 5 splits of two 64-row tiles
    assert A.fwd_settings(1, 64, 128)["SPLIT"] == 1            # a window alone: one split
    assert A.fwd_settings(8, 64, 4096)["SPLIT"] == 4           # 32 programs of blocks: 128 with the splits


@pytest.mark.parametrize("T,H,K,empty", [(1, 64, 640, False), (3, 64, 200, False), (2, 20, 77, False),
                                         (2, 20, 700, True), (4, 64, 300, False)])
def test_few_token_forward_is_the_reference(T, H, K, empty, monkeypatch):
    """Few tokens (Flash's 64 heads over 640 gathered rows, split five ways; ragged rows; heads off the 16-head
    block; ``empty``: a split's rows all ``-1``, and a token with no row at all) against the fp32 reference and
    against the wide settings forced by ``config``: the same output within bf16 rounding and the same
    log-sum-exp."""
    pytest.importorskip("triton")
    from kernels.reference.attention import sparse_attention_with_sink as ref
    from kernels.triton import attention as A

    dev = triton_device()
    D = 64 if dev == "cpu" else 512                   # the interpreter is slow: a smaller head dim there
    dt = torch.float16 if dev == "cpu" else torch.bfloat16     # the interpreter multiplies bf16 tiles wrongly
    g = torch.Generator().manual_seed(T * H + K)
    q = torch.randn(T, H, D, generator=g).to(dt)
    kv = torch.randn(K + 5, D, generator=g).to(dt)
    idx = torch.randint(-1, K + 5, (T, K), generator=g).to(torch.int32)
    if empty:
        idx[0, 128:384] = -1                           # the second and third of token 0's 128-row splits
        idx[1] = -1                                    # token 1 sees nothing: o = 0, lse = the sink
    sink = torch.randn(H, generator=g)
    scale = D ** -0.5
    splits = []                                        # which launches ran: the split ones where SPLIT > 1
    monkeypatch.setattr(A, "_split_forward", lambda *a, _f=A._split_forward: splits.append(a[-1]["SPLIT"]) or _f(*a))
    cfg = A.fwd_settings(T, H, K)
    assert {k: v for k, v in cfg.items() if k != "SPLIT"} == {k: v for k, v in A.FEW_TOKENS_CONFIG.items()
                                                             if k != "SPLIT"}
    o, lse2 = A.sparse_attention_fwd(q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev), scale)
    assert splits == ([cfg["SPLIT"]] if cfg["SPLIT"] > 1 else []), (splits, cfg)
    o_wide, lse2_wide = A.sparse_attention_fwd(q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev), scale,
                                               config=A.FWD_CONFIG)
    want = ref(q.float()[None], kv.float()[None], idx.long(), sink, scale)[0]
    tol = 2.0 ** -7 * want.abs().max().item()         # bf16 rounding of the output (fp16's is finer)
    assert (o.float().cpu() - want).abs().max().item() <= tol
    assert (o.float() - o_wide.float()).abs().max().item() <= tol
    assert torch.allclose(lse2, lse2_wide, rtol=0, atol=1e-4)
    if cfg["SPLIT"] > 1:                               # and against the same head blocks unsplit
        o_one, lse2_one = A.sparse_attention_fwd(q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev), scale,
                                                 config=dict(SPLIT=1))
        assert (o.float() - o_one.float()).abs().max().item() <= tol
        assert torch.allclose(lse2, lse2_one, rtol=0, atol=1e-4)


def test_the_split_kernels_compile_for_sm90():
    """The split forward and its combine compile to PTX for sm_90 with triton alone, no GPU (the interpreter runs
    code the compiler rejects)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import attention as A

    cfg, target = A.FEW_TOKENS_CONFIG, GPUTarget("cuda", 90, 32)
    consts = dict(BH=cfg["BH"], BK=cfg["BK"], D=512, NUM_STAGES=cfg["num_stages"])
    sig = {"Q": "*bf16", "KV": "*bf16", "IDX": "*i32", "PO": "*fp32", "PM": "*fp32", "PL": "*fp32", "H": "i32",
           "K": "i32", "KPER": "i32", "scale_log2": "fp32",
           **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kv", "stride_it")},
           **{k: "constexpr" for k in consts}}
    split = compile(ASTSource(A._fwd_split_kernel, sig, consts), target=target,
                    options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    consts = dict(BH=cfg["BH"], D=512)
    sig = {"PO": "*fp32", "PM": "*fp32", "PL": "*fp32", "SINK": "*fp32", "O": "*bf16", "LSE2": "*fp32", "H": "i32",
           "S": "i32", "stride_ot": "i32", "stride_oh": "i32", **{k: "constexpr" for k in consts}}
    combine = compile(ASTSource(A._combine_kernel, sig, consts), target=target, options=dict(num_warps=4))
    assert ".entry" in split.asm["ptx"] and ".entry" in combine.asm["ptx"]
    assert split.metadata.shared <= 227 * 1024                        # an H100 / H200 SM's limit
