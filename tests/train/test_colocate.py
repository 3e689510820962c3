"""Colocated mode (``colocate=true``): the rollout engine gives its memory back while the trainer works.

* the built-in engine: a released engine holds no weight bytes and refuses to generate; the update that
  follows (the trainer's next weight sync) allocates them again in place and must send every tensor; after
  it the engine draws exactly the samples of an engine that was never released; an update that fails half
  way leaves an engine that refuses to generate instead of one with mixed weights;
* the trainer: a GRPO run with ``colocate=true`` takes exactly the steps of the same run without it (the
  release happens after the rollout, the resume at the next weight sync);
* SGLang (the fake server of ``_fake_sglang.py``): the trainer calls ``/release_memory_occupation`` after
  each rollout and ``/resume_memory_occupation`` before the next weight push, and a server it starts gets
  ``--enable-memory-saver``.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from core.config import preset

CFG = preset("tiny")
PROMPTS = [[0, 5, 6, 7, 8], [0, 9, 10]]


def _engine_and_model():
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    model = build_train_model(CFG, seed=0)
    engine = ReferenceEngine(CFG)
    assert sync_weights(model, engine, version=1).ok
    return engine, model


def _generate(engine):
    from rollout.reference_engine import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6), n=2, seed=3)


def _flat(groups):
    return [(s.response_ids, s.logprobs, s.routed_experts) for g in groups for s in g]


def test_a_released_engine_holds_nothing_and_samples_the_same_after_the_next_update():
    from rollout.weight_sync import sync_weights

    engine, model = _engine_and_model()
    before = _flat(_generate(engine))
    held = engine.held_bytes()                          # the weights and the decode slots' KV cache
    assert held > sum(t.numel() * t.element_size() for t in engine.held_weights().values())
    engine.release_memory()
    assert engine.held_bytes() == 0
    with pytest.raises(RuntimeError, match="no weights"):
        _generate(engine)
    assert sync_weights(model, engine, version=2).ok      # the trainer's next sync: in place, every tensor
    assert engine.version == 2
    after = _flat(_generate(engine))
    assert engine.held_bytes() == held                  # weights and the decode slots' cache, built again
    for (ra, la, ea), (rb, lb, eb) in zip(before, after, strict=True):
        assert ra == rb and torch.equal(la, lb) and torch.equal(ea, eb)


def test_the_update_after_a_release_must_send_every_tensor():
    engine, model = _engine_and_model()
    named = [(n, t.clone()) for n, t in engine.held_weights().items()]
    engine.release_memory()
    engine.begin_update(2)
    engine.load_bucket(named[:3])
    with pytest.raises(ValueError, match="missing"):
        engine.finish_update()
    with pytest.raises(RuntimeError, match="no weights"):
        _generate(engine)


def test_an_update_that_fails_half_way_leaves_an_engine_that_refuses_to_generate():
    engine, model = _engine_and_model()
    named = [(n, t.clone()) for n, t in engine.held_weights().items()]
    engine.begin_update(2)
    engine.load_bucket(named[:3])                       # these tensors are already overwritten in place
    with pytest.raises(ValueError, match="unexpected"):
        engine.load_bucket([("not.a.weight", torch.zeros(2))])
    with pytest.raises(RuntimeError, match="no weights"):
        _generate(engine)


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def dsv4(*args):
    from launchers.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


STEP_KEYS = ("loss", "pg_loss", "grad_norm", "reward_mean", "response_tokens", "train_rollout_logprob_abs_diff")


def test_a_colocated_grpo_run_takes_the_steps_of_the_same_run_without_it(tmp_path):
    common = ("train", "--hardware", "cpu", "--steps", 2, "prompts_per_step=2", "group_size=2", "max_new_tokens=6")
    res = dsv4(*common, "--run-dir", tmp_path / "plain")
    assert res.exit_code == 0, res.output
    res = dsv4(*common, "--run-dir", tmp_path / "colocated", "colocate=true")
    assert res.exit_code == 0, res.output
    plain, colocated = _rows(tmp_path / "plain"), _rows(tmp_path / "colocated")
    assert len(plain) == len(colocated) == 2
    for a, b in zip(plain, colocated):
        assert {k: a[k] for k in STEP_KEYS} == {k: b[k] for k in STEP_KEYS}
    assert all(r["engine_memory_gib"] > 0 for r in plain)        # the engine kept its weights while training
    assert all(r["engine_memory_gib"] == 0 for r in colocated)   # ... or had given them back
    assert json.loads((tmp_path / "colocated" / "train_config.json").read_text())["train"]["colocate"] is True


def test_the_trainer_releases_the_sglang_servers_memory_after_each_rollout(tmp_path, monkeypatch):
    from tests.train._fake_sglang import FakeSGLang
    from rollout import sglang_engine

    monkeypatch.setattr(sglang_engine, "sglang_serializer", lambda: sglang_engine.torch_b64_serialize)
    with FakeSGLang(CFG) as fake:
        res = dsv4("train", "--hardware", "cpu", "--rollout-engine", "sglang", "--rollout-url", fake.url,
                   "--run-dir", tmp_path / "run", "--steps", 2, "prompts_per_step=2", "group_size=2",
                   "max_new_tokens=4", "colocate=true")
    assert res.exit_code == 0, res.output
    calls = [c for c in fake.state["calls"] if c != "/update_weights_from_tensor"]
    assert calls == ["/flush_cache", "/generate", "/release_memory_occupation",
                     "/resume_memory_occupation", "/flush_cache", "/generate", "/release_memory_occupation"]
    assert "--enable-memory-saver" in sglang_engine.server_command(
        sglang_engine.SGLangServerConfig(model_path="m", enable_memory_saver=True))
    assert "--enable-memory-saver" not in sglang_engine.server_command(sglang_engine.SGLangServerConfig(model_path="m"))
