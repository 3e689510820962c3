"""Nothing in a run folder is unpickled (issue #21, item 1): a planted pickle whose loading would
create a marker file is never opened; an old-format checkpoint is refused with a clear error."""

import os
import pickle

import pytest

SMALL = dict(n_layers=2, compress_ratios=(0, 0, 0), n_hash_layers=1)
KW = dict(batch_size=2, lr=1e-3, save_every=1, export_at_end=False, progress=False)


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: the proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker):
    with open(path, "wb") as f:
        pickle.dump(_Payload(marker), f)


def _run(tmp_path, steps, resume):
    from core.config import preset
    from orchestration import run_training

    from ._impl_helpers import run_config

    c = preset("tiny").replace(**SMALL)
    return run_training(run_config("miles", c), c, mode="sft", steps=steps, run_dir=tmp_path / "run", resume=resume,
                        train_impl="reference", **KW)


def test_resume_never_unpickles_a_planted_file(tmp_path):
    from train.checkpointing import latest_checkpoint

    _run(tmp_path, 1, False)
    step, folder = latest_checkpoint(tmp_path / "run")
    assert not list(folder.glob("*.pt")), "training state must not be pickled"
    marker = tmp_path / "pwned"
    for name in ("optim.pt", "rng.pt"):            # where the old code read pickles
        _plant(folder / name, marker)
    _plant(tmp_path / "run" / "ref_model.pt", marker)
    _run(tmp_path, 2, True)
    assert not marker.exists()
    assert latest_checkpoint(tmp_path / "run")[0] == 2


def test_an_old_pickle_checkpoint_is_refused_by_name_without_loading_it(tmp_path):
    from train.checkpointing import latest_checkpoint
    import shutil

    from train.checkpointing import OPTIM_DIR
    from train.state_io import OPTIM_JSON, RNG_JSON, RNG_TENSORS, TrainingStateError

    _run(tmp_path, 1, False)
    _step, folder = latest_checkpoint(tmp_path / "run")
    for name in (OPTIM_JSON, RNG_JSON, RNG_TENSORS):  # what an older version wrote instead
        os.remove(folder / name)
    shutil.rmtree(folder / OPTIM_DIR)
    marker = tmp_path / "pwned"
    _plant(folder / "optim.pt", marker)
    _plant(folder / "rng.pt", marker)
    with pytest.raises(TrainingStateError, match=r"optim\.pt.*never loaded.*--model"):
        _run(tmp_path, 2, True)
    assert not marker.exists()


def test_optimizer_and_rng_state_round_trip(tmp_path):
    """The optimizer's state goes through a DCP tensor folder as pieces (no pickle) and comes back equal."""
    import random

    import torch

    from core.dcp_shards import save_pieces
    from core.native_checkpoint import read_tensor_pieces
    from train import state_io
    from train.optim import TorchOptimizer
    from train.trainer import TrainConfig

    class _Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(3, 2)

    m = _Model()
    opt = TorchOptimizer(m, TrainConfig(lr=1e-2, betas=(0.8, 0.9)))
    m.module(torch.ones(1, 3)).sum().backward()
    opt.step()
    state, steps = opt.shard_state()
    (tmp_path / "optim").mkdir()
    save_pieces(tmp_path / "optim", state, distributed=False)
    state_io.save_rng(tmp_path)
    want_t, want_py = torch.rand(3), random.random()

    m2 = _Model()
    opt2 = TorchOptimizer(m2, TrainConfig(lr=1e-2, betas=(0.8, 0.9)))
    opt2.load_shard_state(lambda wanted: read_tensor_pieces(tmp_path / "optim", wanted), steps)
    state_io.load_rng(tmp_path)
    assert torch.equal(torch.rand(3), want_t) and random.random() == want_py
    assert steps == {"weight": 1, "bias": 1}
    for p, q in zip(m.module.parameters(), m2.module.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.opt.state[p][k], opt2.opt.state[q][k]), k


def test_a_checkpoint_of_the_previous_format_resumes(tmp_path):
    """dsv4-optim-full-v1 checkpoints (whole tensors, written by rank 0 alone with save_native / save_tensor_folder)
    load through the piece reader and continue like the uninterrupted run; an unknown format is refused."""
    import json
    import shutil

    import pytest

    from core.native_checkpoint import (load_native, load_tensor_folder, native_model_config, save_native,
                                        save_tensor_folder)
    from train.checkpointing import OPTIM_DIR, latest_checkpoint
    from train.state_io import OPTIM_JSON, TrainingStateError

    straight = _run(tmp_path / "straight", 3, False)["last"]
    _run(tmp_path / "old", 1, False)
    _step, folder = latest_checkpoint(tmp_path / "old" / "run")
    optim = load_tensor_folder(folder / OPTIM_DIR)
    shutil.rmtree(folder / OPTIM_DIR)
    save_tensor_folder(folder / OPTIM_DIR, optim)
    config = native_model_config(folder / "model")
    state, meta = load_native(folder / "model")
    shutil.rmtree(folder / "model")
    save_native(folder / "model", state, impl=meta["impl"], config=config)
    record = json.loads((folder / OPTIM_JSON).read_text())
    (folder / OPTIM_JSON).write_text(json.dumps({**record, "format": "dsv4-optim-future-v9"}))
    with pytest.raises(TrainingStateError, match="not a dsv4-optim-full-v1 or dsv4-optim-sharded-v2 record"):
        _run(tmp_path / "old", 3, True)
    (folder / OPTIM_JSON).write_text(json.dumps({**record, "format": "dsv4-optim-full-v1"}))
    resumed = _run(tmp_path / "old", 3, True)["last"]       # step 3's loss needs step 2's Adam moments
    assert resumed["step"] == 3
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-6)
    assert resumed["grad_norm"] == pytest.approx(straight["grad_norm"], rel=1e-6)
