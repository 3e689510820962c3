"""FLOPs per training step and the MFU of the training benchmarks (``bench.train_cli``, ``bench.parallel``).

One formula for every benchmark, so their MFU figures compare; tests/train/test_bench_flops.py checks it by
hand and against the reference model's parameter list, and every committed record's MFU against it.

MFU = FLOPs per step / step time / (GPUs x 989e12), where 989 TFLOP/s is the H200's dense bf16 peak (the SXM
data sheet number, without sparsity). FLOPs per step = 6 x active params x tokens + attention FLOPs:

* active params: every parameter except the input embedding table, routed experts counted at
  ``n_activated / n_routed`` of their size (the LM head, mHC, compressors and indexer are counted);
* attention: ``12 x heads x head_dim x sum over layers and query tokens of the selected keys``
  (QK^T and PV, 2 FLOPs per MAC, forward + 2x backward). Selected keys for the query at position p:
  window layers ``min(p+1, window)``; CSA (ratio 4) layers ``min(p+1, window) + min(top-k, (p+1)//4)``;
  HCA (ratio 128) layers ``min(p+1, window) + (p+1)//128``. The indexer's own scoring is not counted.

The MTP layers are not part of the count.
"""

from __future__ import annotations

H200_BF16_DENSE_TFLOPS = 989.0


def selected_keys(c, seq: int) -> int:
    """Sum over trunk layers and query positions of the keys the sparse attention reads."""
    total = 0
    for r in c.compress_ratios[: c.n_layers]:
        for p in range(seq):
            k = min(p + 1, c.window_size)
            if r == 4:
                k += min(c.index_topk, (p + 1) // 4)
            elif r > 0:
                k += (p + 1) // r
            total += k
    return total


def active_params(c) -> int:
    """Analytic active parameter count (the embedding table excluded, routed experts at top-k / E)."""
    d, n = c.dim, c.hc_mult
    total = c.vocab_size * d + d + (n * d) * n + n + 1  # head, final norm, mHC head
    for i in range(c.n_layers):
        r = c.compress_ratios[i]
        attn = d + d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.n_heads * c.head_dim
        attn += d * c.head_dim + c.head_dim + c.n_heads  # wkv, kv_norm, sinks
        attn += (c.n_heads * c.head_dim // c.o_groups) * c.o_groups * c.o_lora_rank
        attn += c.o_groups * c.o_lora_rank * d
        if r:
            coff = 2 if r == 4 else 1
            attn += 2 * d * coff * c.head_dim + c.head_dim + r * coff * c.head_dim
            if r == 4:
                ih = c.index_head_dim
                attn += 2 * d * coff * ih + ih + r * coff * ih
                attn += c.q_lora_rank * c.index_n_heads * ih + d * c.index_n_heads
        hc = 2 * ((n * d) * (2 * n + n * n) + (2 * n + n * n) + 3)
        e = 3 * d * c.moe_inter_dim
        ffn = d + c.n_shared_experts * e + e * c.n_activated_experts
        ffn += c.n_routed_experts * d  # the router's weight: hash layers too (their expert weights are its scores)
        total += attn + hc + ffn
    return total


def step_flops(c, seq: int, batch: int, n_active: int) -> dict:
    """FLOPs of one training step on ``batch`` sequences of ``seq`` tokens: ``{total, dense, attention}``."""
    tokens = seq * batch
    dense = 6 * n_active * tokens
    attn = 12 * c.n_heads * c.head_dim * selected_keys(c, seq) * batch
    return dict(total=dense + attn, dense=dense, attention=attn)
