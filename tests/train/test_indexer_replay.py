"""Indexer replay (``indexer_replay=true``): the built-in engine records each CSA layer's Lightning Indexer picks
for every position it feeds, and the trainer's forward uses exactly those picks instead of its own.

* the engine's recorded picks (``Sample.indexer_picks``) equal the reference model's full-forward picks of the
  same sequence at every prompt and generated position, through the cached engine (prefill, the static decode
  step, slots reused and packed; eager, and traced whole by ``torch.compile``) and the uncached one; an engine
  not asked records nothing;
* replay: a trainer whose indexer weights are perturbed (so its own picks differ) gives the unperturbed model's
  log-probs bit for bit when it replays the engine's picks, and other log-probs without; for the reference
  training model, miles (BSHD, and THD with a segment per row: the segments' compressed offsets) and megatron
  (THD, rows and a packed micro-batch of the real tokens);
* a GRPO run through ``orchestration.run_training`` with ``indexer_replay=true`` (miles, also with the engine
  generating in a thread: ``async_rollout``; megatron with packed micro-batches) logs ``indexer_replay_match``;
* every combination that is not built is refused before any work, with the fix.

Sequences run past ``4 * index_topk`` = 32 tokens, so the indexer truncates (with fewer visible entries every
row picks all of them and replay would change nothing)."""

from __future__ import annotations

import pytest
import torch

from core.config import preset

# 2 trunk layers, both CSA (layer 0 hash-routed, layer 1 learned), 1 MTP layer
CFG = preset("tiny").replace(n_layers=2, compress_ratios=(4, 4, 0), n_hash_layers=1)
PROMPTS = [list(range(2, 36)), list(range(40, 47))]


def _params(T=8):
    from rollout.reference_engine import SamplingParams

    return SamplingParams(temperature=1.0, max_new_tokens=T)


def _engine(model, **kw):
    from rollout.reference_engine import ReferenceEngine
    from rollout.weight_sync import sync_weights

    e = ReferenceEngine(CFG, **kw)
    assert sync_weights(model, e, version=1).ok
    return e


def _full_forward_picks(model, seq):
    """``[len(seq) - 1, n_csa, index_topk]``: the reference model's own picks of ``seq`` in one forward."""
    from rollout.replay import IndexerPicksRecorder

    rec = IndexerPicksRecorder(model, CFG)
    with rec.context(), torch.no_grad():
        model(torch.tensor([seq]))
    return rec.as_tensor(1, len(seq))[0, :-1]


@pytest.fixture(scope="module")
def reference():
    from train.model import build_train_model

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    return build_train_model(CFG, seed=0)


@pytest.mark.parametrize("kw", [dict(kv_cache=True, max_slots=3), dict(kv_cache=True, max_slots=1, compile="aot_eager"),
                                dict(kv_cache=False)], ids=["cached", "compiled", "uncached"])
def test_the_engine_records_the_full_forwards_picks(reference, kw):
    T, prompts = (8, PROMPTS) if kw["kv_cache"] else (3, PROMPTS[:1])      # the uncached engine is slow
    e = _engine(reference, record_indexer=True, **kw)
    groups = e.generate(prompts, _params(T), n=2, seed=3)
    for group in groups:
        for s in group:
            seq = s.prompt_ids + s.response_ids
            got = s.indexer_picks
            assert got.dtype == torch.int32 and got.shape == (len(seq) - 1, 2, CFG.index_topk)
            assert torch.equal(got, _full_forward_picks(reference.model, seq))
    long = groups[0][0]
    assert (long.indexer_picks >= 0).sum(-1).max() == CFG.index_topk            # the indexer truncated
    assert (long.indexer_picks[len(long.prompt_ids):] >= 0).any()               # decode positions recorded
    assert _engine(reference, kv_cache=kw["kv_cache"]).generate(PROMPTS[:1], _params(2), n=1, seed=0)[0][0] \
        .indexer_picks is None                                                  # not asked: nothing recorded


def _perturbed(model, impl):
    """A copy of ``model`` whose indexers' query projections are perturbed (its own picks change)."""
    other = _train_model(impl, None)
    other.load_native_state(dict(model.native_tensors()))
    with torch.no_grad():
        for name, p in other.named_parameters():
            if ".indexer." in name and ("wq_b" in name) and "mtp" not in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    return other


def _replay_batch(model, engine):
    from rollout.replay import batch_indexer_picks

    samples = [s for g in engine.generate(PROMPTS, _params(), n=1, seed=5) for s in g]
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    S = max(len(q) for q in seqs)
    ids = torch.tensor([q + [1] * (S - len(q)) for q in seqs])
    return ids, batch_indexer_picks(samples, S), [len(q) for q in seqs]


def _train_model(impl, reference):
    from tests.train._impl_helpers import run_config
    from train.model import build_train_model

    if impl == "reference":
        return reference if reference is not None else build_train_model(CFG, seed=1)
    name, _, fmt = impl.partition("-")        # miles-thd: miles with --qkv-format thd
    return build_train_model(CFG, run_config(name, CFG, "thd" if fmt else None), seed=0)


@pytest.mark.parametrize("impl", ["reference", "miles", "miles-thd", "megatron", "megatron-packed"])
def test_replay_makes_the_trainer_attend_to_exactly_the_recorded_picks(reference, impl):
    model = _train_model(impl, reference).eval()
    ids, picks, lengths = _replay_batch(model, _engine(model, record_indexer=True))
    drifted = _perturbed(model, impl).eval()
    kw = {"lengths": lengths} if impl.endswith("-packed") else {}   # one packed stream of the real tokens
    with torch.no_grad():
        base = model.forward_train(ids, **kw)
        same = model.forward_train(ids, indexer_replay=picks, **kw)
        own = drifted.forward_train(ids, **kw)
        rep = drifted.forward_train(ids, indexer_replay=picks, **kw)
    valid = torch.arange(ids.shape[1] - 1)[None, :] < torch.tensor(lengths)[:, None] - 1

    def eq(a, b):
        return torch.equal(a.logprobs[valid], b.logprobs[valid])

    assert eq(same, base) and same.indexer_replay[0] == same.indexer_replay[1] > 0   # own picks = recorded
    assert not eq(own, base)                                  # the drifted indexer picks other entries ...
    assert eq(rep, base)                                      # ... and replay restores the recorded ones
    s, rows = rep.indexer_replay
    assert rows == same.indexer_replay[1] and s < rows         # the metric sees the drift


def test_a_replayed_forward_must_reach_every_csa_layer(reference):
    from rollout.replay import IndexerPicksReplayer

    picks = torch.full((1, 8, 3, CFG.index_topk), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="3 CSA layers recorded, the model has 2"):
        IndexerPicksReplayer(reference.model, CFG, picks)
    rep = IndexerPicksReplayer(reference.model, CFG, picks[:, :, :2])
    with pytest.raises(NotImplementedError, match="does not call kernels.reference.indexer's indexer_hook"):
        rep.result("x")                                        # no forward went through the seam


def _write_data(path, n=8):
    import json

    rows = [{"prompt": "abcdefghijklmnopqrstuvwxyz" + f"{i}+{i}=", "reward": {"type": "valid_bytes"}}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("impl, packed, async_rollout", [("miles", None, False), ("megatron", 256, False),
                                                         ("miles", None, True)],
                         ids=["miles", "megatron-packed", "miles-async"])
def test_grpo_with_indexer_replay_logs_the_match(tmp_path, impl, packed, async_rollout):
    from orchestration import run_training
    from tests.train._impl_helpers import run_config
    from reporting.metrics import read_metrics

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    run_training(run_config(impl, CFG), CFG, mode="grpo", steps=2, run_dir=tmp_path / "run",
                 data=_write_data(tmp_path / "data.jsonl"), max_new_tokens=6, prompts_per_step=1, group_size=2,
                 lr=1e-3, kl_coef=0.05, mtp_coef=0.3, indexer_replay=True, max_tokens_per_rank=packed,
                 async_rollout=async_rollout, progress=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(("packing_efficiency" in r) == bool(packed) for r in rows)
    for r in rows:   # the engine's cached decode and the trainer's full forward pick alike in fp32 (async: step 2
        lag = r.get("rollout_policy_lag", 0)      # trains on samples of the weights before step 1's update)
        assert (r["indexer_replay_match"] == 1.0) if lag == 0 else 0.0 <= r["indexer_replay_match"] <= 1.0, r
        assert r["rollout_policy_lag"] == (1 if async_rollout and r["step"] == 2 else 0)


@pytest.mark.parametrize("kw, says", [
    (dict(true_on_policy=True), "true_on_policy.*Fix: drop true_on_policy"),
])
def test_unbuilt_training_options_are_refused(kw, says):
    from core.config import ConfigError
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match=f"'indexer_replay' is not built with {says}, or drop indexer_replay"):
        TrainConfig(indexer_replay=True, **kw)


@pytest.mark.parametrize("choices, says", [
    (dict(rollout_engine="sglang", rollout_url="http://127.0.0.1:1"), "--rollout-engine sglang .*Fix: use "
                                                                      "--rollout-engine reference"),
    (dict(cp=2), "--cp 2 .*Fix: use --cp 1"),
    (dict(pp=2, job="train"), "--pp 2 .*Fix: use --pp 1"),
    (dict(orchestrator="ray"), "--orchestrator ray .*Fix: use --orchestrator local"),
])
def test_unbuilt_runs_are_refused(choices, says):
    from core.config import ConfigError
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from train.config_checks import check_train_options
    from train.trainer import TrainConfig

    cfg = TrainConfig(indexer_replay=True)
    rc = normalize(Choices(model=CFG, **choices), make_host(third_party=False), model_name="small")
    with pytest.raises(ConfigError, match=f"'indexer_replay' is not built with {says}, or drop indexer_replay"):
        check_train_options(rc, cfg)
    for built in ("miles", "megatron"):
        check_train_options(normalize(Choices(model=CFG, impl=built), make_host(third_party=False),
                                      model_name="small"), cfg)


def test_dsv4_train_replays_the_indexer_and_refuses_what_is_not_built(tmp_path):
    """``dsv4 train ... indexer_replay=true`` as a user types it (the tiny preset: one CSA layer)."""
    import json

    from click.testing import CliRunner

    from launchers.cli import main

    def dsv4(*args):
        return CliRunner().invoke(main, [str(a) for a in args])

    common = ("train", "--hardware", "cpu", "--steps", 1, "prompts_per_step=1", "group_size=2", "max_new_tokens=4",
              "indexer_replay=true")
    res = dsv4(*common, "--run-dir", tmp_path / "run")
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["indexer_replay_match"] == 1.0
    res = dsv4(*common, "--run-dir", tmp_path / "cp", "--qkv-format", "thd", "--cp", 2)
    assert res.exit_code != 0
    assert "'indexer_replay' is not built with --cp 2" in res.output
    assert "Fix: use --cp 1" in res.output and not (tmp_path / "cp" / "metrics.jsonl").exists()


def test_tensor_parallel_ranks_replay_the_leaders_picks(tmp_path):
    """``--tp 2``: the leader's samples (picks included) are broadcast to the group, and each rank's forward must
    replay them in every CSA layer (building the replay batch refuses samples without picks, and the replayer
    refuses a forward that skipped a CSA layer), so a finished run shows both ranks replayed; its steps equal the
    one-rank run's."""
    from tests.train._cli import metrics_rows, train_cli

    args = ("--steps", "2", "-q", "prompts_per_step=1", "group_size=2", "max_new_tokens=6", "indexer_replay=true",
            "lr=1e-3")
    train_cli(tmp_path / "one", *args)
    train_cli(tmp_path / "tp2", "--tp", "2", *args)
    one, tp2 = metrics_rows(tmp_path / "one"), metrics_rows(tmp_path / "tp2")
    assert [r["world_size"] for r in tp2] == [2, 2]
    for a, b in zip(one, tp2, strict=True):
        assert b["indexer_replay_match"] == a["indexer_replay_match"] == 1.0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)

