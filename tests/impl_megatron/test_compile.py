"""``engine.compile.compile_blocks`` on the megatron model: every block of a deep model runs compiled.

Blocks share their code, and a block's layer-specific constants (compress ratio, routing kind, the layer id
routing replay looks up) make dynamo compile one variant per layer. Past dynamo's default limit of 8
variants the remaining layers would silently run uncompiled (V4-Flash has 43 layers), so
``compile_blocks`` raises the limit to the number of blocks. Checked by tracing only (``backend="eager"``),
with dynamo told to fail instead of falling back."""

from __future__ import annotations

import torch

from tests.impl_megatron.conftest import run_config


def test_every_block_of_a_deep_model_compiles(tiny_config):
    from backends.megatron.impl import build_model
    from engine.compile import compile_blocks

    n = 12  # more layers than dynamo's default recompile limit of 8
    c = tiny_config.replace(n_layers=n, compress_ratios=(0, 0) + (4, 128) * 5, n_hash_layers=2, n_mtp_layers=0)
    torch.manual_seed(0)
    eager = build_model(c, run_config(c))
    torch.manual_seed(0)
    compiled = build_model(c, run_config(c))
    ids = torch.randint(0, c.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 50, 96])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        compile_blocks(compiled, backend="eager")
        out = compiled(ids, cu)
    torch.testing.assert_close(out, eager(ids, cu), atol=1e-5, rtol=1e-5)
