"""``true_on_policy`` (docs/rollout.md#true-on-policy): the rollout log-probabilities are the trainer's
recomputation bit for bit, on the CPU in fp32 with the reference training model and the built-in engine.

* per token: the engine's samples (stop tokens and early stops included, top-p on) scored by the
  trainer's ``forward_train`` on the padded ``[n, prompt + max_new_tokens]`` batch are ``torch.equal``
  to the engine's log-probs, and the routing the engine recorded is the trainer's own;
* a GRPO run: ``train_rollout_logprob_abs_diff`` and ``train_rollout_kl`` are exactly 0.0 at every step;
* every combination it does not make exact is refused before any work, naming the fix."""

import json

import pytest
import torch

from core.config import preset


def _engine_and_model(top_p=1.0):
    from train.engines import ReferenceEngine
    from train.model import ReferenceTrainModel

    c = preset("tiny")
    model = ReferenceTrainModel(c, seed=3).eval()
    model.row_invariant = True
    eng = ReferenceEngine(c, kv_cache=False, true_on_policy=True)
    eng.begin_update(0)
    eng.load_bucket(list(model.official_state().items()))
    eng.finish_update()
    return c, model, eng


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_engine_logprobs_equal_trainer_per_token(top_p):
    from train.engines import SamplingParams

    c, model, eng = _engine_and_model()
    T = 7
    vocab = c.vocab_size
    params = SamplingParams(temperature=0.8, top_p=top_p, max_new_tokens=T, stop_token_ids=tuple(range(5, vocab, 6)), top_k=0)
    prompts = [[3, 17, 29, 4], [8] * 11, [2]]
    groups = eng.generate(prompts, params, n=3, seed=7)
    stopped_early = 0
    for prompt, samples in zip(prompts, groups):
        P = len(prompt)
        ids = torch.full((len(samples), P + T), params.stop_token_ids[0], dtype=torch.long)
        routed = torch.full((len(samples), P + T, c.n_layers, c.n_activated_experts), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, :P + len(s.response_ids)] = torch.tensor(prompt + s.response_ids)
            routed[i, :s.routed_experts.shape[0]] = s.routed_experts
            stopped_early += len(s.response_ids) < T
            assert all(0 <= t < vocab for t in s.response_ids)
        with torch.no_grad():
            replayed = model.forward_train(ids, routing_replay=routed, temperature=0.8).logprobs
            free = model.forward_train(ids, temperature=0.8)      # the trainer's own routing, not replayed
        for i, s in enumerate(samples):
            R = len(s.response_ids)
            assert torch.equal(replayed[i, P - 1:P - 1 + R], s.logprobs), (prompt, i)
            assert torch.equal(free.logprobs[i, P - 1:P - 1 + R], s.logprobs), (prompt, i)
            for layer, idx in free.routing_used.items():   # the engine recorded the trainer's choices
                assert torch.equal(idx[i, :P + R - 1], s.routed_experts[:P + R - 1, layer]), (prompt, i, layer)
    assert stopped_early > 0                               # the padded tails are exercised


def test_grpo_diff_exactly_zero(tmp_path):
    from train.trainer import run_training

    run = tmp_path / "run"
    run_training(None, "tiny", mode="grpo", steps=3, run_dir=run, progress=False, train_impl="reference",
                 true_on_policy=True, save_every=100, export_at_end=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["train_rollout_kl"] == 0.0, r
        assert r["routing_replay_match"] == 1.0


def test_refusals():
    from core.config import ConfigError
    from train.config_checks import check_true_on_policy
    from train.engines import ReferenceEngine
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="Fix: set train_impl=reference"):
        TrainConfig(true_on_policy=True)
    for kw, fix in ((dict(micro_batch_size=2), "drop micro_batch_size"),
                    (dict(max_tokens_per_rank=64), "drop max_tokens_per_rank"),
                    (dict(async_rollout=True), "drop async_rollout"),
                    (dict(colocate=True), "drop colocate"),
                    (dict(rollout_cuda_graphs=True), "drop rollout_cuda_graphs")):
        with pytest.raises(ConfigError, match=fix):
            TrainConfig(true_on_policy=True, train_impl="reference", **kw)
    TrainConfig(true_on_policy=False, micro_batch_size=2)         # the default path is unchanged
    c = preset("tiny")
    with pytest.raises(ValueError, match="kv_cache=True"):
        ReferenceEngine(c, true_on_policy=True)
    with pytest.raises(ValueError, match="dtype torch.bfloat16"):
        ReferenceEngine(c, kv_cache=False, dtype=torch.bfloat16, true_on_policy=True)

    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    cfg = TrainConfig(true_on_policy=True, train_impl="reference")
    host = make_host(third_party=False)

    def rc(**kw):
        return normalize(Choices(impl="miles", model=c, **kw), host, model_name="tiny")

    from core.combinations import InvalidCombination

    check_true_on_policy(rc(), cfg)                                 # CPU, fp32, bf16 publishing, one rank
    for kw, fix in ((dict(quant="fp8"), "use --quant bf16"), (dict(hardware="nvidia"), "use --hardware cpu"),
                    (dict(dtype="bf16"), "use --dtype fp32"), (dict(tp=2), "train on one rank")):
        with pytest.raises(InvalidCombination, match=f"Fix: {fix}"):      # rule true-on-policy
            check_true_on_policy(rc(**kw), cfg)
