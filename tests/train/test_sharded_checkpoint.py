"""Checkpoints as per-rank pieces (core.dcp_shards, engine.tp.tp_pieces): two gloo ranks each write their
tensor-parallel slices into their own files; a rank reads only the stored chunks its slice overlaps (proved by
removing the other rank's file), and any other layout reads the same folder back (resharding)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.tp import shard_tensor, tp_pieces

from ._dcp_worker import TENSORS, full_tensor

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from core.ports import on_free_port

    out = tmp_path_factory.mktemp("tp2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *(p for p in sys.path if p)]),
           "OMP_NUM_THREADS": "1"}

    def start(port: int) -> None:
        """Both ranks on ``port``; a failed rank's stderr is the error, so a port taken before rank 0's store
        bound it (a parallel test's) starts both again on another (core.ports.on_free_port)."""
        procs = [subprocess.Popen([sys.executable, "-m", "tests.train._dcp_worker", str(out), str(r), str(port)],
                                  cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]
        error = None
        try:
            for p in procs:
                _out, err = p.communicate(timeout=120)
                if p.returncode != 0:
                    error = err[-3000:]
                    break                    # the other rank waits on this one's store: stop it below
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        if error is not None:
            raise RuntimeError(error)

    on_free_port(start, "two DCP ranks")
    return out


def _writers(folder):
    """name -> {rank that wrote a chunk of it}, from the DCP metadata (read through the allow-list)."""
    from core.native_checkpoint import _read_dcp_metadata

    md = _read_dcp_metadata(folder)
    out = {}
    for index, info in md.storage_data.items():
        out.setdefault(index.fqn, []).append(int(info.relative_path.split("_")[2]))
    return out


def _read(folder, rank, world, names=tuple(TENSORS)):
    """The test tensors' ``rank``-of-``world`` slices, read from ``folder`` into fresh buffers."""
    from core.native_checkpoint import read_tensor_pieces

    bufs, wanted = {}, {}
    for name in names:
        shape, spec = TENSORS[name]
        local = torch.full(shard_tensor(torch.empty(shape), spec, rank, world).shape, float("nan"))
        bufs[name] = local
        wanted[name] = tp_pieces(local.view(-1), tuple(local.shape), 0, spec, rank, world)
    read_tensor_pieces(folder, wanted)
    return bufs


def test_each_rank_writes_only_its_slices(folder):
    writers = _writers(folder)
    assert sorted(writers["fc1"]) == [0, 0, 1, 1]      # two blocks (gate, up) per rank
    assert sorted(writers["proj"]) == [0, 1]
    assert len(writers["norm"]) == 1                   # replicated: written once
    assert sorted(p.name[:3] for p in folder.glob("*.distcp")) == ["__0", "__1"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_any_layout_reads_its_slices_back(folder, world):
    for rank in range(world):
        got = _read(folder, rank, world)
        for name, (_shape, spec) in TENSORS.items():
            assert torch.equal(got[name], shard_tensor(full_tensor(name), spec, rank, world)), (name, rank)


def test_a_rank_reads_only_the_chunks_its_slice_overlaps(folder, tmp_path):
    """With rank 1's data file gone, rank 0 of the same layout still reads its tensor-parallel slices; rank 1
    cannot (the replicated tensor lies in whichever file DCP gave it to, so it is left out)."""
    import shutil

    from core.native_checkpoint import NativeCheckpointError

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    for f in copy.glob("__1_*.distcp"):
        f.unlink()
    split = ("fc1", "proj")
    got = _read(copy, 0, 2, split)
    for name in split:
        assert torch.equal(got[name], shard_tensor(full_tensor(name), TENSORS[name][1], 0, 2)), name
    for name in split:
        with pytest.raises(NativeCheckpointError, match="cannot read the tensor data"):
            _read(copy, 1, 2, (name,))


def test_pieces_of_a_data_parallel_range_are_boxes_of_the_full_tensor():
    """The distributed optimizer's flat ranges of a tensor-parallel slice land where shard_tensor puts them."""
    full = torch.arange(48.).reshape(8, 6)
    for spec in [(0, 2), (1, 1), None]:
        for rank in range(2):
            local = shard_tensor(full, spec, rank, 2)
            n = local.numel()
            for start, end in [(0, n), (1, n - 1), (5, 13), (7, 8)]:
                flat = local.reshape(-1)[start:end].clone()
                got = tp_pieces(flat, tuple(local.shape), start, spec, rank, 2)
                assert sum(t.numel() for _o, t in got) == end - start
                for offsets, t in got:
                    box = tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))
                    assert torch.equal(full[box], t), (spec, rank, start, end, offsets)
