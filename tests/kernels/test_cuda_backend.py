"""The `cuda` kernel backend without a GPU: its record declares the attention shape its kernel is built for,
the parse-time rule ``kernel-attention-shape`` refuses other models with the fix and lets V4's heads through,
and the entry points refuse what the kernel does not take instead of handing it to another kernel. The kernel
itself is tested on an H100/H200 (``test_cuda_attention_gpu.py``), the whole backend by the GPU rows of the
combination matrix (``tiny-wide-heads``: 64 heads x 512)."""

from __future__ import annotations

import pytest
import torch

from core.combinations import InvalidCombination
from core.config import preset
from core.records import KERNEL
from core.run_config import Choices, normalize
from launchers.builtin_plugins import make_host


@pytest.fixture(scope="module")
def host():
    return make_host(third_party=False)


def _run(host, model):
    return normalize(Choices(impl="miles", kernel_backend="cuda", hardware="nvidia", model=preset(model)), host,
                     model_name=model)


def test_the_record_declares_the_kernels_attention_shape(host):
    rec = host.get(KERNEL, "cuda")
    assert rec.attention_head_dims == frozenset({512}) and rec.attention_heads_multiple == 64
    assert rec.hardware == frozenset({"nvidia"}) and rec.dtypes == frozenset({"bf16"})
    assert rec.impls == frozenset({"miles", "megatron"}) and rec.not_runnable is None
    assert rec.capabilities()["attention_head_dims"] == [512]


def test_the_rule_refuses_other_attention_shapes_and_takes_v4s(host):
    with pytest.raises(InvalidCombination, match=r"head_dim=128 \(built for 512\) and n_heads=4 \(a multiple "
                                                 r"of 64 is needed\)\. Fix: use --kernel-backend triton"):
        _run(host, "tiny")
    for model in ("tiny-wide-heads", "flash-shaped", "flash", "pro"):
        run = _run(host, model)                       # 64 or 128 heads of 512
        assert run.selection.kernel.name == "cuda" and run.selection.head_dim == 512
    # other backends take the tiny model as before
    normalize(Choices(impl="miles", kernel_backend="triton", hardware="nvidia", model=preset("tiny")), host,
              model_name="tiny")


def test_the_entry_points_refuse_what_the_kernel_does_not_take():
    from kernels.cuda import entry

    q, kv = torch.zeros(2, 64, 512, dtype=torch.bfloat16), torch.zeros(3, 512, dtype=torch.bfloat16)
    idx, sink = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(64)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        entry._check(q, kv, idx, sink)
    assert entry.kernel_supports(q.unsqueeze(0), kv.unsqueeze(0))
    assert not entry.kernel_supports(q.unsqueeze(0).half(), kv.unsqueeze(0).half())        # fp16: triton
    assert not entry.kernel_supports(q[:, :32].unsqueeze(0), kv.unsqueeze(0))              # 32 heads
    q128 = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not entry.kernel_supports(q128, torch.zeros(1, 3, 128, dtype=torch.bfloat16))  # head dim 128
    with pytest.raises(ValueError, match="Fix: run with --dtype bf16 on a GPU target, or choose --kernel-backend none"):
        entry.sparse_attention_with_sink(q128, torch.zeros(1, 3, 128, dtype=torch.bfloat16),
                                         torch.zeros(2, 4, dtype=torch.long), torch.zeros(64), 0.1)


def test_only_the_variants_that_compute_the_function_are_reachable(monkeypatch):
    """Variants 1 and 4 (wrong by design, built to confirm variant 0's layout) and the timing ablations (wrong
    outputs) never run through the forward; the variant knob is checked, not trusted."""
    from kernels.cuda import attention as CA

    assert not set(CA.WRONG_VARIANTS) & set(CA.VARIANTS) and not set(CA.ABLATIONS) & set(CA.VARIANTS)
    monkeypatch.delenv("DSV4_CUDA_ATTN_VARIANT", raising=False)
    assert CA.default_variant() == CA.DEFAULT_VARIANT in CA.VARIANTS
    monkeypatch.setenv("DSV4_CUDA_ATTN_VARIANT", "2")
    assert CA.default_variant() == 2
    for bad in ("4", "100", "six"):
        monkeypatch.setenv("DSV4_CUDA_ATTN_VARIANT", bad)
        with pytest.raises(ValueError, match="DSV4_CUDA_ATTN_VARIANT"):
            CA.default_variant()


def test_the_kernel_launcher_refuses_what_the_kernel_does_not_take():
    """``kernels.cuda.attention.sparse_attention_fwd`` on CPU tensors: each wrong input is refused by name before
    the device check (the GPU-only refusals: test_cuda_attention_gpu.py)."""
    from kernels.cuda import attention as CA

    q = torch.randn(4, 64, 512).bfloat16()
    kv = torch.randn(10, 512).bfloat16()
    idx = torch.zeros(4, 8, dtype=torch.int32)
    sink = torch.zeros(64)
    f = CA.sparse_attention_fwd
    with pytest.raises(ValueError, match=r"takes bf16 q and kv, got torch.float16, torch.float16: cast them with \.bfloat16\(\) or use --kernel-backend triton"):
        f(q.half(), kv.half(), idx, sink, 0.1)
    with pytest.raises(ValueError, match="built for head dim 512, got 256: use --kernel-backend triton for other head dims"):
        f(q[..., :256].contiguous(), kv[:, :256].contiguous(), idx, sink, 0.1)
    with pytest.raises(ValueError, match="takes a multiple of 64 heads, got 32: pad the heads to a multiple of 64 or use --kernel-backend triton"):
        f(q[:, :32].contiguous(), kv, idx, sink[:32], 0.1)
    with pytest.raises(ValueError, match=r"shape mismatch between q \[T,H,D\], kv \[Tkv,D\], idx \[T,K\] and sink \[H\]"):
        f(q, kv, idx[:3], sink, 0.1)
    with pytest.raises(ValueError, match=r"idx must be int32 \(or int64\), got torch.float32"):
        f(q, kv, idx.float(), sink, 0.1)
    with pytest.raises(ValueError, match=r"needs CUDA tensors: move q, kv, idx and sink to the GPU \(\.cuda\(\)\)"):
        f(q, kv, idx, sink, 0.1)
