"""``engine.compile.compile_blocks`` (the ``--compile`` speed option) leaves the miles model's math alone:
the compiled tiny model gives the eager model's logits and gradients (fp32), its parameter names are
unchanged, and a kernel backend's own ops are kept out of the compiled graphs unless they are marked
traceable (the GPU backends' torch.library custom ops).

Every block kind is traced through dynamo and AOTAutograd (``aot_eager``: the graphs, guards and the
functionalized backward that Inductor is given); one block, a hash-routed window block, also runs
Inductor's generated code. On the CPU Inductor builds each fused kernel (42 for that block's forward and
backward) with the C++ compiler: about 120 s of CPU on a machine with an empty Inductor cache (CI's), all
three kinds 330 s. The test has Inductor write scalar C++ (``cpp.vec_isa_ok=False``): the same lowering,
fusion and wrapper, without the SIMD headers that made each build twice as long (72 s of CPU, 2026-12-03).
The GPU's Inductor code (Triton), what a GPU run executes, is checked on all three kinds by
tests/kernels/test_compile_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from ._helpers import TINY, run_config, single_process_group


# one block of each kind (hash-routed window, learned CSA, learned HCA): each kind compiles once
SMALL = TINY.replace(n_layers=3, compress_ratios=(0, 4, 128), n_hash_layers=1, n_mtp_layers=0)
WINDOW = TINY.replace(n_layers=1, compress_ratios=(0,), n_hash_layers=1, n_mtp_layers=0)


def _model(config):
    from core.assembly import assemble

    torch.manual_seed(0)
    return assemble(run_config()).build_model(config)


@pytest.mark.parametrize("backend,config", [("aot_eager", SMALL), ("inductor", WINDOW)], ids=["aot_eager", "inductor"])
def test_compiled_blocks_match_eager(backend, config):
    single_process_group()
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):   # scalar C++ on the CPU (docstring)
        _compiled_blocks_match_eager(backend, config)


def _compiled_blocks_match_eager(backend, config):
    from engine.compile import compile_blocks

    eager, compiled = _model(config), _model(config)
    names = [n for n, _ in compiled.named_parameters()]
    compile_blocks(compiled, backend=backend)
    assert [n for n, _ in compiled.named_parameters()] == names  # in place: checkpoints unchanged
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    for step in range(2):  # the second call runs the cached compiled code
        outs = []
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            logits = m(ids)
            logits.log_softmax(-1).mean().backward()
            outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        (le, ge), (lc, gc) = outs
        torch.testing.assert_close(lc, le, atol=2e-5, rtol=1e-5)
        assert set(gc) == set(ge)
        for n in ge:
            assert (gc[n] - ge[n]).abs().max() <= 1e-5 * max(ge[n].abs().max(), 1e-3), n


def test_backend_kernels_stay_eager():
    """Ops a kernel backend brings itself run eagerly from compiled code unless marked traceable (torch code
    around registered custom ops, ``kernels.gpu_ops.traceable``); reference ops stay traceable."""
    from core.kernel_ops import OpTable
    from engine.compile import opaque_kernel_ops
    from kernels.gpu_ops import traceable
    from kernels.reference.backend import reference_functions

    def own_kernel(x):
        return x

    @traceable
    def own_custom_op(x):
        return x

    own_kernel.__module__ = own_custom_op.__module__ = "kernels.triton.attention"
    ref = OpTable("triton", {"sparse_attention_with_sink": own_kernel, "sinkhorn": own_custom_op},
                  delegated={n: ("none", f) for n, f in reference_functions().items()})
    ops = opaque_kernel_ops(ref)
    assert ops.hc_pre is ref.hc_pre
    assert ops.sinkhorn is ref.sinkhorn
    assert ops.sparse_attention_with_sink is not ref.sparse_attention_with_sink
    assert ops.sparse_attention_with_sink(3) == 3

    def block(x):
        return ops.sinkhorn(x.sin()).cos() + ops.sparse_attention_with_sink(x.exp()).tanh()

    explain = torch._dynamo.explain(block)(torch.ones(2))
    assert explain.graph_break_count == 1, explain.break_reasons  # at the unmarked op only
