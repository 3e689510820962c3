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
    from train.trainer import run_training

    c = preset("tiny").replace(**SMALL)
    return run_training(None, c, mode="sft", steps=steps, run_dir=tmp_path / "run", resume=resume, **KW)


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
