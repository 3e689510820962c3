"""Scoring token sequences packed into one THD stream, with either implementation, tensor, context or
expert parallel.

``score_packed(checkpoint_dir, sequences, *, impl, cp=1, tp=1, ep=1, dtype="float32") -> list[list[float]]``

* All sequences are packed, in order, into **one** stream (``core.packing``): each sequence is a
  segment of ``cu_seqlens``, the stream is padded at its end (a pad segment of its own) to the multiple
  ``core.packing.required_pad_multiple(cp, ratios, tp)`` and to at least
  ``required_min_tokens_per_rank(cp, ratios)`` tokens per CP rank.
* ``cp * tp == 1`` runs in this process (setting up a one-process gloo group through the cpu hardware
  target if none exists). Otherwise ``cp * tp`` local processes are spawned (gloo on the CPU); CP rank
  ``r`` gets the contiguous slice ``r`` of the stream; log-probs are all-gathered over CP.
* ``ep > 1`` spawns ``ep`` processes that each hold ``1/ep`` of every layer's routed experts
  (``engine.expert_parallel``) and score their own share of the sequences (sequence ``i`` on rank
  ``i % ep``, packed into that rank's stream; a rank with none scores a pad stream, since every rank takes
  part in each layer's token exchange); rank 0 gathers the results.
* The result has the unpacked scorer's format (``launchers.stages.score``): per sequence the ``L - 1``
  values ``log P(t_{i+1} | t_{<=i})``; ``[]`` for sequences shorter than 2 tokens. So the two are
  directly comparable.

The run configuration is normalized through the combination table (``--qkv-format thd``, the CP
tokens-per-rank rule), so an impossible request fails with the same message as the CLI.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["score_packed", "pack_stream"]


def pack_stream(sequences: Sequence[Sequence[int]], ratios, *, cp: int = 1, tp: int = 1):
    """``(ids [T] int64, cu_seqlens [n(+1)+1], kept)``: the non-empty sequences packed into one padded
    stream; ``kept[i]`` is the segment of sequence ``i`` (``None`` for an empty one)."""
    from core.packing import pack_micro_batches, required_min_tokens_per_rank, required_pad_multiple

    kept, lens, flat = [], [], []
    for seq in sequences:
        if len(seq) == 0:
            kept.append(None)
            continue
        kept.append(len(lens))
        lens.append(len(seq))
        flat.extend(int(t) for t in seq)
    mult = required_pad_multiple(cp, ratios, tp)
    min_rank = required_min_tokens_per_rank(cp, ratios)
    if not lens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int64), kept
    per_rank = -(-(sum(lens) + mult) // cp) + mult + min_rank
    (mb,) = pack_micro_batches(lens, per_rank, cp=cp, pad_multiple=mult, min_tokens_per_rank=min_rank).micro_batches
    ids = torch.zeros(mb.num_tokens, dtype=torch.long)
    ids[: len(flat)] = torch.tensor(flat, dtype=torch.long)
    return ids, mb.cu_seqlens, kept


def _run_config(config, impl: str, cp: int, tp: int, tokens_per_rank: int, ep: int = 1):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    choices = Choices(impl=impl, tp=tp, cp=cp, ep=ep, qkv_format="thd", model=config,
                      max_tokens_per_rank=tokens_per_rank)
    return normalize(choices, make_host(third_party=False), model_name="checkpoint")


def _checkpoint_config(checkpoint_dir):
    from launchers.stages import checkpoint_config

    return checkpoint_config(Path(checkpoint_dir))


def _load_weights(model, checkpoint_dir, config) -> None:
    """HF (official names) or native checkpoint; each rank keeps its tensor-parallel shard."""
    from core.native_checkpoint import is_native_checkpoint, load_native
    from engine.loading import load_hf_checkpoint, load_native_tensors

    if is_native_checkpoint(checkpoint_dir):
        state, _ = load_native(checkpoint_dir, config=config)
        load_native_tensors(model, state.items())
    else:
        load_hf_checkpoint(model, checkpoint_dir, config)


def _stream_logprobs(checkpoint_dir, impl: str, cp: int, tp: int, dtype: str, ids, cu, ep: int = 1) -> torch.Tensor:
    """``[T]`` log-probs of the whole stream on every rank of this (already set up) process group."""
    from engine.thd_attention import ThdContext, cp_group_info, gather_sequence_cp

    config = _checkpoint_config(checkpoint_dir)
    run = _run_config(config, impl, cp, tp, ids.numel() // cp, ep)
    model = run.selection.impl.load()(config, run, params_dtype=getattr(torch, dtype))
    _load_weights(model, checkpoint_dir, config)
    model.eval()
    have_cp, rank, group = cp_group_info()
    ctx = ThdContext.build(cu, cp=have_cp, cp_rank=rank, group=group)
    start, n = ctx.layout.global_start, ctx.local_len
    with torch.no_grad():
        lp = model.logprobs(ids[start:start + n], cu).reshape(-1).float()
        return gather_sequence_cp(lp, ctx)


def _worker(rank: int, world: int, port: int, checkpoint_dir: str, impl: str, cp: int, tp: int, dtype: str,
            ids, cu, out_path: str) -> None:
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    CpuTarget().init_process_group(rank, world, tp=tp, cp=cp, port=port)
    try:
        lp = _stream_logprobs(checkpoint_dir, impl, cp, tp, dtype, ids, cu)
        if rank == 0:
            torch.save(lp, out_path)
    finally:
        destroy_cpu_process_group()


def _split(lp: torch.Tensor, cu, sequences, kept) -> list[list[float]]:
    """Per-sequence values of a stream's log-probs (``[]`` for sequences shorter than 2 tokens)."""
    bounds = cu.tolist()
    return [[] if seg is None or len(seq) < 2 else lp[bounds[seg]:bounds[seg + 1] - 1].tolist()
            for seq, seg in zip(sequences, kept)]


def _ep_worker(rank: int, ep: int, port: int, checkpoint_dir: str, impl: str, dtype: str, sequences,
               out_path: str) -> None:
    """One expert-parallel rank: scores sequences ``rank, rank + ep, ...`` in its own stream."""
    import torch.distributed as dist

    from backends.cpu.target import CpuTarget

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ep))
    target = CpuTarget()
    target.init_process_group(rank, ep, ep=ep, port=port)
    try:
        ratios = [r for r in _checkpoint_config(checkpoint_dir).compress_ratios if r]
        mine = list(sequences[rank::ep])
        # a rank with nothing to score runs a pad stream: its experts serve the other ranks' tokens
        ids, cu, kept = pack_stream(mine or [[0]], ratios)
        lp = _stream_logprobs(checkpoint_dir, impl, 1, 1, dtype, ids, cu, ep)
        parts = [None] * ep
        dist.all_gather_object(parts, _split(lp, cu, mine, kept))
        if rank == 0:
            torch.save(parts, out_path)
    finally:
        target.destroy_process_group()


def _score_expert_parallel(checkpoint_dir, sequences, impl: str, ep: int, dtype: str) -> list[list[float]]:
    import torch.multiprocessing as mp

    from backends.cpu.megatron_shims import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logprobs.pt"
        mp.spawn(_ep_worker, args=(ep, free_port(), str(checkpoint_dir), impl, dtype,
                                   [list(map(int, s)) for s in sequences], str(out)), nprocs=ep, join=True)
        parts = torch.load(out)
    return [parts[i % ep][i // ep] for i in range(len(sequences))]


def _in_process(checkpoint_dir, impl, dtype, ids, cu) -> torch.Tensor:
    import torch.distributed as dist

    from backends.cpu.target import CpuTarget

    if not dist.is_initialized():
        CpuTarget().init_process_group(0, 1, tp=1)
    return _stream_logprobs(checkpoint_dir, impl, 1, 1, dtype, ids, cu)


def score_packed(checkpoint_dir, sequences: Sequence[Sequence[int]], *, impl: str, cp: int = 1, tp: int = 1,
                 ep: int = 1, dtype: str = "float32") -> list[list[float]]:
    """Per-token log-probs of each sequence, all packed into one THD stream (see the module docstring)."""
    config = _checkpoint_config(checkpoint_dir)
    ratios = [r for r in config.compress_ratios if r]
    if ep > 1:
        _run_config(config, impl, cp, tp, None, ep)  # fail fast, in the caller, with the table's message
        return _score_expert_parallel(checkpoint_dir, sequences, impl, ep, dtype)
    ids, cu, kept = pack_stream(sequences, ratios, cp=cp, tp=tp)
    if ids.numel() == 0:
        return [[] for _ in sequences]
    _run_config(config, impl, cp, tp, ids.numel() // cp)  # fail fast, in the caller, with the table's message
    if cp * tp == 1:
        lp = _in_process(checkpoint_dir, impl, dtype, ids, cu)
    else:
        import torch.multiprocessing as mp

        from backends.cpu.megatron_shims import free_port

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "logprobs.pt"
            mp.spawn(_worker, args=(cp * tp, free_port(), str(checkpoint_dir), impl, cp, tp, dtype, ids, cu, str(out)),
                     nprocs=cp * tp, join=True)
            lp = torch.load(out)
    return _split(lp, cu, sequences, kept)
