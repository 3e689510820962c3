"""Memory knobs of the trainer (issue #17 item 5): activation recomputation and micro-batches.

Both trade memory for time and must not change the step: recomputed blocks give the same gradients as stored
activations (with the routing of the first pass, replayed or not), and a step split into micro-batches with
accumulated gradients gives the same loss and gradient norm as one batch (fp32 on the CPU: to 1e-5)."""

import pytest
import torch

from ._impl_helpers import run_config, small_config, write_data


def _grads(impl, recompute, replay):
    from train.model import build_train_model

    c = small_config()
    m = build_train_model(c, run_config(impl, c), seed=0, recompute=recompute)
    ids = torch.randint(2, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    routing = None
    if replay:
        with torch.no_grad():
            first = m.forward_train(ids)
        routing = torch.full((2, 24, c.n_layers, c.n_activated_experts), -1, dtype=torch.long)
        for layer, idx in first.routing_used.items():
            routing[:, :, layer] = idx.reshape(2, 24, -1)
    calls = []
    for block in m.module.decoder.layers:       # the MoE runs inside the block: again when the block is recomputed
        block.mlp.register_forward_pre_hook(lambda mod, args: calls.append(1))
    fwd = m.forward_train(ids, routing_replay=routing, with_mtp=True)
    (fwd.logprobs.sum() + sum(x.float().logsumexp(-1).sum() for x in fwd.mtp_logits) * 1e-3).backward()
    return {n: p.grad.clone() for n, p in m.module.named_parameters() if p.grad is not None}, len(calls)


@pytest.mark.parametrize("impl", ["miles", "megatron"])
@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("replay", [False, True])
def test_recomputed_blocks_give_the_stored_activations_gradients(impl, mode, replay):
    want, plain_calls = _grads(impl, "none", replay)
    got, calls = _grads(impl, mode, replay)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
    # the MoE runs again in the backward pass for "full" (selective recomputes the attention only)
    assert calls == (2 * plain_calls if mode == "full" else plain_calls)


def test_recompute_is_refused_for_the_reference_model_and_unknown_modes():
    from core.config import ConfigError
    from train.model import build_train_model
    from train.trainer import TrainConfig

    with pytest.raises(ValueError, match="the reference training model has none"):
        build_train_model(small_config(), None, recompute="full")
    with pytest.raises(ConfigError, match="'recompute' = 'some'.*none, selective, full"):
        TrainConfig(recompute="some")
    with pytest.raises(ConfigError, match="both size micro-batches"):
        TrainConfig(micro_batch_size=2, max_tokens_per_rank=256)
    for other in ("micro_batch_size", "max_tokens_per_rank"):
        with pytest.raises(ConfigError, match=f"'micro_batch_tokens' and '{other}' both size GRPO's micro-batches"):
            TrainConfig(micro_batch_tokens=512, **{other: 2})
    with pytest.raises(ConfigError, match="'micro_batch_tokens' = 0"):
        TrainConfig(micro_batch_tokens=0)


def test_micro_batch_tokens_is_refused_where_nothing_reads_it():
    from core.config import ConfigError
    from train.config_checks import check_mode, check_static_shapes
    from train.trainer import TrainConfig

    cfg = TrainConfig(micro_batch_tokens=4096)
    check_mode("grpo", cfg)
    with pytest.raises(ConfigError, match="--mode sft does not read it.*Fix: micro_batch_size=N rows"):
        check_mode("sft", cfg)
    check_static_shapes(cfg, packed=False, rows=8)
    with pytest.raises(ConfigError, match="packs its samples into THD micro-batches.*--max-tokens-per-rank N"):
        check_static_shapes(cfg, packed=True, rows=8)
    with pytest.raises(ConfigError, match="micro_batch_tokens regroups the samples"):
        TrainConfig(micro_batch_tokens=4096, true_on_policy=True, train_impl="reference")


@pytest.mark.parametrize("n, longest, budget, pp, want", [
    (64, 170, 8192, 1, 32),     # the Flash-shaped GRPO bench: 64 samples of <= 170 tokens -> two micro-batches
    (64, 300, 8192, 1, 16),     # 27 would fit; 16 is the largest divisor of 64 that does
    (64, 170, 4096, 1, 16),
    (8, 4096, 8192, 1, 2),      # long samples: a group's rows split
    (8, 9000, 8192, 1, 1),      # not even one row fits: one row each, never none
    (12, 100, 1 << 20, 1, 12),  # everything in one
    (12, 100, 1 << 20, 4, 3),   # --pp 4: at least four micro-batches
    (3, 100, 1 << 20, 4, 1),    # fewer rows than stages: one row each
    (7, 100, 500, 1, 1),        # a prime count: divisors 1 and 7 only
])
def test_budget_rows_is_the_largest_divisor_that_fits(n, longest, budget, pp, want):
    from core.packing import budget_rows

    got = budget_rows(n, longest, budget, min_chunks=pp)
    assert got == want
    assert n % got == 0 and (got == 1 or (got * longest <= budget and n // got >= min(pp, n)))


@pytest.mark.parametrize("mode", ["sft", "grpo"])
def test_micro_batches_take_the_one_batch_step(tmp_path, mode):
    from reporting.metrics import read_metrics
    from orchestration import run_training

    c = small_config()
    kw = dict(mode=mode, steps=1, progress=False, export_at_end=False, batch_size=4, prompts_per_step=2,
              group_size=4, lr=1e-3, data=write_data(tmp_path / "d.jsonl"))
    rows = {}
    runs = [("one", {}), ("micro", dict(micro_batch_size=2))]
    if mode == "grpo":              # a token budget below one sample: a micro-batch per sample
        runs.append(("tokens", dict(micro_batch_tokens=1)))
    for name, opts in runs:
        run_training(run_config("miles", c), c, run_dir=tmp_path / name, **opts, **kw)
        rows[name] = read_metrics(tmp_path / name)[0]
    assert rows["micro"]["micro_batches"] == (2 if mode == "sft" else 4)
    # GRPO's default budget (8,192 padded tokens) holds both groups' 8 short samples in one micro-batch
    assert rows["one"]["micro_batches"] == 1
    if mode == "grpo":
        assert rows["tokens"]["micro_batches"] == 8
    # GRPO's first-step loss is a sum of normalized advantages (zero up to rounding): its gradient is not
    for name in rows:
        assert rows[name]["loss"] == pytest.approx(rows["one"]["loss"], rel=1e-5, abs=1e-7)
        assert rows[name]["grad_norm"] == pytest.approx(rows["one"]["grad_norm"], rel=1e-5)
    assert rows["one"]["grad_norm"] > 0
