"""``engine.compile.compile_blocks`` on the megatron model: every block of a deep model runs compiled.

Blocks share their code, and a block's layer-specific constants (compress ratio, routing kind, the layer id
routing replay looks up) make dynamo compile one variant per layer. Past dynamo's default limit of 8
variants the remaining layers would silently run uncompiled (V4-Flash has 43 layers), so
``compile_blocks`` raises the limit to the number of blocks. Compiled through ``aot_eager`` (dynamo's graphs
and AOTAutograd's forward and backward graphs, run without Inductor's C++ build, as
tests/impl_miles/test_compile.py does), so "compiled equals eager" compares two different executions; a
backend that counts its calls shows every block ran compiled; dynamo is told to fail instead of falling back. With the indexer KL loss on: steps after the first trace
nothing new, and CUDA graphs are refused."""

from __future__ import annotations

import pytest
import torch

from tests.impl_megatron.conftest import run_config


def _counting_aot_eager():
    """``aot_eager`` that records each graph dynamo hands it: ``(backend, graphs)``."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager, graphs = lookup_backend("aot_eager"), []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend, graphs


def test_every_block_of_a_deep_model_compiles(tiny_config):
    from core.assembly import assemble
    from engine.compile import compile_blocks

    n = 9  # one layer more than dynamo's default recompile limit of 8 (patched below): the fewest that fail
    c = tiny_config.replace(n_layers=n, compress_ratios=(0, 0) + (4, 128) * 3 + (4,), n_hash_layers=2, n_mtp_layers=0)
    torch.manual_seed(0)
    eager = assemble(run_config(c)).build_model(c)
    torch.manual_seed(0)
    compiled = assemble(run_config(c)).build_model(c)
    ids = torch.randint(0, c.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 50, 96])
    torch._dynamo.reset()
    backend, graphs = _counting_aot_eager()
    ran = []                         # (layer, inside compiled code) per block call
    for i, block in enumerate(compiled.decoder.layers):
        block.register_forward_pre_hook(lambda mod, args, i=i: ran.append((i, torch.compiler.is_compiling())))
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        compile_blocks(compiled, backend=backend)
        out = compiled(ids, cu)
    assert sorted(i for i, inside in ran if inside) == list(range(n)), ran    # every block ran compiled
    assert len(graphs) >= n
    torch.testing.assert_close(out, eager(ids, cu), atol=1e-5, rtol=1e-5)


def test_compiled_steps_with_the_indexer_kl_loss_trace_once(tiny_config):
    """With the indexer KL loss on, the steps after the first compile nothing new, and give eager's losses.

    The KL loss once read a host value (``bool(rows.any())``) and indexed rows by a boolean mask: dynamo
    broke the graph there and compiled the rest of the layer again on a later step (on the GPU at every
    step: the compiled + CUDA-graph step was 14x slower with the loss on than off)."""
    from torch._dynamo.utils import counters

    from core.assembly import assemble
    from engine.compile import compile_blocks

    c = tiny_config.replace(n_mtp_layers=0, compress_ratios=tiny_config.compress_ratios[:tiny_config.n_layers])
    assert 4 in c.compress_ratios
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(assemble(run_config(c)).build_model(c, dsa_indexer_loss_coeff=0.1).train())
    eager, compiled = models
    ids = torch.randint(0, c.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    layout = compiled.layout_for(ids, torch.tensor([0, 50, 96]))
    torch._dynamo.reset()
    counters.clear()
    backend, _ = _counting_aot_eager()
    compile_blocks(compiled, backend=backend)
    graphs = []
    for step in range(3):
        for m in (eager, compiled):
            logits, kl = m(ids, layout=layout, return_indexer_loss=True)
            (logits.logsumexp(-1).mean() + kl).backward()
        torch.testing.assert_close(compiled.last_indexer_loss, eager.last_indexer_loss, atol=1e-6, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 2, f"graphs compiled after steps 1, 2, 3: {graphs}"
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        if "indexer" in name:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_cuda_graphs_are_refused_with_the_indexer_kl_loss_on(tiny_config):
    """With the KL loss on, CUDA-graph trees record the step again at every step (14x slower on an H200):
    ``compile_blocks(cuda_graphs=True)`` refuses and names both ways out, before compiling anything."""
    from core.assembly import assemble
    from engine.compile import compile_blocks

    c = tiny_config.replace(n_mtp_layers=0, compress_ratios=tiny_config.compress_ratios[:tiny_config.n_layers])
    assert assemble(run_config(c)).build_model(c).cuda_graphs_refusal() is None
    model = assemble(run_config(c)).build_model(c, dsa_indexer_loss_coeff=0.5)
    with pytest.raises(ValueError) as err:
        compile_blocks(model, cuda_graphs=True)
    assert str(err.value) == (
        "compile_blocks(cuda_graphs=True): the megatron model trains its indexer with the KL loss "
        "(dsa_indexer_loss_coeff=0.5), and CUDA-graph trees record such a step again at every step; compile "
        "without CUDA graphs (compile_blocks(model, cuda_graphs=False)) or turn the indexer loss off "
        "(dsa_indexer_loss_coeff=None)")
    assert not any(getattr(b, "_compiled_call_impl", None) for b in model.decoder.layers)
