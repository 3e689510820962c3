"""A native checkpoint from ``save_native`` (``dsv4 convert``) stores each tensor that tensor parallelism splits
as chunks along its split dim (``core.tp_layout``), so a tensor-parallel rank reads only its slice: two gloo
ranks of a tp=2 miles model load it by both load paths, every tensor equals the tp=1 read sliced, and the
bytes a rank pulls out of the ``.distcp`` files for the split tensors are half of theirs (replicated tensors
whole). A checkpoint of one chunk per tensor (written before) loads the same values, reading the split tensors
whole (``linear_fc1`` twice: once per half). Any DCP reader (plain torch, a one-rank load) reads the chunked folder whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.cpu_ranks import PORT, spawn_cpu_ranks
from core.tp_layout import MAX_TP, tp_chunk_boxes, tp_split

from . import _native_chunk_worker
from ._helpers import TINY, official_from_checkpoint, perturb

WORLD = 2


def _one_chunk_checkpoint(path, state, chunked):
    """A native checkpoint as written before the chunked layout: ``dcp.save`` of the state (one chunk per
    tensor) and the same ``dsv4_native.json``."""
    import torch.distributed.checkpoint as dcp

    from core.native_checkpoint import META_FILE

    path.mkdir()
    dcp.save({n: t.contiguous() for n, t in state.items()}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    shutil.copy2(chunked / META_FILE, path / META_FILE)
    return path


def _stored(folder):
    """``{name: ([(offsets, sizes)], stored bytes)}`` from the DCP metadata."""
    from core.dcp_shards import stored_chunks
    from core.native_checkpoint import _read_dcp_metadata

    md = _read_dcp_metadata(Path(folder))
    total = {}
    for index, info in md.storage_data.items():
        total[index.fqn] = total.get(index.fqn, 0) + info.length
    return {n: (stored_chunks(md, n), total[n]) for n in md.state_dict_metadata}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from core.checkpoint import prepare_checkpoint
    from core.native_checkpoint import save_native
    from core.weight_contract import hf_to_native

    root = tmp_path_factory.mktemp("native")
    state = dict(hf_to_native(perturb(official_from_checkpoint(
        prepare_checkpoint(root / "hf", TINY, dtype="bf16", seed=3))).items(), TINY))
    chunked = save_native(root / "chunked", state, impl="miles", config=TINY)
    return state, chunked, _one_chunk_checkpoint(root / "one_chunk", state, chunked)


def test_chunk_boxes_cut_at_every_tensor_parallel_boundary():
    assert tp_chunk_boxes("decoder.final_layernorm.weight", (64,)) == [((0,), (64,))]
    fc2 = tp_chunk_boxes("decoder.layers.0.mlp.experts.linear_fc2.weight3", (32, 128))
    assert fc2 == [((0, 16 * i), (32, 16)) for i in range(MAX_TP)]
    fc1 = tp_chunk_boxes("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", (24, 32))   # 2 blocks of 12
    assert fc1 == [((3 * i, 0), (3, 32)) for i in range(8)]                                     # 4 parts each
    assert tp_chunk_boxes("output_layer.weight", (7, 32)) == [((0, 0), (7, 32))]                # odd: whole
    assert tp_split("decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight") == (0, 2)  # Bridge's name


def test_save_native_stores_split_tensors_as_chunks_and_any_reader_reads_them(checkpoints):
    import torch.distributed.checkpoint as dcp

    from core.native_checkpoint import load_native, native_model_config

    state, chunked, one_chunk = checkpoints
    stored = _stored(chunked)
    split = [n for n in state if tp_split(n) is not None]
    assert split and len(split) < len(state)
    for name, t in state.items():
        assert stored[name][0] == tp_chunk_boxes(name, t.shape), name
        assert (len(stored[name][0]) > 1) == (name in split), name
    assert all(len(chunks) == 1 for chunks, _b in _stored(one_chunk).values())
    assert native_model_config(chunked) == native_model_config(one_chunk)
    for folder in (chunked, one_chunk):                       # this repo's whole-tensor reader (tp=1)
        got, _meta = load_native(folder, config=TINY)
        assert got.keys() == state.keys() and all(torch.equal(got[n], t) for n, t in state.items())
    plain = {n: torch.empty_like(t) for n, t in state.items()}   # torch's own DCP reader, no planner of ours
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(chunked)), no_dist=True)
    assert all(torch.equal(plain[n], t) for n, t in state.items())


def test_tp_ranks_read_only_their_chunks(checkpoints, tmp_path):
    state, chunked, one_chunk = checkpoints
    out = tmp_path / "reads"
    cases = [("chunked", str(chunked)), ("one_chunk", str(one_chunk))]
    spawn_cpu_ranks(_native_chunk_worker.run, (WORLD, PORT, cases, str(out)), WORLD)

    split = {n for n in state if tp_split(n) is not None}
    for rank in range(WORLD):
        res = torch.load(f"{out}.{rank}")
        assert res["spec_mismatch"] == [], res["spec_mismatch"]      # the table is the model's split
        for label, folder in cases:
            stored = {n: b for n, (_c, b) in _stored(folder).items()}
            whole = sum(stored[n] for n in split)
            for how, r in res[label].items():
                assert r["differ"] == [], (rank, label, how, r["differ"][:5])
                got = r["bytes"]
                assert set(got) == set(state), (label, how)
                assert all(got[n] == stored[n] for n in state if n not in split), (label, how)   # replicated
                read = sum(got[n] for n in split)
                if label == "chunked":
                    assert read == pytest.approx(whole / WORLD, rel=0.01), (rank, how, read, whole)
                    assert all(got[n] < stored[n] for n in split), (rank, how)
                else:      # one chunk per tensor: read whole, as before (linear_fc1 once per half it holds)
                    assert all(got[n] == stored[n] * tp_split(n)[1] for n in split), (rank, how)
