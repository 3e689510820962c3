"""Native checkpoints reshard across tensor-parallel sizes for miles: written at tp=1, loaded
and scored at tp=2 (two gloo processes), gathered and written again at tp=2, loaded back at
tp=1 bit-identically."""

from __future__ import annotations

import torch

from tests.cpu_ranks import PORT, spawn_cpu_ranks
from core.checkpoint import prepare_checkpoint
from core.native_checkpoint import load_native, save_native
from core.weight_contract import hf_to_native

from . import _tp_worker
from ._helpers import TINY, miles_model, official_from_checkpoint, perturb, token_ids


def test_native_checkpoint_reshards_between_tp1_and_tp2(tmp_path):
    ckpt = prepare_checkpoint(tmp_path / "ckpt", TINY, dtype="bf16", seed=0)
    official = perturb(official_from_checkpoint(ckpt))
    native_in = save_native(tmp_path / "native_tp1", dict(hf_to_native(official.items(), TINY)), impl="miles", config=TINY)
    native_out, out = tmp_path / "native_tp2", tmp_path / "tp2.pt"
    spawn_cpu_ranks(_tp_worker.run_native, (2, PORT, str(native_in), str(native_out), str(out)), 2)

    m = miles_model(official, tp=1)
    tp2 = torch.load(out)
    with torch.no_grad():
        for S in (37, 140):
            assert (m.logprobs(token_ids(2, S, 300 + S)) - tp2["logprobs"][S]).abs().max().item() <= 1e-5

    before, _ = load_native(native_in, impl="miles", config=TINY)
    after, meta = load_native(native_out, impl="miles", config=TINY)
    assert meta["impl"] == "miles"
    assert set(before) == set(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
