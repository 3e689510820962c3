"""Worker of test_native_tp_chunks.py: one gloo rank of a tp=world miles model loading native checkpoints by
both load paths (``engine.loading.load_weights``: ``dsv4 logprobs --checkpoint``; ``ImplTrainModel
.load_native_shards``: ``dsv4 train --model``), counting the bytes each load pulls out of the ``.distcp``
files per tensor."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch


@contextlib.contextmanager
def counting_reads():
    """Counts, per tensor name, the stored bytes DCP's file reader reads: every read item loads its stored
    chunk whole (``_StorageInfo.length`` bytes of its file), so their lengths are what reaches the process."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    real = FileSystemReader.read_data
    counts: Counter = Counter()

    def read_data(self, plan, planner):
        for req in plan.items:
            counts[req.storage_index.fqn] += self.storage_data[req.storage_index].length
        return real(self, plan, planner)

    FileSystemReader.read_data = read_data
    try:
        yield counts
    finally:
        FileSystemReader.read_data = real


def run(rank: int, world: int, port: int, cases: list, out_path: str) -> None:
    """``cases``: ``[(label, native checkpoint folder)]`` of one set of weights. Saves ``{"spec_mismatch",
    label: {path: {"differ", "bytes"}}}``: tensors whose ``core.tp_layout`` split is not the model's
    ``tp_spec``; per case and load path, the tensors that differ from the full (tp=1) read sliced, and the
    bytes read per tensor."""
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, tp=world, port=port)
    try:
        from core.assembly import assemble
        from core.native_checkpoint import load_native
        from core.tp_layout import tp_split
        from engine.loading import load_weights, native_tensors
        from engine.tp import shard_tensor, tp_spec
        from train.model import ImplTrainModel

        from ._helpers import TINY, run_config

        m = assemble(run_config(world)).build_model(TINY)
        tensors = native_tensors(m)
        out = {"spec_mismatch": sorted(n for n, t in tensors.items() if tp_split(n) != tp_spec(t))}
        for label, folder in cases:
            full, _meta = load_native(folder, config=TINY)          # the tp=1 read: whole tensors
            want = {n: shard_tensor(full[n], tp_spec(t), rank, world).to(t.dtype) for n, t in tensors.items()}
            out[label] = {}
            for how in ("load_weights", "load_native_shards"):
                for t in tensors.values():                         # the load must write every element
                    t.data.fill_(float("nan") if t.is_floating_point() else -1)
                with counting_reads() as counts:
                    if how == "load_weights":
                        load_weights(m, folder, TINY)
                    else:
                        ImplTrainModel(m, TINY, "miles").load_native_shards(folder)
                differ = sorted(n for n, t in tensors.items() if not torch.equal(t, want[n]))
                out[label][how] = {"differ": differ, "bytes": dict(counts)}
        torch.save(out, f"{out_path}.{rank}")
    finally:
        destroy_cpu_process_group()
