"""A short GRPO job on CPU for both implementations (``miles``: BSHD, ``megatron``: THD packed; fp32, built
from a run config): complete, finite metrics whose total loss is the sum of its terms (the terms' values
against a hand-computed oracle: tests/train/test_rl_objective.py), train/rollout log-prob agreement, routing replay, weight sync checks,
TensorBoard events, plots, the HF export and the refusal to overwrite a run without --resume.

Plus two checks of the reference training model (``train_impl="reference"``, still a choice of the
trainer) that the implementation tests (tests/train/test_impls.py) do not cover: its routing-replay seam
(hash layers and MTP bypass it) and its indexer-replay seam."""

import json
import math

import pytest
import torch

from core.config import preset

REQUIRED = ("step", "reward_mean", "train_rollout_logprob_abs_diff", "train_rollout_kl", "loss", "grad_norm",
            "tokens_per_s", "time_rollout", "time_logprobs", "time_train", "time_update_weights")


IMPLS = ("miles", "megatron")


def small_config():
    # 3 trunk layers (layer 0 hash-routed, 1-2 learned; layer 1 CSA with an indexer) + 1 MTP layer
    return preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)


def write_data(path, n=16):
    rows = [{"prompt": f"{i}+{i}=", "reward": {"type": "valid_bytes"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_config(impl: str):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, model=small_config()), make_host(third_party=False), model_name="small")


@pytest.fixture(scope="module", params=IMPLS)
def grpo_run(request, tmp_path_factory):
    from orchestration import run_training

    rc = run_config(request.param)
    assert rc.qkv_format == {"miles": "bshd", "megatron": "thd"}[request.param]
    root = tmp_path_factory.mktemp(f"grpo_{request.param}")
    data = write_data(root / "data.jsonl")
    result = run_training(rc, small_config(), mode="grpo", steps=3, run_dir=root / "run", data=data,
                          max_new_tokens=4, prompts_per_step=2, group_size=4, save_every=2, lr=1e-3,
                          mtp_coef=0.3, kl_coef=0.05, progress=False)
    return root / "run", result, rc


def test_metrics_are_complete_and_finite(grpo_run):
    from reporting.metrics import read_metrics

    run = grpo_run[0]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for k in REQUIRED:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r[k])
        assert r["weight_check_ok"] is True
        assert r["grad_norm"] > 0  # valid_bytes rewards differ inside a group -> a real policy gradient
        assert r["mtp_loss"] is not None and math.isfinite(r["mtp_loss"])


def test_the_logged_loss_is_the_sum_of_its_logged_terms(grpo_run):
    """loss = pg_loss + kl_coef x kl_loss + mtp_coef x mtp_loss + indexer_loss (kl_coef 0.05, mtp_coef 0.3 above);
    the values of the policy and KL terms themselves are held to a hand-computed oracle in
    tests/train/test_rl_objective.py."""
    from reporting.metrics import read_metrics

    for r in read_metrics(grpo_run[0]):
        assert r["kl_loss"] is not None and r["mtp_loss"] > 0
        want = r["pg_loss"] + 0.05 * r["kl_loss"] + 0.3 * r["mtp_loss"] + (r["indexer_loss"] or 0.0)
        assert r["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
        assert 0.0 <= r["pg_clipfrac"] <= 1.0 and r["response_tokens"] > 0


def test_train_and_rollout_logprobs_agree_in_fp32(grpo_run):
    from reporting.metrics import read_metrics

    for r in read_metrics(grpo_run[0]):
        assert r["train_rollout_logprob_abs_diff"] < 1e-4
        assert r["train_rollout_kl"] < 1e-6
        # the sampled tokens' mean -log p estimates an entropy: at most the uniform policy's over the tiny
        # vocabulary (1,024 tokens), give or take the sampling noise of a few dozen tokens
        assert 0.0 < r["rollout_entropy"] < math.log(1024) + 1.0


def test_routing_replay_makes_train_routing_equal_the_rollouts(grpo_run):
    from reporting.metrics import read_metrics

    for r in read_metrics(grpo_run[0]):
        assert r["routing_replay_match"] == 1.0


def test_tensorboard_plots_and_export(grpo_run):
    from core.checkpoint import open_checkpoint
    from reporting.metrics import tensorboard_scalars
    from launchers.plot import plot_run

    run, result, _ = grpo_run
    tb = tensorboard_scalars(run)
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3]
    pngs = {p.name for p in plot_run(run)}
    assert {"reward_mean.png", "loss.png", "train_rollout_logprob_abs_diff.png", "train_rollout_kl.png",
            "rollout_entropy.png",
            "tokens_per_s.png", "summary.png"} <= pngs
    reader = open_checkpoint(result["hf_export"])
    assert "layers.0.ffn.gate.tid2eid" in reader.weight_map


def test_reference_model_replay_changes_routing_of_a_drifted_model_and_never_touches_hash_or_mtp():
    """A training model whose weights drifted from the engine's routes differently on its own; with
    replay it uses exactly the rollout's experts. Hash layers and MTP never reach the seam."""
    from kernels.reference.moe import routing_hook
    from train.model import build_train_model
    from rollout.replay import routing_match

    from ._replay import synced_rollout

    c = small_config()
    model = build_train_model(c, seed=1)
    ids, routed = synced_rollout(model, c)
    assert (routed[:, :, 0] == -1).all()            # layer 0 is hash-routed: nothing recorded
    with torch.no_grad():                            # drift the routers
        for layer in (1, 2):
            model.model.layers[layer].ffn.gate.weight.add_(torch.randn_like(model.model.layers[layer].ffn.gate.weight))
    seen = []
    with routing_hook(lambda layer, idx: seen.append(layer) or idx):
        model.model.mtp_logits(ids)
        model.model(ids)
    assert sorted(set(seen)) == [1, 2]               # MTP layer (3) and hash layer (0) bypass the seam
    free = model.forward_train(ids)
    assert routing_match(free.routing_used, routed) < 1.0
    replayed = model.forward_train(ids, routing_replay=routed)
    assert routing_match(replayed.routing_used, routed) == 1.0


def test_reference_model_indexer_replay_seam_is_off_by_default_and_replays_when_on():
    from train.model import build_train_model
    from rollout.replay import IndexerRecorder, IndexerReplayer

    c = small_config()
    m = build_train_model(c, seed=0)
    ids = torch.randint(2, 258, (1, 16))
    rec = IndexerRecorder(m.model)
    with rec.context():
        base = m.model(ids)
    assert list(rec.picks) == ["layers.1.attn.indexer"]
    assert torch.equal(m.model(ids), base)           # no hook installed: unchanged
    forced = {k: torch.zeros_like(v) for k, v in rec.picks.items()}
    rep = IndexerReplayer(m.model, forced)
    with rep.context():
        out = m.model(ids)
    assert rep.replayed == ["layers.1.attn.indexer"]
    assert not torch.equal(out, base)


def test_export_hf_from_the_run_folder_matches_the_end_of_run_export(grpo_run, tmp_path):
    from core.checkpoint import open_checkpoint
    from train.export import export_hf

    run, result, _ = grpo_run
    out = export_hf(run, tmp_path / "hf")
    a = dict(open_checkpoint(out).iter_tensors(progress=False))
    b = dict(open_checkpoint(result["hf_export"]).iter_tensors(progress=False))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_existing_run_needs_resume(grpo_run):
    from orchestration import run_training

    from core.errors import UserInputError

    with pytest.raises(UserInputError, match="--resume"):
        run_training(grpo_run[2], small_config(), mode="grpo", steps=1, run_dir=grpo_run[0], progress=False)
