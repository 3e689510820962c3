"""The training step's speed primitives on a GPU (``engine``), against direct computations:

* ``engine.moe.grouped_linear``: one ``torch._grouped_mm`` (bf16, CUDA) vs one fp64 GEMM per group, with
  empty groups, forward and both gradients;
* ``kernels.reference.layers.linear_fp32``: bf16 operands through ``torch.mm(..., out_dtype=float32)``
  vs the fp64 GEMM of the same values (the forward is exact products summed in fp32);
* ``engine.compile.compile_blocks(cuda_graphs=True)`` (the benchmark's setting): three AdamW steps of the
  tiny miles (BSHD) and megatron (THD, a prebuilt layout reused every step) models, compiled and CUDA-graphed,
  follow the eager steps (bf16: loss within 2e-2 at every step).
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_grouped_linear_cuda_matches_per_group_gemm():
    from engine.moe import _grouped_mm_supported, grouped_linear

    g = torch.Generator().manual_seed(0)
    counts = [0, 300, 0, 517, 64, 0, 1000, 7]
    x = torch.randn(sum(counts), 256, generator=g).bfloat16().cuda().requires_grad_()
    w = (torch.randn(len(counts), 384, 256, generator=g) * 0.05).bfloat16().cuda().requires_grad_()
    assert _grouped_mm_supported(x, w)
    ends = torch.tensor(counts).cumsum(0).cuda()
    y = grouped_linear(x, w, ends)
    dy = torch.randn(y.shape, generator=g).bfloat16().cuda()
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b = [0] + ends.tolist()
    yr = torch.cat([xr[s:e] @ wr[i].T for i, (s, e) in enumerate(zip(b[:-1], b[1:]))])
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    for a, r in ((y, yr), (dx, dxr), (dw, dwr)):
        assert (a.double() - r).abs().max() <= 2e-2 * r.abs().max(), a.shape
    assert not dw[[0, 2, 5]].any()


def test_linear_fp32_cuda_half_operands():
    from kernels.reference.layers import linear_fp32

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 500, 512, generator=g).bfloat16().cuda().requires_grad_()
    w = (torch.randn(4096, 512, generator=g) * 0.05).bfloat16().cuda().requires_grad_()
    out = linear_fp32(x, w)
    assert out.dtype == torch.float32
    ref = x.detach().double() @ w.detach().double().T
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    dl = torch.randn(out.shape, generator=g).cuda()
    dx, dw = torch.autograd.grad(out, (x, w), dl)
    dxr = dl.double() @ w.detach().double()
    dwr = dl.double().flatten(0, 1).T @ x.detach().double().flatten(0, 1)
    assert (dx.double() - dxr).abs().max() <= 2e-2 * dxr.abs().max()
    assert (dw.double() - dwr).abs().max() <= 2e-2 * dwr.abs().max()


def _build(impl):
    from core.assembly import assemble
    from core.config import preset
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    c = preset("tiny")
    rc = normalize(Choices(impl=impl, kernel_backend="triton", hardware="nvidia", model=c),
                   make_host(third_party=False), model_name="tiny")
    parts = assemble(rc)
    parts.setup_process()
    torch.manual_seed(0)
    return c, parts.build_model(c).cuda()   # the run's dtype: bf16 on nvidia


def _losses(impl, compiled, steps=3):
    from engine.compile import compile_blocks

    c, m = _build(impl)
    if compiled:
        compile_blocks(m, cuda_graphs=True)
    ids = torch.randint(0, c.vocab_size, (1, 384), generator=torch.Generator().manual_seed(2)).cuda()
    if impl == "megatron":
        flat = ids[0]
        cu = torch.tensor([0, 200, 384], device="cuda")
        layout = m.layout_for(flat, cu)
        rows = torch.tensor([i for i in range(383) if i != 199], device="cuda")
        labels = flat[rows + 1]

        def loss_fn():
            return F.cross_entropy(m(flat, layout=layout).index_select(0, rows), labels)
    else:
        def loss_fn():
            return F.cross_entropy(m(ids)[0, :-1], ids[0, 1:])
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, fused=True)
    out = []
    for _ in range(steps):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss))
    return out


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_compiled_cuda_graph_steps_follow_eager(impl):
    pytest.importorskip("triton")
    eager, compiled = _losses(impl, False), _losses(impl, True)
    print(f"\n{impl}: eager {eager}, compiled + CUDA graphs {compiled}")
    assert eager[-1] < eager[0]
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= 2e-2, (eager, compiled)
