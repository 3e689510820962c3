"""Weight transports of ``--orchestrator ray`` that skip Ray's object store (``--weight-transport``, issue #22).

Why: the object store copies every published bucket to host memory and back on each step. A data-parallel
leader's engine actor can instead receive the bucket's bytes straight from the leader's device:

* **gloo / nccl** (a torch.distributed broadcast): each leader and its engine actor form a process group of
  their own, created once per run (:class:`CollectiveSender`, :func:`open_group`). Per bucket the leader sends
  the metadata through Ray (names, dtypes, shapes, byte offsets: small) and the bytes by a ``broadcast`` from
  group rank 0 (the leader); the engine actor receives them into a buffer on its device and loads them through
  its own ``load_bucket``. ``nccl`` moves GPU memory (NVLink / InfiniBand); ``gloo`` runs the same code over
  host memory, so the CPU tests exercise the path the GPUs take. The CLI names the backend that runs: nothing
  picks one for the user.
* **cuda-ipc** (an engine sharing its leader's GPU, colocated): the leader packs the bucket into one CUDA
  buffer and hands the engine an IPC handle to it (:func:`share_cuda`, torch's own ``reduce_tensor``); the
  engine opens it (:func:`open_shared`), copies it, acknowledges, and only then does the leader free it.

Both pack a bucket into one flat ``uint8`` buffer (:func:`pack_bucket` / :func:`unpack_bucket`): one
collective or one handle per bucket whatever the tensors' dtypes (fp8 and packed nvfp4 included, which not
every backend reduces), and the bytes arrive unchanged, so the engine holds bit for bit what was published.

Why a directly built process group: a trainer actor already has torch.distributed's default group (its
training ranks), and ``init_process_group`` may run once per process; ``new_group`` can only take ranks of
that default group, and the engine actors are not in it. So the leader serves a fresh ``TCPStore`` (its node's
address, a port the OS picks; both go to the engine actors through Ray) and each side constructs the backend
object itself: ``ProcessGroupGloo(store, rank, size, timeout)`` or ``ProcessGroupNCCL(store, rank, size,
options)`` (the constructors ``init_process_group`` itself calls, public in ``torch.distributed`` of torch
2.11 and 2.13), used through its ``broadcast`` method. No global state of torch.distributed is touched, so the
trainer's own groups are unaffected.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["COLLECTIVE_TRANSPORTS", "GROUP_TIMEOUT_S", "pack_bucket", "unpack_bucket", "open_group",
           "receive_bucket", "CollectiveSender", "share_cuda", "open_shared"]

COLLECTIVE_TRANSPORTS = ("gloo", "nccl")   # --weight-transport values that are torch.distributed backends
GROUP_TIMEOUT_S = 600.0                    # a peer that never joins or never sends fails the collective then
_ALIGN = 16                                # each tensor's bytes start at a multiple: any dtype views them in place
_IPC_DEVICE_ARG = 6                        # the device index in reduce_tensor's rebuild arguments (torch 2.x)

# (name, dtype name, shape, byte offset, byte count) of each tensor of a bucket
Entry = Tuple[str, str, Tuple[int, ...], int, int]


def pack_bucket(bucket: Sequence[Tuple[str, torch.Tensor]], device) -> Tuple[Tuple[int, List[Entry]], torch.Tensor]:
    """``((total bytes, entries), buffer)``: the bucket's tensors, byte for byte, in one ``uint8`` buffer on
    ``device``; the entries are what :func:`unpack_bucket` needs to cut it apart again."""
    entries, offset = [], 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    total = max(offset, _ALIGN)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for (_name, _dtype, _shape, start, nbytes), (_n, t) in zip(entries, bucket):
        if nbytes:
            buffer[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return (total, entries), buffer


def unpack_bucket(meta: Tuple[int, List[Entry]], buffer: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """The bucket :func:`pack_bucket` packed, as views of ``buffer`` (nothing copied)."""
    total, entries = meta
    if buffer.numel() != total or buffer.dtype != torch.uint8:
        raise ValueError(f"weight bucket: a {buffer.numel()}-byte {buffer.dtype} buffer for {total} packed bytes")
    return [(name, buffer[start:start + nbytes].view(getattr(torch, dtype)).reshape(shape))
            for name, dtype, shape, start, nbytes in entries]


def _broadcast_options():
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def open_group(backend: str, store, rank: int, world: int):
    """A ``backend`` process group of ``world`` ranks over ``store``, built directly (module docstring)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("--weight-transport nccl: this torch has no NCCL (a CPU build?)")
        options = dist.ProcessGroupNCCL.Options()       # as init_process_group fills them for a new group
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.group_name = "dsv4-weight-sync"
        options.global_ranks_in_group = list(range(world))
        return dist.ProcessGroupNCCL(store, rank, world, options)
    raise ValueError(f"unknown collective weight transport {backend!r}; valid: {', '.join(COLLECTIVE_TRANSPORTS)}")


def join_group(backend: str, host: str, port: int, rank: int, world: int):
    """The engine actor's side of :meth:`CollectiveSender.connect`: its group with the leader's store."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world, False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    return open_group(backend, store, rank, world)


def transport_device(backend: str) -> torch.device:
    """Where a collective's buffers live: the process's GPU for nccl (Ray's ``CUDA_VISIBLE_DEVICES`` leaves it
    one), host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def receive_bucket(group, backend: str, meta) -> List[Tuple[str, torch.Tensor]]:
    """The engine actor's side of :meth:`CollectiveSender.send`: the bucket, received from group rank 0."""
    buffer = torch.empty(meta[0], dtype=torch.uint8, device=transport_device(backend))
    group.broadcast([buffer], _broadcast_options()).wait()
    return unpack_bucket(meta, buffer)


class CollectiveSender:
    """The leader's end of its group with its engine actors (group ranks 1..N, rank 0 the leader)."""

    def __init__(self, backend: str, actors: Sequence[Any]):
        self.backend, self.actors = backend, list(actors)
        self.group = None
        self._store = None        # kept alive: the engines' clients talk to the server it runs

    def connect(self) -> None:
        """Serve a store on this node, have every engine actor join through Ray, join as rank 0."""
        import ray
        import torch.distributed as dist

        host, world = ray.util.get_node_ip_address(), len(self.actors) + 1
        self._store = dist.TCPStore(host, 0, world, True, timeout=timedelta(seconds=GROUP_TIMEOUT_S),
                                    wait_for_workers=False)
        joins = [a.join_group.remote(self.backend, host, self._store.port, r + 1, world)
                 for r, a in enumerate(self.actors)]
        self.group = open_group(self.backend, self._store, 0, world)   # gloo: returns once every rank joined
        ray.get(joins)
        from reporting.run_log import log

        log.info(f"weight transport {self.backend}: a process group of this trainer rank and {len(self.actors)} "
                 f"engine actor(s), its store at {host}:{self._store.port}")

    def send(self, bucket) -> List[Any]:
        """Broadcast one published bucket; returns the engine actors' ``receive_bucket`` calls (refs)."""
        if self.group is None:
            self.connect()
        meta, buffer = pack_bucket(bucket, transport_device(self.backend))
        calls = [a.receive_bucket.remote(meta) for a in self.actors]   # sent first: they post the receive
        self.group.broadcast([buffer], _broadcast_options()).wait()
        if buffer.is_cuda:   # wait() orders the current stream only: the buffer is reused once it has gone
            torch.cuda.current_stream(buffer.device).synchronize()
        return calls


# -- CUDA IPC -------------------------------------------------------------------------------------------------
def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share_cuda(buffer: torch.Tensor) -> Tuple[str, Any, tuple]:
    """``(the GPU's UUID, rebuild function, its arguments)``: an IPC handle to ``buffer`` that Ray can ship;
    the caller keeps ``buffer`` alive until the receiver has copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not buffer.is_cuda:
        raise ValueError("--weight-transport cuda-ipc shares CUDA tensors only")
    torch.cuda.current_stream(buffer.device).synchronize()
    rebuild, args = reduce_tensor(buffer)
    return _device_uuid(buffer.device.index), rebuild, args


def open_shared(handle: Tuple[str, Any, tuple]) -> torch.Tensor:
    """The tensor :func:`share_cuda` shared, opened in this process on the same physical GPU (found by UUID:
    the two processes may number their visible GPUs differently)."""
    uuid, rebuild, args = handle
    local: Optional[int] = next((i for i in range(torch.cuda.device_count()) if _device_uuid(i) == uuid), None)
    if local is None:
        raise RuntimeError(f"--weight-transport cuda-ipc: the trainer's GPU {uuid} is not visible to this engine "
                           f"actor; it needs the engine on its leader's GPU (colocated, no --rollout-num-gpus)")
    args = list(args)
    args[_IPC_DEVICE_ARG] = local
    return rebuild(*args)
