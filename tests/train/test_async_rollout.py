"""Asynchronous rollout (``async_rollout=true``, rollout/async_rollout.py) under the local orchestrator, on the CPU.

The reference is the synchronous run of the same GRPO job (tiny miles model, fp32), with every engine call
recorded by a wrapper around the run's engine:

* step 1 of the async run equals the synchronous step 1 (both sample from the starting weights);
* every later step trained on samples generated in the background from the weights synced one step earlier:
  they equal what a fresh engine draws, with that step's prompts and seed, from the weights the SYNCHRONOUS
  run's engine held at the step before (the independent reference), and differ from the synchronous step's
  own samples (drawn from newer weights);
* the metrics carry ``rollout_policy_lag`` (0, 1, 1 against 0, 0, 0), the next batch is issued before the
  step's train phase ends, and the engine never took a weight update while it was generating;
* a resumed async run regenerates the batch that was in flight from the checkpoint's weights (lag 0 for that
  step): each step's batch is generated once;
* the refusals: SFT, ``colocate=true``, an in-process engine on a GPU under the local orchestrator.
"""

import dataclasses
import json
import threading
import time

import pytest
import torch

from core.config import preset

STEPS = 3
WAITED_S = 0.3    # a background generate returns this long after the trainer began waiting for it
KW = dict(max_new_tokens=4, prompts_per_step=2, group_size=4, save_every=1, keep_last=5, lr=1e-3, progress=False,
          export_at_end=False)
SAME = ("loss", "grad_norm", "reward_mean", "train_rollout_logprob_abs_diff", "response_tokens")


def small_config():
    return preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)


def run_config(hardware="cpu", **kw):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl="miles", model=small_config(), hardware=hardware, **kw),
                     make_host(third_party=False), model_name="small")


def write_data(path, n=16):
    rows = [{"prompt": f"{i}+{i}=", "reward": {"type": "valid_bytes"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class Recording:
    """The run's engine, every call recorded: per generate, the step's seed, the weights version the engine held,
    the thread it ran in and the groups; per finish_update, the weights it then held; and any weight update that
    started while a generate was running."""

    def __init__(self, engine, log, taken: threading.Semaphore):
        self.engine, self.log, self.taken = engine, log, taken
        self.version, self.busy = None, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def begin_update(self, version):
        if self.busy:
            self.log["updated_while_generating"].append(version)
        self._next = version
        self.engine.begin_update(version)

    def finish_update(self):
        self.engine.finish_update()
        self.version = self._next
        self.log["weights"][self.version] = {k: v.clone() for k, v in self.engine.held_weights().items()}

    def generate(self, prompts, params, *, n, seed, first_prompt=0):
        self.busy = True
        try:
            if threading.current_thread() is not threading.main_thread():
                # still generating when the trainer asks for the batch (before its next weight sync), however
                # long the step's train phase took on a loaded machine
                assert self.taken.acquire(timeout=120), "the trainer never asked for the background batch"
                time.sleep(WAITED_S)
            groups = self.engine.generate(prompts, params, n=n, seed=seed, first_prompt=first_prompt)
        finally:
            self.busy = False
        self.log["generate"].append(dict(seed=seed, version=self.version, groups=groups,
                                         thread=threading.current_thread().name))
        return groups


def _train(run_dir, data, *, steps=STEPS, resume=False, **kw):
    """A run through run_training with its engine recorded; returns (metrics rows, the record)."""
    from core.assembly import Assembly
    from orchestration import run_training
    from rollout.async_rollout import RolloutPipeline
    from reporting.metrics import read_metrics

    log = {"generate": [], "weights": {}, "updated_while_generating": []}
    made, take, taken = Assembly.rollout_engine, RolloutPipeline.take, threading.Semaphore(0)

    def take_and_release(pipeline, step):
        if pipeline.pending is not None:
            taken.release()
        return take(pipeline, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Assembly, "rollout_engine", lambda parts, *a, **k: Recording(made(parts, *a, **k), log, taken))
        mp.setattr(RolloutPipeline, "take", take_and_release)
        run_training(run_config(), small_config(), mode="grpo", steps=steps, run_dir=run_dir, resume=resume,
                     data=data, **{**KW, **kw})
    return read_metrics(run_dir), log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    data = write_data(root / "data.jsonl")
    sync = _train(root / "sync", data, weight_sync="copy")   # copied: the recording sees every update
    asyn = _train(root / "async", data, async_rollout=True)
    return sync, asyn, data


def _step_seed(step):
    from train.step_common import step_seed as _step_seed
    from train.trainer import TrainConfig

    return _step_seed(TrainConfig().seed, step)


def _by_seed(log, step):
    calls = [c for c in log["generate"] if c["seed"] == _step_seed(step)]
    assert len(calls) == 1, f"step {step}'s batch was generated {len(calls)} times"
    return calls[0]


def _fresh_draw(weights, step, data):
    """What a fresh reference engine given ``weights`` draws for ``step`` (its prompts and seed)."""
    from train import data as D
    from rollout.reference_engine import SamplingParams, make_reference_engine
    from train.trainer import TrainConfig

    cfg = TrainConfig(data=data, **{k: KW[k] for k in ("max_new_tokens", "prompts_per_step", "group_size")})
    tok = D.tokenizer_for(None, small_config().vocab_size)
    examples = D.load_data(cfg.data, "grpo")
    prompts = [D.encode_prompt(tok, ex.prompt) for ex in D.batch_for_step(examples, cfg.seed, step,
                                                                          cfg.prompts_per_step)]
    engine = make_reference_engine(small_config(), dtype=torch.float32)
    engine.begin_update(0)
    engine.load_bucket(list(weights.items()))
    engine.finish_update()
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, (tok.eos_token_id,), cfg.top_k)
    return engine.generate(prompts, params, n=cfg.group_size, seed=_step_seed(step))


def _same_groups(a, b):
    assert [[s.response_ids for s in g] for g in a] == [[s.response_ids for s in g] for g in b]
    for ga, gb in zip(a, b):
        for sa, sb in zip(ga, gb):
            torch.testing.assert_close(sa.logprobs, sb.logprobs, rtol=0, atol=1e-6)


def _differ(a, b) -> bool:
    """Other tokens, or the same tokens with log-probs more than 1e-4 apart."""
    return any(sa.response_ids != sb.response_ids or float((sa.logprobs - sb.logprobs).abs().max()) > 1e-4
               for ga, gb in zip(a, b) for sa, sb in zip(ga, gb))


def test_first_step_equals_the_synchronous_step(runs):
    (sync_rows, _), (async_rows, _), _ = runs
    assert [r["step"] for r in async_rows] == list(range(1, STEPS + 1))
    for key in SAME:
        assert async_rows[0][key] == pytest.approx(sync_rows[0][key], rel=1e-6, abs=1e-9), key


def test_later_steps_train_on_the_previous_steps_weights(runs):
    (sync_rows, sync_log), (async_rows, async_log), data = runs
    for step in range(2, STEPS + 1):
        got = _by_seed(async_log, step)
        # issued during step - 1, right after its weight sync (version step - 1), and run in the background
        assert got["version"] == step - 1 and got["thread"].startswith("dsv4-rollout")
        # the independent reference: a fresh engine given the weights the synchronous run's engine held at step - 1
        want = _fresh_draw(sync_log["weights"][step - 1], step, data)
        _same_groups(got["groups"], want)
        # the synchronous step drew from newer weights (version step): other samples
        sync_call = _by_seed(sync_log, step)
        assert sync_call["version"] == step
        assert _differ(got["groups"], sync_call["groups"])
        # and trained differently; the train-vs-rollout gap now measures the off-policy step
        assert async_rows[step - 1]["grad_norm"] != pytest.approx(sync_rows[step - 1]["grad_norm"], rel=1e-3)
        assert async_rows[step - 1]["train_rollout_logprob_abs_diff"] > 100 * sync_rows[step - 1][
            "train_rollout_logprob_abs_diff"]
    assert _by_seed(async_log, 1)["version"] == 1      # step 1 generated its own batch from the starting weights


def test_metrics_carry_the_lag_and_the_overlap(runs):
    (sync_rows, _), (async_rows, async_log), _ = runs
    assert [r["rollout_policy_lag"] for r in sync_rows] == [0] * STEPS
    assert [r["rollout_policy_lag"] for r in async_rows] == [0] + [1] * (STEPS - 1)
    for r in async_rows[:-1]:    # the next batch was issued before this step's train phase ended
        assert 0 < r["at_next_rollout_issued"] < r["at_train_end"]
    for r in async_rows[1:]:     # and the next step waited for it (the sync must not update a generating engine)
        assert r["time_rollout_wait"] >= WAITED_S * 0.9
    assert "at_next_rollout_issued" not in async_rows[-1]      # no batch is generated past the last step
    # the engine's phases of the batch each step trained on (read before the next batch is issued): at most
    # max_new_tokens - 1 steps of at most prompts x group rows
    for r in sync_rows + async_rows:
        assert r["time_rollout_decode"] > 0 and r["time_rollout_prefill"] > 0, r
        assert 0 < r["rollout_decode_steps"] <= 3 and 0 < r["rollout_decode_rows"] <= 3 * 8, r
    assert len(async_log["generate"]) == STEPS
    assert async_log["updated_while_generating"] == []        # the sync waited for the call in flight


def test_a_resumed_async_run_regenerates_the_batch_in_flight(runs, tmp_path):
    (_, _), (async_rows, async_log), data = runs
    run = tmp_path / "run"
    _train(run, data, steps=2, async_rollout=True)
    rows, log = _train(run, data, steps=STEPS, resume=True, async_rollout=True)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["rollout_policy_lag"] == 0          # the resumed step drew from the checkpoint's weights
    call = _by_seed(log, STEPS)                         # once, in the resumed process
    assert call["version"] == STEPS and [c["seed"] for c in log["generate"]] == [_step_seed(STEPS)]
    for key in SAME:                                    # the steps before the checkpoint are the uninterrupted run's
        assert rows[1][key] == pytest.approx(async_rows[1][key], rel=1e-6, abs=1e-9), key


def test_refusals():
    from core.combinations import InvalidCombination
    from core.config import ConfigError
    from train.config_checks import check_mode, check_train_options
    from train.trainer import TrainConfig

    cfg = TrainConfig(async_rollout=True)
    with pytest.raises(ConfigError, match="--mode sft has no rollout. Fix: drop async_rollout"):
        check_mode("sft", cfg)
    check_mode("grpo", cfg)
    with pytest.raises(ConfigError, match="'colocate' frees the engine's memory .* Fix: drop one of them"):
        TrainConfig(async_rollout=True, colocate=True)
    with pytest.raises(InvalidCombination, match="a thread of the trainer's process: on --hardware nvidia .* Fix: "
                                                 "use --orchestrator ray"):
        check_train_options(run_config("nvidia"), cfg)
    check_train_options(run_config("nvidia"), dataclasses.replace(cfg, async_rollout=False))
    check_train_options(run_config("nvidia", orchestrator="ray"), cfg)     # the engine in an actor of its own
    check_train_options(run_config(), cfg)                                 # the CPU: a thread is safe


def test_the_pipeline_holds_one_call_and_waits_for_it():
    from rollout.async_rollout import RolloutPipeline

    started, release = threading.Event(), threading.Event()

    class Slow:
        def generate(self, prompts, params, *, n, seed, first_prompt):
            started.set()
            release.wait(10)
            return [[seed]]

    pipe = RolloutPipeline(Slow())
    pipe.issue(2, 1, [[5]], None, n=1, seed=7, first_prompt=0)
    started.wait(10)
    with pytest.raises(RuntimeError, match="step 2 is still being generated"):
        pipe.issue(3, 2, [[5]], None, n=1, seed=8, first_prompt=0)
    with pytest.raises(RuntimeError, match="the batch in flight is step 2's, step 3 asked"):
        pipe.take(3)
    threading.Timer(0.2, release.set).start()
    groups, version, waited = pipe.take(2)
    assert groups == [[7]] and version == 1 and waited > 0.1
    assert pipe.take(3) is None
    pipe.close()
