"""The benchmarks' model and run configurations, and the config summary their records carry.

``bench_config`` is the small DeepSeek-V4 config of issue #7's training benchmark (the records
``bench/results/train-h200.json`` and ``parallel-h200x2.json``); bench.parallel runs it, and bench.rollout with
``--model bench``.
"""

from __future__ import annotations

from typing import Optional


def bench_config():
    """The small benchmark config: the tiny preset widened to a 6-layer model with every attention kind."""
    from core.config import preset

    return preset("tiny").replace(
        vocab_size=32768, dim=1024, n_layers=6, n_mtp_layers=0, compress_ratios=(0, 0, 4, 128, 4, 128),
        n_heads=16, head_dim=512, rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512,
        window_size=128, index_n_heads=16, index_head_dim=128, index_topk=512,
        n_routed_experts=16, n_activated_experts=2, moe_inter_dim=512, n_shared_experts=1,
        hc_mult=4, n_hash_layers=2,
    )


def bench_run_config(impl, c, *, hardware: str = "nvidia", kernels: Optional[str] = None, **choices):
    """The normalized run configuration of a benchmark run: ``kernels`` (default triton on nvidia, the reference
    kernels on the CPU); ``choices``: further ``Choices`` fields (parallel sizes, qkv format)."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    kernels = kernels or ("triton" if hardware == "nvidia" else "none")
    return normalize(Choices(impl=impl, kernel_backend=kernels, hardware=hardware, model=c, **choices),
                     make_host(third_party=False), model_name="bench")


def config_summary(c, seq, batch) -> dict:
    """The model's dimensions, sequence and batch as a record states them (the row's ``config``)."""
    return dict(vocab=c.vocab_size, hidden=c.dim, layers=c.n_layers, compress_ratios=list(c.compress_ratios),
                heads=c.n_heads, head_dim=c.head_dim, rope_head_dim=c.rope_head_dim, q_lora=c.q_lora_rank,
                o_groups=c.o_groups, o_lora=c.o_lora_rank, window=c.window_size,
                indexer=f"{c.index_n_heads}x{c.index_head_dim} top-{c.index_topk}",
                experts=f"{c.n_routed_experts} routed top-{c.n_activated_experts} x {c.moe_inter_dim} "
                        f"+ {c.n_shared_experts} shared",
                hc_mult=c.hc_mult, hash_layers=c.n_hash_layers, mtp_layers=c.n_mtp_layers,
                seq=seq, batch=batch, dtype="bf16", optimizer="AdamW")
