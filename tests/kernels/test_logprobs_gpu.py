"""The triton output head with the labels' log-probs (``kernels/triton/logprobs.py``) against the exact value.

Oracle: ``log softmax(y @ w^T / T)[label]`` and its gradients in fp64 on the same bf16 ``y`` and ``w``. Bound: the
fused op's error is at most the torch path's own (``kernels.reference.layers.head_logprobs`` on the GPU: the same
fp32-accumulated GEMM, then ``log_softmax`` and a gather; its gradient rounded to bf16 before the head's GEMMs as
the fused kernel writes it) times 1.5, plus a floor of a few fp32 rounding steps of the values involved. So the
fusion may not cost accuracy, and a wrong term (a missing ``1 / T``, the one-hot on the wrong column, a row
offset) is far outside the bound.

Also: labels outside the vocabulary give NaN (the kernel cannot raise), the weight gradient goes into the fp32
``main_grad`` buffer when ``wgrad_fusion`` marked the weight, and inputs the kernel does not serve are refused.

Shapes: small odd ones (``V`` not a multiple of the kernel's blocks) and, on a GPU, a Flash-shaped micro-batch row
count with the Flash vocabulary (2,048 rows x 129,280, hidden 4,096). With no GPU, ``TRITON_INTERPRET=1`` runs the
small shapes; otherwise they skip.
"""

import pytest
import torch

from kernels.reference.layers import head_logprobs as reference

from ._backends import triton_device

pytestmark = pytest.mark.gpu

SHAPES = [
    pytest.param((37, 64, 300), id="small"),
    pytest.param((5, 32, 4099), id="vocab-past-a-block"),
    pytest.param((2048, 4096, 129280), id="flash-rows",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Flash shape: GPU only")),
]


def _inputs(shape, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, d, V = shape
    y = torch.randn(N, d, generator=g).bfloat16().to(dev)
    w = (torch.randn(V, d, generator=g) * d ** -0.5 * 4).bfloat16().to(dev)      # logits of a few units
    labels = torch.randint(0, V, (N,), generator=g).to(dev)
    up = torch.randn(N, generator=g).to(dev)
    return y, w, labels, up


def _exact(y, w, labels, up, temperature):
    yd, wd = y.double().requires_grad_(True), w.double().requires_grad_(True)
    lp = torch.log_softmax((yd @ wd.t()) / temperature, -1).gather(-1, labels[:, None]).squeeze(-1)
    lp.backward(up.double())
    return lp.detach(), yd.grad, wd.grad


def _run(fn, y, w, labels, up, temperature):
    yk, wk = y.detach().requires_grad_(True), w.detach().requires_grad_(True)
    lp = fn(yk, wk, labels, temperature)
    lp.backward(up)
    return lp.detach(), yk.grad, wk.grad


def _no_worse(got, torch_path, exact, what, floor):
    err, base = (got.double() - exact).abs().max().item(), (torch_path.double() - exact).abs().max().item()
    print(f"{what}: fused max error {err:.3e}, torch path {base:.3e}")
    assert err <= 1.5 * base + floor, what


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_forward_and_backward_are_as_exact_as_the_torch_path(shape, temperature):
    from kernels.triton.logprobs import head_logprobs

    dev = triton_device()
    y, w, labels, up = _inputs(shape, dev)
    got = _run(head_logprobs, y, w, labels, up, temperature)
    ref = _run(reference, y, w, labels, up, temperature)
    exact = _exact(y, w, labels, up, temperature)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    _no_worse(got[0], ref[0], exact[0], f"log-probs {shape} T={temperature}", 1e-5 * (1 + exact[0].abs().max()))
    for i, what in ((1, "dy"), (2, "dw")):
        floor = 2.0 ** -7 * exact[i].abs().max().item()          # one bf16 rounding of the largest entry
        _no_worse(got[i], ref[i], exact[i], f"{what} {shape} T={temperature}", floor)


def test_a_label_outside_the_vocabulary_gives_nan_and_the_rest_are_unaffected():
    from kernels.triton.logprobs import head_logprobs

    dev = triton_device()
    y, w, labels, _ = _inputs((6, 32, 300), dev)
    bad = labels.clone()
    bad[2], bad[4] = 300, -1
    with torch.no_grad():
        good, lp = head_logprobs(y, w, labels), head_logprobs(y, w, bad)
    assert torch.isnan(lp[[2, 4]]).all()
    keep = [0, 1, 3, 5]
    assert torch.equal(lp[keep], good[keep])


def test_the_weight_gradient_goes_into_the_marked_fp32_buffer():
    """``wgrad_fusion`` marks the head's weight: its gradient is added into ``main_grad`` (fp32) by the GEMM, the
    autograd ``.grad`` is only the marker, and the sum equals the unfused gradient before its bf16 rounding."""
    from kernels.triton.logprobs import head_logprobs

    dev = triton_device()
    y, w, labels, up = _inputs((64, 64, 1000), dev, seed=3)
    plain = _run(head_logprobs, y, w, labels, up, 1.0)
    wk = w.detach().requires_grad_(True)
    wk.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32, device=dev)
    wk.fuse_wgrad = True                    # what engine.wgrad_fusion.enable sets
    head_logprobs(y, wk, labels).backward(up)
    got = wk.main_grad - 0.5
    assert wk.grad_added_to_main_grad
    assert (got - plain[2].float()).abs().max().item() <= 2.0 ** -7 * plain[2].float().abs().max().item()


def test_inputs_it_does_not_serve_are_refused_with_the_fix():
    from kernels.triton.logprobs import head_logprobs

    dev = triton_device()
    y, w, labels, _ = _inputs((4, 32, 100), dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        head_logprobs(y.float(), w.float(), labels)
    with pytest.raises(ValueError, match=r"y \[N, d\], w \[V, d\], labels \[N\]"):
        head_logprobs(y, w[:, :16], labels)
    with pytest.raises(ValueError, match="long"):
        head_logprobs(y, w, labels.int())
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(y, w, labels, 0.0)
    if dev == "cuda":
        with pytest.raises(ValueError, match="CUDA tensors"):
            head_logprobs(y.cpu(), w.cpu(), labels.cpu())
