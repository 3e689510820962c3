"""``true_on_policy`` (docs/rollout.md#true-on-policy): the rollout log-probabilities are the trainer's
recomputation bit for bit, with the reference training model and the built-in engine (CPU here; one GPU in bf16:
test_true_on_policy_gpu.py).

* per token, fp32 and bf16: the engine's samples (stop tokens and early stops included, top-p on) scored by the
  trainer's ``forward_train`` on the padded ``[n, prompt + max_new_tokens]`` batch are ``torch.equal`` to the
  engine's log-probs, and the routing the engine recorded is the trainer's own; in bf16 the trainer's fp32 tensors
  (RMSNorm weights, moved off the bf16 grid as training moves them) reach the engine through the lossless weight
  sync, and the control (the default sync, which sends them in bf16) is not equal;
* a GRPO run (fp32 without a run config, bf16 with a ``--hardware cpu --dtype bf16`` one):
  ``train_rollout_logprob_abs_diff`` and ``train_rollout_kl`` are exactly 0.0 at every step;
* every combination it does not make exact is refused before any work, naming the fix."""

import json

import pytest
import torch

from core.config import preset


def _engine_and_model(dtype=torch.float32, lossless=True):
    from rollout.reference_engine import ReferenceEngine
    from train.model import ReferenceTrainModel
    from rollout.weight_sync import sync_weights

    c = preset("tiny")
    model = ReferenceTrainModel(c, seed=3, dtype=dtype).eval()
    if dtype != torch.float32:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():             # fp32-held tensors off the bf16 grid, as an optimizer step leaves them
            for p in model.parameters():
                if p.dtype == torch.float32:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    model.row_invariant = True
    eng = ReferenceEngine(c, kv_cache=False, dtype=dtype, true_on_policy=True)
    assert sync_weights(model, eng, version=0, engine_dtype=dtype, lossless=lossless).ok
    return c, model, eng


def _score(c, model, eng, top_p, T=7, n=3, same_routing=True):
    """(per-sample pairs of the trainer's and the engine's log-probs, samples that stopped early); with
    ``same_routing`` the routing the engine recorded is asserted to be the trainer's own (not for the control,
    whose engine holds other weights: a near-tied router choice may differ there too)."""
    from rollout.reference_engine import SamplingParams

    vocab = c.vocab_size
    params = SamplingParams(temperature=0.8, top_p=top_p, max_new_tokens=T, stop_token_ids=tuple(range(5, vocab, 6)), top_k=0)
    prompts = [[3, 17, 29, 4], [8] * 11, [2]]
    groups = eng.generate(prompts, params, n=n, seed=7)
    pairs, stopped_early = [], 0
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
            pairs += [(replayed[i, P - 1:P - 1 + R], s.logprobs), (free.logprobs[i, P - 1:P - 1 + R], s.logprobs)]
            for layer, idx in (free.routing_used.items() if same_routing else ()):   # the trainer's choices
                assert torch.equal(idx[i, :P + R - 1], s.routed_experts[:P + R - 1, layer]), (prompt, i, layer)
    return pairs, stopped_early


def _rows_are_batch_invariant(model, vocab: int) -> bool:
    """Whether this machine's CPU GEMMs give a row the same result whatever the rows beside it: the engine's
    forward batches every prompt's samples (more rows than the trainer's per-prompt batch), and exactness
    needs the two to agree bit for bit. MKL's AVX-512 sgemm does not for some shapes (seen on the 2-core
    Xeon of 2026-12-02: 4.8e-7 apart in fp32); its AVX2 kernels did on the machines before."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (9, 18), generator=g)
    with torch.no_grad():
        few = model.forward_train(ids[:3, :11]).logprobs
        many = model.forward_train(ids).logprobs[:3, :10]      # more rows, longer: as the engine's batch
    return torch.equal(few, many)


@pytest.mark.parametrize("dtype,top_p", [(torch.float32, 1.0), (torch.float32, 0.9), (torch.bfloat16, 0.9)])
def test_engine_logprobs_equal_trainer_per_token(dtype, top_p):
    c, model, eng = _engine_and_model(dtype)
    if not _rows_are_batch_invariant(model, c.vocab_size):
        pytest.skip("this CPU's GEMMs are not batch-invariant for the tiny model's shapes, so the engine's batched "
                    "forward and the trainer's cannot agree bit for bit here (docs/rollout.md#true-on-policy)")
    pairs, stopped_early = _score(c, model, eng, top_p)
    for k, (trainer, engine) in enumerate(pairs):
        assert torch.equal(trainer, engine), (k, (trainer - engine).abs().max())
    assert stopped_early > 0                               # the padded tails are exercised


def test_bf16_needs_the_lossless_sync():
    """The control: the default sync sends the trainer's fp32 RMSNorm weights in bf16, and the log-probs differ."""
    c, model, eng = _engine_and_model(torch.bfloat16, lossless=False)
    model.model.norm.weight.data.add_(1e-3)          # surely off the bf16 grid (the engine got it rounded)
    pairs, _ = _score(c, model, eng, 1.0, T=3, n=2, same_routing=False)
    assert any(not torch.equal(trainer, engine) for trainer, engine in pairs)


def _cpu_run(dtype, impl="miles"):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, model=preset("tiny"), dtype=dtype), make_host(third_party=False),
                     model_name="tiny")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_diff_exactly_zero(tmp_path, dtype):
    """A ``--hardware cpu`` run of the reference model, in fp32 and in bf16 (lossless sync)."""
    from orchestration import run_training

    run = tmp_path / "run"
    run_training(_cpu_run(dtype), "tiny", mode="grpo", steps=2, run_dir=run,
                 progress=False, train_impl="reference", true_on_policy=True, save_every=100, export_at_end=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["train_rollout_kl"] == 0.0, r
        assert r["routing_replay_match"] == 1.0


def _miles_model():
    from train.model import build_train_model

    c = preset("tiny")
    model = build_train_model(c, _cpu_run("fp32"), seed=3).eval()
    model.row_invariant = True
    return c, model


def test_miles_engine_draws_from_the_trainers_module():
    """train_impl=miles: :class:`rollout.reference_engine.TrainModuleEngine` samples from the training module itself; the
    trainer's ``forward_train`` on the padded batch gives the engine's log-probs bit for bit, and the routing the
    engine recorded is the trainer's. It takes no weight update (there is nothing to send)."""
    from rollout.reference_engine import SamplingParams, TrainModuleEngine

    c, model = _miles_model()
    eng = TrainModuleEngine(model)
    pairs, stopped_early = _score(c, model, eng, 0.9)
    for k, (trainer, engine) in enumerate(pairs):
        assert torch.equal(trainer, engine), (k, (trainer - engine).abs().max())
    assert stopped_early > 0
    with pytest.raises(RuntimeError, match="takes no weight update"):
        eng.begin_update(1)
    model.train()
    with pytest.raises(RuntimeError, match="train mode"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2), n=1, seed=0)
    model.row_invariant = False
    with pytest.raises(ValueError, match="row-invariant"):
        TrainModuleEngine(model)


@pytest.mark.parametrize("impl,true_on_policy,dtype", [("miles", True, "fp32"), ("miles", False, "fp32"),
                                                       ("megatron", True, "fp32"), ("miles", True, "bf16"),
                                                       ("megatron", True, "bf16"), ("miles", False, "bf16")])
def test_grpo_impl_diff_exactly_zero(tmp_path, impl, true_on_policy, dtype):
    """``--impl miles`` (and megatron, whose experts are the same ``engine.moe``) on the CPU in fp32 and bf16:
    with true_on_policy the rollout log-probs are the trainer's (0.0 at every step); the control (the reference
    engine sampling from synced weights, the miles module scoring with its grouped experts) is not: in fp32 at
    every step; in bf16 at some step (bf16 rounding of the outputs hides a different summation order often
    enough that a step can come out equal: measured 1.1e-3 then 0.0)."""
    from orchestration import run_training

    run = tmp_path / "run"
    run_training(_cpu_run(dtype, impl), "tiny", mode="grpo", steps=2, run_dir=run, progress=False, train_impl=impl,
                 true_on_policy=true_on_policy, save_every=100, export_at_end=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        if true_on_policy:
            assert r["train_rollout_logprob_abs_diff"] == 0.0, r
            assert r["train_rollout_kl"] == 0.0, r
            assert r["weight_sync_bytes"] == 0, r
        elif dtype == "fp32":
            assert r["train_rollout_logprob_abs_diff"] > 0.0, r
        assert r["routing_replay_match"] == 1.0
    if not true_on_policy:
        assert max(r["train_rollout_logprob_abs_diff"] for r in rows) > 0.0, rows


def test_refusals():
    from core.config import ConfigError
    from train.config_checks import check_true_on_policy
    from rollout.reference_engine import ReferenceEngine
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="Fix: set train_impl=reference or miles or megatron"):
        TrainConfig(true_on_policy=True, train_impl="other")
    TrainConfig(true_on_policy=True)           # the run's implementation: checked against the built model
    for kw, fix in ((dict(micro_batch_size=2), "drop micro_batch_size"),
                    (dict(max_tokens_per_rank=64), "drop max_tokens_per_rank"),
                    (dict(async_rollout=True), "drop async_rollout"),
                    (dict(colocate=True), "drop colocate"),
                    (dict(rollout_cuda_graphs=True), "drop rollout_cuda_graphs"),
                    (dict(rollout_compile=True), "drop rollout_compile")):
        with pytest.raises(ConfigError, match=fix):
            TrainConfig(true_on_policy=True, train_impl="reference", **kw)
    TrainConfig(true_on_policy=False, micro_batch_size=2)         # the default path is unchanged
    c = preset("tiny")
    with pytest.raises(ValueError, match="kv_cache=True"):
        ReferenceEngine(c, true_on_policy=True)
    with pytest.raises(ValueError, match="dtype torch.float16 on cpu"):
        ReferenceEngine(c, kv_cache=False, dtype=torch.float16, true_on_policy=True)
    with pytest.raises(ValueError, match="device meta"):
        ReferenceEngine(c, kv_cache=False, device="meta", true_on_policy=True)
    with pytest.raises(ValueError, match="compile"):
        ReferenceEngine(c, kv_cache=False, compile=True, true_on_policy=True)

    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    cfg = TrainConfig(true_on_policy=True, train_impl="reference")
    host = make_host(third_party=False)

    def rc(**kw):
        return normalize(Choices(impl="miles", model=c, **kw), host, model_name="tiny")

    from core.combinations import InvalidCombination

    check_true_on_policy(rc(), cfg)                                 # CPU, fp32, bf16 publishing, one rank
    check_true_on_policy(rc(dtype="bf16"), cfg)
    check_true_on_policy(rc(hardware="nvidia", dtype="bf16"), cfg)   # one GPU in bf16
    for kw, fix in ((dict(quant="fp8"), "use --quant bf16"),
                    (dict(hardware="nvidia", dtype="fp32"), "use --dtype bf16"),
                    (dict(hardware="nvidia", dtype="bf16", kernel_backend="tilelang"),
                     "use --kernel-backend none or triton"),
                    (dict(tp=2), "train on one rank")):
        with pytest.raises(InvalidCombination, match=f"Fix: {fix}"):      # rule true-on-policy
            check_true_on_policy(rc(**kw), cfg)
    # triton's kernels: only through the trainer's own module (the reference model's engine runs the reference ops)
    triton = rc(hardware="nvidia", dtype="bf16", kernel_backend="triton")
    with pytest.raises(ConfigError, match="Fix: use --kernel-backend none, or drop train_impl"):
        check_true_on_policy(triton, cfg)
    check_true_on_policy(triton, TrainConfig(true_on_policy=True))

    class Model(torch.nn.Module):               # a miles model in fp16: the CPU in fp32 and bf16 are built for it
        impl, device = "miles", torch.device("cpu")

        def __init__(self, dtype=torch.float16):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2, dtype=dtype))

    with pytest.raises(ConfigError, match="Fix: use --hardware cpu"):
        check_true_on_policy(rc(dtype="bf16"), TrainConfig(true_on_policy=True), Model())
    check_true_on_policy(rc(dtype="bf16"), TrainConfig(true_on_policy=True), Model(torch.bfloat16))
    Model.device = torch.device("cuda")           # a miles model on a GPU: bf16 (tests/train/test_true_on_policy_gpu.py)
    check_true_on_policy(rc(hardware="nvidia", dtype="bf16"), TrainConfig(true_on_policy=True), Model(torch.bfloat16))
    check_true_on_policy(triton, TrainConfig(true_on_policy=True), Model(torch.bfloat16))
    for dtype in (torch.float32, torch.float16):  # fp32 there is not tested, fp16 nowhere
        with pytest.raises(ConfigError, match="the miles model is on cuda"):
            check_true_on_policy(rc(hardware="nvidia", dtype="bf16"), TrainConfig(true_on_policy=True), Model(dtype))
    Model.device = torch.device("cpu")
    Model.impl = "other"
    with pytest.raises(ConfigError, match="the training model is 'other'"):
        check_true_on_policy(rc(), TrainConfig(true_on_policy=True), Model())
