"""``kernels.wgrad``: weight gradients written into the fp32 gradient buffer by their GEMM (the trainer's
``wgrad_fusion``), on the CPU's upcast path; the CUDA GEMM (``torch.mm`` / ``addmm`` with ``out_dtype``) and the
whole optimizer are tests/train/test_fused_optim_gpu.py's. Against an fp64 reference: the fused gradient has no
bf16 rounding, so it is within fp32 summation of the exact one."""

from __future__ import annotations

import pytest
import torch

from kernels import wgrad
from kernels.reference.layers import linear_fp32


def _exact(x, g):
    return g.reshape(-1, g.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()


def _weight(out, inp, gen):
    w = torch.nn.Parameter(torch.randn(out, inp, generator=gen).bfloat16())
    w.main_grad = torch.full((out, inp), 7.0)        # the last step's gradient, still in the buffer
    w.fuse_wgrad = True
    return w


def test_the_first_gradient_of_a_step_overwrites_the_buffer_and_later_ones_add():
    gen = torch.Generator().manual_seed(0)
    w = _weight(48, 32, gen)
    xs = [torch.randn(2, 5, 32, generator=gen).bfloat16() for _ in range(2)]
    gs = [torch.randn(2, 5, 48, generator=gen).bfloat16() for _ in range(2)]
    wgrad.mark_last_step(w.main_grad)
    wgrad.wgrad_into(w.main_grad, xs[0], gs[0])
    torch.testing.assert_close(w.main_grad.double(), _exact(xs[0], gs[0]), rtol=1e-6, atol=1e-5)
    wgrad.wgrad_into(w.main_grad, xs[1], gs[1])
    torch.testing.assert_close(w.main_grad.double(), _exact(xs[0], gs[0]) + _exact(xs[1], gs[1]),
                               rtol=1e-6, atol=1e-5)
    assert not wgrad.claim(w.main_grad)               # it holds this step's gradient now


def test_a_buffer_not_marked_is_added_to():
    gen = torch.Generator().manual_seed(1)
    w = _weight(16, 16, gen)
    x, g = torch.randn(9, 16, generator=gen).bfloat16(), torch.randn(9, 16, generator=gen).bfloat16()
    wgrad.wgrad_into(w.main_grad, x, g)
    torch.testing.assert_close(w.main_grad.double(), 7.0 + _exact(x, g), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fp32_out", [False, True], ids=["linear", "linear_fp32"])
def test_a_fused_linear_sends_its_weight_gradient_to_the_buffer_only(fp32_out):
    """``kernels.wgrad.linear`` (engine.layers.Linear) and ``linear_fp32`` (the output head): the input gradient is
    the unfused one's, the weight's gradient lands in ``main_grad`` and autograd gets a marker, with the weight
    flagged so that megatron-core's gradient hook adds nothing more."""
    gen = torch.Generator().manual_seed(2)
    w = _weight(24, 40, gen)
    wgrad.mark_last_step(w.main_grad)
    x = torch.randn(3, 7, 40, generator=gen).bfloat16().requires_grad_(True)
    g = torch.randn(3, 7, 24, generator=gen).bfloat16()
    y = linear_fp32(x, w) if fp32_out else wgrad.linear(x, w)
    assert y.dtype == (torch.float32 if fp32_out else torch.bfloat16)
    y.backward(g.float() if fp32_out else g)
    assert w.grad_added_to_main_grad and w.grad.shape == w.shape
    torch.testing.assert_close(w.main_grad.double(), _exact(x.detach(), g), rtol=1e-6, atol=1e-5)
    x2 = x.detach().clone().requires_grad_(True)
    plain = torch.nn.functional.linear(x2.float(), w.detach().float())
    plain.backward(g.float())
    torch.testing.assert_close(x.grad.float(), x2.grad.float(), rtol=1e-2, atol=1e-2)


def test_an_unmarked_weight_takes_autograds_own_gradient():
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(8, 8, generator=gen).bfloat16())
    x = torch.randn(4, 8, generator=gen).bfloat16()
    wgrad.linear(x, w).float().sum().backward()
    assert w.grad is not None and not hasattr(w, "grad_added_to_main_grad")


def test_refusals_name_what_does_not_fit():
    main = torch.zeros(4, 6)
    assert "bf16 or fp16" in wgrad.wgrad_refusal(main, torch.zeros(2, 6), torch.zeros(2, 4))
    assert "shapes" in wgrad.wgrad_refusal(main, torch.zeros(2, 6).bfloat16(), torch.zeros(3, 4).bfloat16())
    assert "bfloat16 gradient buffer" in wgrad.wgrad_refusal(main.bfloat16(), torch.zeros(2, 6).bfloat16(),
                                                             torch.zeros(2, 4).bfloat16())
    assert wgrad.wgrad_refusal(main, torch.zeros(2, 6).bfloat16(), torch.zeros(2, 4).bfloat16()) == ""
    with pytest.raises(NotImplementedError, match="Fix: wgrad_fusion=off"):
        wgrad.APEX_API.wgrad_gemm_accum_fp16(None, None, None)


def test_the_option_is_refused_where_it_cannot_apply():
    from core.config import ConfigError
    from engine.wgrad_fusion import resolve

    assert resolve("auto", True, torch.bfloat16, False) and not resolve("off", True, torch.bfloat16, False)
    assert not resolve("auto", False, torch.bfloat16, False) and not resolve("auto", True, torch.bfloat16, True)
    with pytest.raises(ConfigError, match="--compile.*Fix: wgrad_fusion=auto or off"):
        resolve("on", True, torch.bfloat16, True)
    with pytest.raises(ConfigError, match="GPU targets"):
        resolve("on", False, torch.float32, False)
