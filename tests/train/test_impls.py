"""The training loop on the two real implementations (``miles``: BSHD, ``megatron``: THD packed) on the CPU.

The GRPO job of each implementation in its default layout is tests/train/test_grpo.py (SFT lowering the
loss: test_sft.py; kill -9 and resume: test_resume.py). Here: a short fp32 GRPO job of miles in the THD
layout (the reference rollout engine holds the exported trained weights; the training model is the
implementation built from the run config's plugin record) with finite metrics, train/rollout log-prob
agreement, routing replay matching the rollout's routing and an MTP loss; per implementation, one SFT step
(megatron: with its indexer KL loss). Plus: the MTP loss sends no gradient to
the word embedding or the output head; the shared router's routing seam (learned trunk layers only)."""

import math

import pytest
import torch

from ._impl_helpers import run_config, small_config, write_data

IMPLS = ("miles", "megatron")
LAYOUTS = (("miles", "thd"),)   # the default layouts run in test_grpo.py
ROW_KEYS = ("reward_mean", "train_rollout_logprob_abs_diff", "train_rollout_kl", "loss", "grad_norm",
            "mtp_loss", "tokens_per_s")


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-{p[1] or 'default'}")
def grpo_run(request, tmp_path_factory):
    from reporting.metrics import read_metrics
    from orchestration import run_training

    impl, fmt = request.param
    c = small_config()
    rc = run_config(impl, c, fmt)
    assert rc.qkv_format == {"miles": fmt or "bshd", "megatron": "thd"}[impl]
    root = tmp_path_factory.mktemp(f"grpo_{impl}")
    result = run_training(rc, c, mode="grpo", steps=2, run_dir=root / "run",
                          data=write_data(root / "data.jsonl"), max_new_tokens=3, prompts_per_step=1,
                          group_size=3, lr=1e-3, mtp_coef=0.3, export_at_end=False, progress=False)
    return impl, read_metrics(root / "run"), result


def test_grpo_metrics_are_finite(grpo_run):
    impl, rows, _ = grpo_run
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ROW_KEYS:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (impl, k, r[k])
        assert r["weight_check_ok"] is True
        assert r["grad_norm"] > 0


def test_grpo_train_and_rollout_logprobs_agree(grpo_run):
    impl, rows, _ = grpo_run
    for r in rows:   # step 2 checks that the engine holds the weights the implementation trained
        assert r["train_rollout_logprob_abs_diff"] < 1e-4, (impl, r["train_rollout_logprob_abs_diff"])
        assert r["train_rollout_kl"] < 1e-6, impl


def test_grpo_routing_replay_matches_the_rollout(grpo_run):
    impl, rows, _ = grpo_run
    for r in rows:
        assert r["routing_replay_match"] == 1.0, impl


@pytest.mark.parametrize("impl", IMPLS)
def test_one_sft_step(impl, tmp_path):
    from reporting.metrics import read_metrics
    from orchestration import run_training

    c = small_config()
    extra = {"dsa_indexer_loss_coeff": 0.1} if impl == "megatron" else {}
    run_training(run_config(impl, c), c, mode="sft", steps=1, run_dir=tmp_path / "run",
                 data=write_data(tmp_path / "data.jsonl"), batch_size=2, mtp_coef=0.3, export_at_end=False,
                 progress=False, **extra)
    (r,) = read_metrics(tmp_path / "run")
    for k in ("loss", "grad_norm", "mtp_loss"):
        assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])
    if impl == "megatron":
        assert r["indexer_loss"] is not None and math.isfinite(r["indexer_loss"]) and r["indexer_loss"] > 0
    else:
        assert r["indexer_loss"] is None


@pytest.mark.parametrize("impl", IMPLS)
def test_mtp_loss_never_reaches_the_embedding_or_the_output_head(impl):
    """The MTP loss alone: no gradient on ``output_layer`` at all; on ``embedding.word_embeddings`` only
    through the trunk streams, never through the MTP block's own embedding lookup. The token at
    position S-2 is unique in the batch and is read (among the rows the loss uses) only by that
    lookup, so its embedding row must get no gradient - it does when the lookup is not detached."""
    from train.losses import mtp_loss
    from train.model import build_train_model

    c = small_config()
    m = build_train_model(c, run_config(impl, c), seed=3)
    assert m.impl == impl and m.qkv_format == run_config(impl, c).qkv_format
    S, special = 12, 300
    ids = torch.randint(2, 200, (2, S), generator=torch.Generator().manual_seed(0))
    ids[0, S - 2] = special
    mask = torch.ones(2, S - 1, dtype=torch.bool)
    emb = m.module.embedding.word_embeddings.weight
    head = m.module.output_layer.weight

    fwd = m.forward_train(ids, with_mtp=True)
    assert [tuple(t.shape) for t in fwd.mtp_logits] == [(2, S - 1, c.vocab_size)]
    mtp_loss(fwd.mtp_logits, ids, mask).backward()
    assert head.grad is None or not head.grad.any()
    assert emb.grad is not None and emb.grad.abs().sum() > 0          # the trunk is trained by MTP
    assert not emb.grad[special].any()
    mtp_grads = [p.grad for n, p in m.module.named_parameters() if n.startswith("mtp.") and p.requires_grad]
    assert mtp_grads and any(g is not None and g.any() for g in mtp_grads)

    # control: the implementation's own (undetached) MTP does reach both
    m.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert torch.equal(fwd.logprobs, m.forward_train(ids).logprobs)  # nothing was left detached
    from train.model import pack_rows

    if m.qkv_format == "thd":
        x, cu = pack_rows(ids)
        raw = m.module.mtp_logits(x, cu)[0][0].reshape(2, S - 1, -1)
    else:
        raw = m.module.mtp_logits(ids)[0]
    mtp_loss([raw], ids, mask).backward()
    assert head.grad is not None and head.grad.any()
    assert emb.grad[special].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_shared_router_seam_is_learned_trunk_layers_only(impl, monkeypatch):
    import train.model as tm
    from rollout.replay import RoutingRecorder

    c = small_config()
    m = tm.build_train_model(c, run_config(impl, c), seed=0)
    seen = []

    class Counting(RoutingRecorder):
        def __call__(self, layer, idx):
            seen.append((layer, tuple(idx.shape)))
            return super().__call__(layer, idx)

    monkeypatch.setattr(tm, "_hook_for", lambda routed, ids: Counting(*ids.shape))
    fwd = m.forward_train(torch.randint(2, 258, (2, 9)), with_mtp=True)
    k = c.n_activated_experts
    assert seen == [(1, (18, k)), (2, (18, k))]   # one trunk forward (MTP reuses its streams); hash layer 0
    assert sorted(fwd.routing_used) == [1, 2]     # and the MTP router (layer 3) never reach the seam


def test_train_impl_defaults_to_the_runs_implementation_and_reference_stays_explicit():
    from train.model import ImplTrainModel, ReferenceTrainModel, build_train_model
    from train.trainer import TrainConfig

    c = small_config()
    assert TrainConfig().train_impl is None
    assert isinstance(build_train_model(c, run_config("miles", c)), ImplTrainModel)
    assert isinstance(build_train_model(c, run_config("miles", c), impl="reference"), ReferenceTrainModel)
    assert isinstance(build_train_model(c), ReferenceTrainModel)
    with pytest.raises(ValueError, match="not the run's implementation"):
        build_train_model(c, run_config("miles", c), impl="megatron")
    with pytest.raises(ValueError, match="--impl miles does not take dsa_indexer_loss_coeff"):
        build_train_model(c, run_config("miles", c), dsa_indexer_loss_coeff=0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_replay_overrides_the_routing_of_a_drifted_implementation(impl):
    """Engine rollout from the implementation's synced weights; then the implementation's routers drift:
    on its own it routes differently, with replay it uses exactly the rollout's experts."""
    from train.model import build_train_model
    from rollout.replay import routing_match

    from ._replay import synced_rollout

    c = small_config()
    m = build_train_model(c, run_config(impl, c), seed=1)
    ids, routed = synced_rollout(m, c)
    with torch.no_grad():
        assert routing_match(m.forward_train(ids).routing_used, routed) == 1.0   # synced: same routing
        for layer in (1, 2):
            w = m.module.decoder.layers[layer].mlp.router.weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(layer)))
        assert routing_match(m.forward_train(ids).routing_used, routed) < 1.0
        assert routing_match(m.forward_train(ids, routing_replay=routed).routing_used, routed) == 1.0


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_option_compiles_the_blocks_in_place(impl):
    """``--compile`` (TrainConfig.compile_blocks) hands the implementation's blocks to torch.compile in place
    (parameter names unchanged); the reference training model refuses it with the fix."""
    from engine.compile import block_modules
    from train.model import build_train_model

    c = small_config()
    plain = build_train_model(c, run_config(impl, c), seed=0)
    compiled = build_train_model(c, run_config(impl, c), seed=0, compile_blocks=True)
    blocks = block_modules(compiled.module)
    assert len(blocks) == c.n_layers + c.n_mtp_layers
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert not any(b._compiled_call_impl is not None for b in block_modules(plain.module))
    assert [n for n, _ in compiled.native_tensors()] == [n for n, _ in plain.native_tensors()]
    with pytest.raises(ValueError, match="the reference training model has none: drop --compile"):
        build_train_model(c, None, impl="reference", compile_blocks=True)


@pytest.mark.parametrize("impl,choices,message", [
    ("miles", dict(tp=2, world=3), r"3 ranks do not split into --tp 2 x --cp 1 groups .* Fix: use a rank count"),
    ("megatron", dict(ep=4, world=2), r"--ep 4 runs over data-parallel ranks, and 2 ranks .* give 2\. Fix: use --ep 1 or 2"),
    ("miles", dict(ep=2, qkv_format="thd", max_tokens_per_rank=512),
     r"--ep 2 with --max-tokens-per-rank: .* Fix: drop --max-tokens-per-rank, or use --ep 1"),
])
def test_training_layouts_that_do_not_split_are_refused_by_the_table(impl, choices, message):
    """A training layout is checked against the run's rank count at parse time (rule train-layout), naming the
    fix; the same choices without the training job's limits are valid for scoring."""
    from core.combinations import InvalidCombination
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    host = make_host(third_party=False)
    with pytest.raises(InvalidCombination, match=message):
        normalize(Choices(impl=impl, model=small_config(), job="train", **choices), host)
    normalize(Choices(impl=impl, model=small_config(), job="score", **choices), host)


@pytest.mark.parametrize("impl,choices,world,dp", [
    ("miles", dict(tp=2), 2, 1), ("miles", dict(ep=2), 2, 2), ("megatron", dict(cp=2), 2, 1),
    ("megatron", dict(ep=2, world=4), 4, 4), ("miles", dict(tp=2, world=4), 4, 2),
])
def test_training_layouts_resolve_their_rank_count(impl, choices, world, dp):
    """The rank count defaults to tp x cp x ep; data parallel is what tensor and context parallel leave."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    fmt = {"qkv_format": "thd"} if choices.get("cp", 1) > 1 else {}
    run = normalize(Choices(impl=impl, model=small_config(), job="train", **fmt, **choices), make_host(third_party=False))
    assert (run.world, run.dp) == (world, dp)


def test_megatron_rows_of_one_shape_reuse_one_stream_layout(monkeypatch):
    """The megatron model takes a prebuilt stream layout; the trainer keeps one per row shape, so a micro-batch
    after the first derives no indices and reads no host facts again (about 60 host synchronisations each on a
    GPU). Kept or fresh, the layout gives the same log-probs; a new shape gets its own."""
    import train.model as tm

    c = small_config()
    m = tm.build_train_model(c, run_config("megatron", c), seed=0)
    built = []
    real = m.module.layout_for
    monkeypatch.setattr(m.module, "layout_for", lambda *a, **k: built.append(1) or real(*a, **k))
    ids = torch.randint(0, c.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first, again = m.forward_train(ids).logprobs, m.forward_train(ids).logprobs
        assert len(built) == 1 and torch.equal(first, again)
        m.forward_train(ids[:, :9])
        assert len(built) == 2 and len(m._layouts) == 2
        m._layouts.clear()                       # a fresh layout: the same numbers
        assert torch.equal(m.forward_train(ids).logprobs, first)
