"""A model that a checkpoint fills is built without random init (issue #17: startup of a large model).

``build_train_model(..., initialize=False)`` (what ``dsv4 train --model CKPT`` and the scorers do) draws no
random numbers and starts every floating weight as NaN; each load path then writes every weight. Checked
here for both implementations and the reference training model, against a model built WITH init and loaded
the same way (the independent reference: the load must leave the two bitwise equal), and the refusal of a
load that leaves a weight unwritten (the NaN start is caught by ``core.finite.check_written``, naming it).
``dsv4 train --resume`` without ``--model`` builds without init too (the run's checkpoint fills the model):
the resumed run's metrics equal an uninterrupted run's."""

import pytest
import torch

from ._impl_helpers import run_config, small_config, write_data

IMPLS = ("miles", "megatron", "reference")


def _build(impl, config, initialize):
    from train.model import build_train_model

    rc = None if impl == "reference" else run_config(impl, config)
    return build_train_model(config, rc, impl=impl, initialize=initialize)


def _weights(model):
    return {n: t for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{kind: folder}`` of one set of weights for the small config: HF (bf16), native, torch_dist."""
    from converters.torch_dist import save_torch_dist
    from core.checkpoint.tiny import prepare_checkpoint
    from core.native_checkpoint import save_native
    from train.model import load_model_source

    c = small_config()
    root = tmp_path_factory.mktemp("ckpts")
    hf = prepare_checkpoint(root / "hf", c, dtype="bf16", seed=5, progress=False)
    model = _build("miles", c, True)          # also sets the process up (torch_dist writes need the group)
    load_model_source(model, hf)
    native = {n: t.detach().clone() for n, t in model.native_tensors()}
    return {"hf": hf, "native": save_native(root / "native", native, impl="miles", config=c),
            "torch_dist": save_torch_dist(root / "torch_dist", native, c)}


@pytest.mark.parametrize("impl", IMPLS)
def test_without_init_no_random_number_is_drawn_and_every_weight_starts_nan(impl):
    c = small_config()
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    model = _build(impl, c, False)
    assert torch.equal(torch.rand(4), want), "building without init drew from the default generator"
    floats = {n: t for n, t in _weights(model).items() if t.is_floating_point()}
    assert floats and all(bool(t.isnan().all()) for t in floats.values())
    assert any(n.endswith("tid2eid") for n in _weights(model))   # computed, not a random weight


@pytest.mark.parametrize("kind", ("hf", "native", "torch_dist"))
@pytest.mark.parametrize("impl", IMPLS)
def test_loaded_without_init_equals_loaded_with_init(impl, kind, checkpoints):
    from train.model import load_model_source

    c = small_config()
    want = _build(impl, c, True)
    load_model_source(want, checkpoints[kind])
    got = _build(impl, c, False)
    load_model_source(got, checkpoints[kind])
    a, b = _weights(want), _weights(got)
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("impl", ("miles", "megatron"))
def test_a_load_that_misses_a_weight_is_refused_naming_it(impl, checkpoints, monkeypatch):
    """The loaders are strict about names; this is the net under them: a loader that skips a tensor (here one
    made to skip ``decoder.final_layernorm.weight``) leaves it NaN, and the load is refused, naming it."""
    import engine.loading as loading
    from core.finite import NonFiniteError
    from train.model import load_model_source

    skipped = "decoder.final_layernorm.weight"
    real = loading.load_hf_tensors

    def skipping(targets, reader, config, **kw):
        return real({n: t for n, t in targets.items() if n != skipped}, reader, config, strict=False)

    monkeypatch.setattr(loading, "load_hf_tensors", skipping)
    model = _build(impl, small_config(), False)
    with pytest.raises(NonFiniteError, match=rf"{skipped}.*did not write"):
        load_model_source(model, checkpoints["hf"])


def test_a_checkpoint_without_a_tensor_is_refused(checkpoints, tmp_path):
    """An HF checkpoint lacking a tensor the model holds (removed from its shard and index): refused, naming
    it, for a model built without init."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from core.checkpoint.errors import CheckpointError
    from train.model import load_model_source

    gone = "layers.0.attn.wkv.weight"
    ck = shutil.copytree(checkpoints["hf"], tmp_path / "partial")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = ck / index["weight_map"].pop(gone)
    tensors = load_file(str(shard))
    del tensors[gone]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    for impl in IMPLS:
        with pytest.raises(CheckpointError, match=rf"{gone.replace('.', '[.]')}.*missing tensor"):
            load_model_source(_build(impl, small_config(), False), ck)


@pytest.mark.parametrize("mode", ("sft", "grpo"))
def test_resume_without_a_model_builds_without_init(mode, tmp_path, monkeypatch):
    """``dsv4 train --resume`` without ``--model`` (the model from a config): the run's checkpoint fills every
    weight, so the model (and GRPO's KL reference, read back from the run folder) is built without random
    init, and the resumed run's metrics equal those of a run that was not interrupted. The first run of a
    folder still draws the init (a --resume of a folder that holds no run is refused: bad_inputs_test)."""
    import train.trainer as trainer
    from orchestration import run_training
    from train.checkpointing import latest_checkpoint
    from reporting.metrics import read_metrics

    from ._metrics import without_timing

    c = small_config()
    rc = run_config("miles", c)
    kw = dict(mode=mode, batch_size=2, lr=1e-3, save_every=1, export_at_end=False, progress=False)
    if mode == "grpo":
        kw.update(data=write_data(tmp_path / "data.jsonl"), max_new_tokens=3, prompts_per_step=2,
                  group_size=2, kl_coef=0.1)
    built = []
    real = trainer.build_train_model

    def recording(*a, **k):
        built.append(k["initialize"])
        return real(*a, **k)

    monkeypatch.setattr(trainer, "build_train_model", recording)
    run_training(rc, c, steps=3, run_dir=tmp_path / "straight", **kw)
    per_run = len(built)                                       # the model, and GRPO's KL reference
    assert per_run == (2 if mode == "grpo" else 1)
    run_training(rc, c, steps=2, run_dir=tmp_path / "run", **kw)   # a new run (--resume on no run is refused)
    assert built == [True] * 2 * per_run and latest_checkpoint(tmp_path / "run")[0] == 2
    run_training(rc, c, steps=3, run_dir=tmp_path / "run", resume=True, **kw)
    assert built[2 * per_run:] == [False] * per_run, built
    got, want = without_timing(read_metrics(tmp_path / "run")), without_timing(read_metrics(tmp_path / "straight"))
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got == want
