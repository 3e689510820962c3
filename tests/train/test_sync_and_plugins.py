"""The fifth plugin axis (rollout engines) and the weight-sync path with its checker."""

import pytest
import torch

from core.config import preset

CFG = preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)


def test_rollout_engines_are_a_plugin_axis():
    from core.plugins import PluginHost
    from core.records import ROLLOUT, RolloutEngine
    from launchers.builtin_plugins import BUILTIN_PLUGINS

    assert "rollout.plugin" in BUILTIN_PLUGINS
    host = PluginHost(["rollout.plugin"], third_party=False)
    assert host.names(ROLLOUT) == ["reference", "sglang"]
    ref = host.get(ROLLOUT, "reference")
    assert isinstance(ref, RolloutEngine) and ref.routed_experts and ref.unavailable_reason() is None
    assert host.get(ROLLOUT, "sglang").unavailable_reason()      # no GPU / sglang here
    assert host.get(ROLLOUT, "sglang").server and not ref.server  # a server (started, or at --rollout-url)
    with pytest.raises(ValueError, match="weight_update"):
        RolloutEngine(name="x", description="d", factory="a:b", weight_update=("ftp",))


def _run(rollout_engine: str, hardware: str = "cpu", rollout_url=None):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(rollout_engine=rollout_engine, hardware=hardware, model=CFG, rollout_url=rollout_url),
                     make_host(third_party=False))


def test_the_assembly_builds_the_runs_reference_engine_and_refuses_sglang_here():
    from core.assembly import assemble
    from rollout.reference_engine import ReferenceEngine

    assert isinstance(assemble(_run("reference")).rollout_engine(CFG), ReferenceEngine)
    with pytest.raises(RuntimeError, match="--rollout-engine sglang is not usable here"):
        assemble(_run("sglang", "nvidia")).rollout_engine(CFG)


def test_a_server_at_rollout_url_is_assembled_on_the_cpu_without_the_local_probe(tmp_path):
    from core.assembly import assemble
    from core.combinations import InvalidCombination
    from core.run_config import availability_problems
    from tests.train._fake_sglang import FakeSGLang
    from train.trainer import TrainConfig

    with pytest.raises(InvalidCombination, match="--rollout-url URL"):
        _run("sglang")                                      # starting a server needs a GPU target
    with FakeSGLang(CFG) as fake:
        run = _run("sglang", rollout_url=fake.url + "/")
        assert run.rollout_url == fake.url and availability_problems(run) == []
        e = assemble(run).rollout_engine(CFG, settings=TrainConfig(sglang_weight_sync="disk"), run_dir=tmp_path)
        assert e.server.base_url == fake.url and e.proc is None and fake.state["health_calls"] == 1


@pytest.mark.parametrize("scheme,bound", [("bf16", 0.0), ("fp8", 0.08), ("nvfp4", 0.25)])
def test_sync_through_each_publish_scheme_is_checked(scheme, bound):
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    m = build_train_model(CFG)
    e = ReferenceEngine(CFG)
    rep = sync_weights(m, e, version=3, scheme=scheme)
    assert rep.ok, rep.check.summary()
    assert rep.check.checked == len(e.held_weights())
    assert rep.max_quant_rel_err <= bound
    assert e.version == 3
    # the engine computes with the exported tensors: a bf16 sync reproduces the trainer's logits exactly
    if scheme == "bf16":
        ids = torch.randint(2, 258, (1, 9))
        assert torch.equal(e.model(ids), m.model(ids))


def test_checker_catches_an_engine_that_drops_tid2eid_and_downcasts_fp32_tensors():
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    class Broken(ReferenceEngine):
        def load_bucket(self, bucket):
            fixed = []
            for n, t in bucket:
                if n.endswith("tid2eid"):
                    t = torch.zeros_like(t)
                elif n.endswith("attn_sink"):
                    t = t.to(torch.bfloat16)
                fixed.append((n, t))
            super().load_bucket(fixed)

        def held_weights(self):
            held = super().held_weights()
            return {n: (t.to(torch.bfloat16) if n.endswith("attn_sink") else t) for n, t in held.items()}

    m = build_train_model(CFG)
    rep = sync_weights(m, Broken(CFG), version=1)
    assert not rep.ok
    kinds = {i.kind for i in rep.check.issues}
    assert "tid2eid_degenerate" in kinds and "fp32_downcast" in kinds


def test_checkpoint_roundtrip_restores_weights_and_optimizer(tmp_path):
    from train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
    from train.model import build_train_model
    from train.optim import TorchOptimizer
    from train.trainer import TrainConfig

    m = build_train_model(CFG, seed=0)
    opt = TorchOptimizer(m, TrainConfig(lr=1e-3))
    m.logprobs(torch.randint(2, 258, (1, 6))).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, m, opt)
    m2 = build_train_model(CFG, seed=5)
    opt2 = TorchOptimizer(m2, TrainConfig(lr=1e-3))
    step, folder = latest_checkpoint(tmp_path)
    assert step == 1
    load_checkpoint(folder, m2, opt2)
    for (a, x), (b, y) in zip(m.model.state_dict().items(), m2.model.state_dict().items()):
        assert a == b and torch.equal(x, y), a
    updated = [p for p in opt.params if p in opt.opt.state]
    assert updated
    for p, q in zip(opt.params, opt2.params):
        if p in opt.opt.state:
            assert opt2.opt.state[q]["exp_avg"].equal(opt.opt.state[p]["exp_avg"])
