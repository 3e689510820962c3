"""NaN/inf are refused where they enter (checkpoint loading), appear (a training step) or leave (JSON
output, exports, published buckets), each time naming the tensor (issue #21, item 2)."""

import math
import re

import pytest
import torch

SMALL = dict(n_layers=2, compress_ratios=(0, 0, 0), n_hash_layers=1)


def _tiny():
    from core.config import preset

    return preset("tiny").replace(**SMALL)


def test_an_hf_checkpoint_with_a_nan_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from core.checkpoint import open_checkpoint
    from core.checkpoint.tiny import prepare_checkpoint
    from core.finite import NonFiniteError

    ck = prepare_checkpoint(tmp_path / "ck", _tiny(), dtype="bf16", seed=0)
    shard = sorted(ck.glob("model-*.safetensors"))[0]
    d = load_file(str(shard))
    name = next(n for n, t in d.items() if t.dtype == torch.float32)
    d[name].view(-1)[0] = float("nan")
    save_file(d, str(shard), metadata={"format": "pt"})
    with pytest.raises(NonFiniteError, match=name.replace(".", r"\.")):
        dict(open_checkpoint(ck).iter_tensors())


def test_a_native_checkpoint_with_an_inf_is_refused_naming_the_tensor(tmp_path):
    from core.finite import NonFiniteError
    from core.native_checkpoint import load_native, save_native
    from train.model import build_train_model

    c = _tiny()
    model = build_train_model(c, None, impl="reference")
    state = {n: t.detach().clone() for n, t in model.native_tensors()}
    name = next(n for n, t in state.items() if t.is_floating_point())
    state[name].view(-1)[3] = float("inf")
    save_native(tmp_path / "nat", state, impl="miles", config=c)
    with pytest.raises(NonFiniteError, match=name.replace(".", r"\.")):
        load_native(tmp_path / "nat", config=c)


def test_json_output_never_holds_nan():
    from core.finite import NonFiniteError, finite_json

    assert finite_json([[-1.5]], what="log-probabilities") == "[[-1.5]]"
    with pytest.raises(NonFiniteError, match="log-probabilities"):
        finite_json([[float("nan")]], what="log-probabilities")


def test_exploding_weights_stop_training_with_the_step_and_keep_the_last_good_checkpoint(tmp_path):
    from train.checkpointing import latest_checkpoint
    from orchestration import run_training
    from train.step_guard import TrainingDiverged

    from ._impl_helpers import run_config

    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"training diverged at step (\d+).*lower --lr") as info:
        run_training(run_config("miles", _tiny()), _tiny(), mode="sft", steps=6, run_dir=run, batch_size=2, lr=1e30,
                     save_every=1, progress=False, train_impl="reference")
    found = latest_checkpoint(run)
    bad_step = int(re.search(r"step (\d+)", str(info.value)).group(1))
    assert found is None or found[0] < bad_step
    assert not (run / "hf").exists()                       # nothing exported
    if found is not None:                                  # the kept checkpoint is finite
        from core.native_checkpoint import load_native

        state, _ = load_native(found[1] / "model")
        assert all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def test_a_nan_gradient_names_the_tensor():
    from core.finite import NonFiniteError
    from train.step_guard import check_gradients

    m = torch.nn.Linear(2, 2)
    m.weight.grad = torch.tensor([[0.0, math.nan], [0.0, 0.0]])
    m.bias.grad = torch.zeros(2)
    with pytest.raises(NonFiniteError, match="'weight'"):
        check_gradients(m, math.nan)
    check_gradients(m, 1.0)                                # a finite norm skips the scan


def test_export_and_weight_sync_refuse_nan_weights(tmp_path):
    from core.finite import NonFiniteError
    from train.export import export_model
    from train.model import build_train_model

    model = build_train_model(_tiny(), None, impl="reference")
    p = next(p for p in model.parameters() if p.is_floating_point())
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match="export"):
        export_model(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()

    from rollout.reference_engine import make_reference_engine
    from rollout.weight_sync import sync_weights

    engine = make_reference_engine(model.config, dtype=torch.float32)
    try:
        with pytest.raises(NonFiniteError, match="weight sync"):
            sync_weights(model, engine, version=1)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_the_shared_finite_check_finds_nan_and_inf_and_passes_the_largest_finite_values(dtype):
    from core.finite import first_nonfinite

    big = torch.finfo(dtype).max
    ok = [("a", torch.full((3, 4), big).to(dtype)), ("b", torch.tensor([-big, 0.0, 1.0]).to(dtype)),
          ("ints", torch.tensor([1, 2])), ("empty", torch.empty(0, dtype=dtype))]
    assert first_nonfinite(ok) is None                      # max |x| of the dtype is finite, not an overflow
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        if dtype == torch.float8_e4m3fn and math.isinf(bad_value):
            continue                                        # e4m3fn has no inf: it saturates or is NaN
        bad = torch.zeros(5, dtype=torch.float32)
        bad[3] = bad_value
        found = first_nonfinite(ok + [("w", bad.to(dtype))])
        assert found == ("w", 1, 5), (bad_value, found)
