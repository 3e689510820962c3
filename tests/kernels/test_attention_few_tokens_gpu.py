"""The triton sparse attention's launch settings for few tokens (``kernels.triton.attention.fwd_settings``): a
decode step's tokens run 16-head blocks, and give the reference's output and log-sum-exp as the 64-head blocks
do. With no GPU, ``TRITON_INTERPRET=1`` runs them; otherwise they skip."""

import pytest
import torch

from ._backends import triton_device

pytestmark = pytest.mark.gpu


def test_decode_steps_take_the_few_token_settings():
    """One and 64 tokens of V4-Flash's 64 heads take the narrow head blocks (4 programs a token), a prefill of
    512 tokens the wide ones; V4-Pro's 128 heads switch at 64 tokens."""
    pytest.importorskip("triton")
    from kernels.triton import attention as A

    assert A.fwd_settings(1, 64) == A.FEW_TOKENS_CONFIG == A.fwd_settings(64, 64)
    assert A.fwd_settings(512, 64) == A.FWD_CONFIG == A.fwd_settings(64, 128)
    assert A.fwd_settings(63, 128) == A.FEW_TOKENS_CONFIG


@pytest.mark.parametrize("T,H,K", [(1, 64, 640), (3, 64, 200), (2, 20, 77)])
def test_few_token_forward_is_the_reference(T, H, K):
    """Few tokens (Flash's 64 heads over 640 gathered rows; ragged rows; heads off the 16-head block) against the
    fp32 reference and against the wide settings forced by ``config``: the same output within bf16 rounding and
    the same log-sum-exp."""
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
    sink = torch.randn(H, generator=g)
    scale = D ** -0.5
    assert A.fwd_settings(T, H) == A.FEW_TOKENS_CONFIG
    o, lse2 = A.sparse_attention_fwd(q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev), scale)
    o_wide, lse2_wide = A.sparse_attention_fwd(q.to(dev), kv.to(dev), idx.to(dev), sink.to(dev), scale,
                                               config=A.FWD_CONFIG)
    want = ref(q.float()[None], kv.float()[None], idx.long(), sink, scale)[0]
    tol = 2.0 ** -7 * want.abs().max().item()         # bf16 rounding of the output (fp16's is finer)
    assert (o.float().cpu() - want).abs().max().item() <= tol
    assert (o.float() - o_wide.float()).abs().max().item() <= tol
    assert torch.allclose(lse2, lse2_wide, rtol=0, atol=1e-4)
