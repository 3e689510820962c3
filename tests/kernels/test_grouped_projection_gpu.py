"""The attention's grouped output projection (``kernels.reference.layers.grouped_projection``, both
implementations' ``wo_a``) at the Flash shape on a GPU: within the einsum's own rounding of the fp64 value,
forward and both gradients, and each way only the GEMMs run: no copy kernel of the ``[T, G, d]`` tensor, which
the einsum spends on a group-major permutation and back."""

import pytest
import torch

from kernels.reference.layers import grouped_projection

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # cuBLAS's workspace memsets are not kernels; a copy would show as a kernel or a Memcpy
    return [e.name for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memset")]


def test_flash_shape_matches_fp64_and_runs_only_gemms():
    g = torch.Generator().manual_seed(0)
    T, G, d, R = 4096, 8, 4096, 1024                  # a Flash micro-batch row: 64 heads x 512 in 8 groups
    o = (torch.randn(T, G, d, generator=g)).bfloat16().cuda().requires_grad_()
    w = (torch.randn(G, R, d, generator=g) * d ** -0.5).bfloat16().cuda().requires_grad_()
    up = torch.randn(T, G, R, generator=g).bfloat16().cuda()
    u = grouped_projection(o, w)
    do, dw = torch.autograd.grad(u, (o, w), up)
    od, wd = o.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ud = torch.einsum("tgd,grd->tgr", od, wd)
    dod, dwd = torch.autograd.grad(ud, (od, wd), up.double())
    ue = torch.einsum("tgd,grd->tgr", o, w)
    doe, dwe = torch.autograd.grad(ue, (o, w), up)
    for mine, einsum, exact in ((u, ue, ud), (do, doe, dod), (dw, dwe, dwd)):
        err, bound = (mine.double() - exact).abs().max().item(), (einsum.double() - exact).abs().max().item()
        assert err <= 1.5 * bound + 1e-6, (err, bound)

    fwd = _kernels(lambda: grouped_projection(o, w))
    bwd = _kernels(lambda: torch.autograd.grad(grouped_projection(o, w), (o, w), up))
    for names in (fwd, bwd):
        copies = [n for n in names if any(w in n.lower() for w in ("copy", "memcpy", "elementwise"))]
        assert not copies, copies
    assert len(fwd) == 1 and len(bwd) == 3, (fwd, bwd)
