"""One rank of tests/train/test_sharded_checkpoint.py: writes its tensor-parallel pieces of the test tensors
with core.dcp_shards.save_pieces over a two-rank gloo group (argv: folder, rank, port)."""

import sys

import torch
import torch.distributed as dist

from core.dcp_shards import save_pieces
from engine.tp import full_shape, shard_tensor, tp_pieces

TP = 2
# name -> (full shape, tensor-parallel spec (dim, chunks) or None for a replicated tensor)
TENSORS = {"fc1": ((8, 6), (0, 2)), "proj": ((6, 8), (1, 1)), "norm": ((6,), None)}


def full_tensor(name: str) -> torch.Tensor:
    shape, _spec = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def pieces(rank: int, world: int = TP) -> dict:
    """This rank's pieces of every test tensor, as a model's tensor-parallel shards give them."""
    out = {}
    for name, (_shape, spec) in TENSORS.items():
        local = shard_tensor(full_tensor(name), spec, rank, world).contiguous()
        out[name] = (full_shape(local.shape, spec, world),
                     tp_pieces(local.reshape(-1), tuple(local.shape), 0, spec, rank, world))
    return out


if __name__ == "__main__":
    folder, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        save_pieces(folder, pieces(rank))
        # DCP's save ends with a broadcast from rank 0; a rank that tears its gloo sockets down while the other
        # is still sending aborts that one ("terminate called without an active exception"): meet first
        dist.barrier()
    finally:
        dist.destroy_process_group()
