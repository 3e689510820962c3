"""Tensor parallel 2 (two gloo processes on the CPU) vs tensor parallel 1 for the miles model:
log-probs, loss, gradients (TP-gathered, official names) and the loss after one Adam step."""

from __future__ import annotations

import torch

from tests.cpu_ranks import PORT, spawn_cpu_ranks
from core.checkpoint import prepare_checkpoint

from . import _tp_worker
from ._helpers import TINY, grad_norm, miles_model, miles_step, official_from_checkpoint, perturb, token_ids

TOL = 1e-5  # log-probs, loss (fp32; only the reduction order differs)
GRAD_ATOL = 1e-6


def test_tp2_matches_tp1(tmp_path):
    ckpt = prepare_checkpoint(tmp_path / "ckpt", TINY, dtype="bf16", seed=0)
    official = perturb(official_from_checkpoint(ckpt))
    weights = tmp_path / "official.pt"
    torch.save(official, weights)
    out = tmp_path / "tp2.pt"
    spawn_cpu_ranks(_tp_worker.run, (2, PORT, str(weights), str(out)), 2)
    tp2 = torch.load(out)

    m = miles_model(official, tp=1)
    with torch.no_grad():
        for S in (37, 140):
            lp = m.logprobs(token_ids(2, S, 200 + S))
            assert (lp - tp2["logprobs"][S]).abs().max().item() <= TOL
    loss, grads, after = miles_step(m, token_ids(2, 140, 11))
    assert abs(loss - tp2["loss"]) <= TOL
    assert set(grads) == set(tp2["grads"])
    for n, g in grads.items():
        assert (g - tp2["grads"][n]).abs().max().item() <= GRAD_ATOL, n
    assert abs(grad_norm(grads) - grad_norm(tp2["grads"])) <= 1e-5 * grad_norm(grads)
    assert abs(after - tp2["after"]) <= 1e-4

    # the heads / groups / vocab / expert ffn really were split
    shapes = tp2["local_shapes"]
    c = TINY
    sa = "decoder.layers.0.self_attention."
    assert shapes[sa + "linear_q_up_proj.weight"] == (c.n_heads * c.head_dim // 2, c.q_lora_rank)
    assert shapes[sa + "linear_o_group_proj"] == (c.o_groups * c.o_lora_rank // 2, c.n_heads * c.head_dim // c.o_groups)
    assert shapes[sa + "core_attention.attn_sink"] == (c.n_heads // 2,)
    assert shapes["embedding.word_embeddings.weight"] == (c.vocab_size // 2, c.dim)
    assert shapes["decoder.layers.0.mlp.experts.linear_fc1.weight0"] == (c.moe_inter_dim, c.dim)
