"""Scoring token sequences packed into one THD stream, with either implementation, tensor, context or
expert parallel.

``score_packed(checkpoint_dir, sequences, run) -> list[list[float]]``: ``run`` is the normalized
:class:`core.run_config.RunConfig` of the command (implementation, kernel backend, hardware target, dtype,
parallel sizes); every process builds its model from it through the assembly step (``core.assembly``).

* All sequences are packed, in order, into **one** stream (``core.packing``): each sequence is a
  segment of ``cu_seqlens``, the stream is padded at its end (a pad segment of its own) to the multiple
  ``core.packing.required_pad_multiple(cp, ratios, tp)`` and to at least
  ``required_min_tokens_per_rank(cp, ratios)`` tokens per CP rank.
* ``cp * tp == 1`` runs in this process (setting up a one-process group through the run's hardware
  target if none exists). Otherwise ``cp * tp`` local processes are spawned, each set up by the run's
  hardware target (gloo on the CPU, NCCL on GPUs); CP rank ``r`` gets the contiguous slice ``r`` of the
  stream; log-probs are all-gathered over CP.
* ``ep > 1`` spawns ``ep`` processes that each hold ``1/ep`` of every layer's routed experts
  (``engine.expert_parallel``) and score their own share of the sequences (sequence ``i`` on rank
  ``i % ep``, packed into that rank's stream; a rank with none scores a pad stream, since every rank takes
  part in each layer's token exchange); rank 0 gathers the results.
* ``pp > 1`` (:func:`score_pipelined`) spawns ``pp`` processes, each one pipeline stage of the decoder layers
  (``engine.pipeline``), and runs every sequence as a row of its own through megatron-core's schedule (miles:
  BSHD; megatron: the row as one THD segment, ``backends.megatron.stage``; tensor, context and expert parallel 1).
* The result has the unpacked scorer's format (``launchers.stages.score``): per sequence the ``L - 1``
  values ``log P(t_{i+1} | t_{<=i})``; ``[]`` for sequences shorter than 2 tokens. So the two are
  directly comparable.

Once the stream's length is known, the run is checked again against the combination table with that
packing budget (the CP tokens-per-rank rule), every other choice as the user made it, so an impossible
request fails with the same message as the CLI.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["score_packed", "score_pipelined", "pack_stream"]


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


def _with_budget(run, tokens_per_rank):
    """``run`` checked again with the stream's tokens per CP rank as its packing budget."""
    from core.run_config import revalidated
    from launchers.builtin_plugins import make_host

    return revalidated(run, make_host(third_party=False), max_tokens_per_rank=tokens_per_rank)


def _stream_logprobs(parts, checkpoint_dir, ids, cu) -> torch.Tensor:
    """``[T]`` log-probs of the whole stream on every rank of this (already set up) process group;
    ``parts``: the run's assembly (``core.assembly``)."""
    from engine.loading import load_weights
    from engine.thd_attention import ThdContext, cp_group_info, gather_sequence_cp

    device = parts.device()
    model = parts.build_model(initialize=False)              # the checkpoint fills every weight (checked)
    load_weights(model, checkpoint_dir, parts.run.model)
    model.to(device).eval()
    have_cp, rank, group = cp_group_info()
    ctx = ThdContext.build(cu.to(device), cp=have_cp, cp_rank=rank, group=group)
    start, n = ctx.layout.global_start, ctx.local_len
    with torch.no_grad():
        lp = model.logprobs(ids[start:start + n].to(device), cu.to(device)).reshape(-1).float()
        return gather_sequence_cp(lp, ctx).cpu()


def _set_up_rank(run, rank: int, world: int, port: int):
    """This spawned process as rank ``rank`` of ``world``, through the run's hardware target; returns the
    run's assembly."""
    from core.assembly import assemble

    parts = assemble(run)
    if not run.selection.hardware.gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    parts.target.init_process_group(rank, world, tp=run.tp, cp=run.cp, ep=run.ep, pp=run.pp, port=port)
    return parts


def _worker(rank: int, port: int, run, checkpoint_dir: str, ids, cu, out_path: str) -> None:
    """One tensor- or context-parallel rank of the stream's scoring."""
    parts = _set_up_rank(run, rank, run.cp * run.tp, port)
    try:
        lp = _stream_logprobs(parts, checkpoint_dir, ids, cu)
        if rank == 0:
            torch.save(lp, out_path)
    finally:
        parts.target.destroy_process_group()


def _split(lp: torch.Tensor, cu, sequences, kept) -> list[list[float]]:
    """Per-sequence values of a stream's log-probs (``[]`` for sequences shorter than 2 tokens)."""
    bounds = cu.tolist()
    return [[] if seg is None or len(seq) < 2 else lp[bounds[seg]:bounds[seg + 1] - 1].tolist()
            for seq, seg in zip(sequences, kept)]


def _ep_worker(rank: int, port: int, run, checkpoint_dir: str, sequences, out_path: str) -> None:
    """One expert-parallel rank: scores sequences ``rank, rank + ep, ...`` in its own stream."""
    import torch.distributed as dist

    ep = run.ep
    parts = _set_up_rank(run, rank, ep, port)
    try:
        ratios = [r for r in run.model.compress_ratios if r]
        mine = list(sequences[rank::ep])
        # a rank with nothing to score runs a pad stream: its experts serve the other ranks' tokens
        ids, cu, kept = pack_stream(mine or [[0]], ratios)
        lp = _stream_logprobs(parts, checkpoint_dir, ids, cu)
        scored = [None] * ep
        dist.all_gather_object(scored, _split(lp, cu, mine, kept))
        if rank == 0:
            torch.save(scored, out_path)
    finally:
        parts.target.destroy_process_group()


def _pp_worker(rank: int, port: int, run, checkpoint_dir: str, sequences, out_path: str) -> None:
    """One pipeline stage (``engine.pipeline``: the model built whole, cut to this stage, the checkpoint's
    tensors of this stage loaded): every sequence is a micro-batch of one row through megatron-core's schedule,
    forward only (the megatron model runs the row as one packed segment: ``backends.megatron.stage``); the last
    stage takes the log-probs with the one-rank scorer's ops, rank 0 saves them."""
    from engine.layout import current
    from engine.loading import load_weights
    from engine.pipeline import from_last_stage, is_last, run_schedule, split_stage

    parts = _set_up_rank(run, rank, run.pp, port)
    try:
        layout, c, device = current(), run.model, parts.device()
        model = split_stage(parts.build_model(initialize=False), c.n_layers, layout)
        load_weights(model, checkpoint_dir, c)
        model.to(device).eval()
        rows = [i for i, seq in enumerate(sequences) if len(seq) > 1]
        ids = {i: torch.tensor(sequences[i], dtype=torch.long, device=device)[None] for i in rows}
        m = getattr(model, "row_stage", model)      # a THD-only model's row API: a row is one segment
        scored: dict = {}

        def stage(i, x):        # x: the previous stage's streams [1, S, hc x d] in fp32 (None on the first)
            streams = None if x is None else x.reshape(1, -1, c.hc_mult, c.dim).to(device, m.tconfig.params_dtype)
            if not is_last(layout):
                return m.hidden_streams(ids[i], streams=streams).flatten(2)
            logits = m(ids[i], streams=streams)[:, :-1]      # as the one-rank logprobs (a row, or its segment)
            return torch.log_softmax(logits, dim=-1).gather(-1, ids[i][:, 1:, None]).squeeze(-1)

        def keep(i, lp):
            scored[i] = lp[0].float().tolist()
            return lp.sum() * 0

        with torch.no_grad():
            if rows:
                run_schedule(rows, [tuple(ids[i].shape) for i in rows], c.hc_mult * c.dim, stage, keep,
                             forward_only=True)
        scored = from_last_stage(scored, layout)
        if rank == 0:
            torch.save([scored.get(i, []) for i in range(len(sequences))], out_path)
    finally:
        parts.target.destroy_process_group()


def score_pipelined(checkpoint_dir, sequences: Sequence[Sequence[int]], run) -> list[list[float]]:
    """Per-token log-probs of each sequence (one row each) on ``run.pp`` pipeline stages, one local
    process each; the output of the one-rank scorer (``launchers.stages.score``)."""
    return _spawn(_pp_worker, run.pp, run, str(checkpoint_dir), [list(map(int, s)) for s in sequences])


def _spawn(worker, nprocs: int, run, *args) -> object:
    """Run ``worker(rank, free port, run, *args, out_path)`` on ``nprocs`` local processes, started as the run's
    hardware target asks (``orchestration.local_workers``); rank 0's result. Rank 0 binds the port seconds after
    it was picked: taken in between, the ranks start again on another (``core.ports.on_free_port``)."""
    from core.assembly import assemble
    from core.ports import on_free_port
    from orchestration.local_workers import start_processes

    target = assemble(run).target
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pt"
        on_free_port(lambda port: start_processes(worker, (port, run, *args, str(out)), nprocs, target,
                                                  ["core.assembly"]), f"scoring: {nprocs} local ranks")
        return torch.load(out, weights_only=True)


def score_packed(checkpoint_dir, sequences: Sequence[Sequence[int]], run) -> list[list[float]]:
    """Per-token log-probs of each sequence, all packed into one THD stream (see the module docstring)."""
    ratios = [r for r in run.model.compress_ratios if r]
    if run.ep > 1:
        parts = _spawn(_ep_worker, run.ep, run, str(checkpoint_dir), [list(map(int, s)) for s in sequences])
        return [parts[i % run.ep][i // run.ep] for i in range(len(sequences))]
    ids, cu, kept = pack_stream(sequences, ratios, cp=run.cp, tp=run.tp)
    if ids.numel() == 0:
        return [[] for _ in sequences]
    run = _with_budget(run, ids.numel() // run.cp)  # fail fast, in the caller, with the table's message
    if run.cp * run.tp == 1:
        from core.assembly import assemble

        parts = assemble(run)
        parts.setup_process()      # a one-rank group when none exists
        lp = _stream_logprobs(parts, checkpoint_dir, ids, cu)
    else:
        lp = _spawn(_worker, run.cp * run.tp, run, str(checkpoint_dir), ids, cu)
    return _split(lp, cu, sequences, kept)
