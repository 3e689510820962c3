"""The trainer's view of a model: the ``TrainModel`` protocol and its adapters.

The trainer never touches an implementation's internals. It needs (``TrainModel``):

* ``config`` - the :class:`core.config.ModelConfig`;
* ``forward_train(input_ids, *, routing_replay=None, temperature=1.0, with_mtp=False) -> TrainForward``:
  per-token log-probs ``[B, S-1]`` of ``log softmax(logits / temperature)`` at the next token, the MTP
  logits (when asked; computed with the output head and embedding DETACHED, so the MTP loss trains the
  MTP blocks and the trunk only) and the routing actually used in learned layers (for replay checks);
  ``routing_replay`` is ``[B, S, n_layers, k]`` (see :mod:`rollout.replay`); ``indexer_replay=[B, S, n_csa, k]``
  (keyword, the engine's indexer picks) replaces the forward's own top-k in every trunk CSA layer;
* ``logprobs(input_ids, routing_replay=None, temperature=1.0) -> [B, S-1]``;
* ``native_tensors()`` - ``(native name, tensor)`` of every contract tensor (weight sync, checkpoints);
* ``load_native_state(state)`` - the inverse (resume);
* ``parameters()`` / ``train()`` / ``eval()`` (an ``nn.Module``).

:class:`ReferenceTrainModel` wraps the reference model (official names inside; native names through
:mod:`core.weight_contract`). :class:`ImplTrainModel` wraps a module from an implementation's factory
(built by the assembly step, ``core.assembly``; native names already; BSHD or THD packed
per the run's ``qkv_format``; routing replay works because the shared router ``engine.moe.DSv4Router``
calls :func:`kernels.reference.moe.apply_routing_hook`). :func:`build_train_model` is the ONE place
where an implementation is plugged in (the run's implementation by default; ``"reference"`` only when
asked for explicitly or without a run config).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from core import weight_contract as wc
from core.thd import pack_rows

from engine.detached import detached_weights
from engine.row_gather import gather_rows
from kernels.reference.layers import label_logprobs
from rollout.logprobs import next_token_logprobs
from rollout.replay import IndexerPicksReplayer, RoutingRecorder, RoutingReplayer, indexer_context, routing_context

REFERENCE = "reference"


@dataclass
class TrainForward:
    logprobs: torch.Tensor                          # [B, S-1]
    mtp_logits: Optional[List[torch.Tensor]] = None  # per depth k: [B, S-1-k, V], on the model's device
    routing_used: Optional[Dict[int, torch.Tensor]] = None  # learned layer -> [B, S, k]
    aux_loss: Optional[torch.Tensor] = None          # implementation's own loss term (megatron: indexer KL)
    indexer_replay: Optional[Tuple[int, int]] = None  # indexer replay: (rows own picks = recorded, rows replayed)


@runtime_checkable
class TrainModel(Protocol):
    config: object

    def forward_train(self, input_ids: torch.Tensor, *, routing_replay: Optional[torch.Tensor] = None,
                      temperature: float = 1.0, with_mtp: bool = False) -> TrainForward: ...

    def logprobs(self, input_ids: torch.Tensor, routing_replay: Optional[torch.Tensor] = None,
                 temperature: float = 1.0) -> torch.Tensor: ...

    def native_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]: ...

    def load_native_state(self, state: Dict[str, torch.Tensor]) -> None: ...


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B,S,V]`` logits -> ``[B,S-1]`` log-probs of ``input_ids[:, 1:]`` under ``softmax(logits/T)``."""
    return next_token_logprobs(logits, temperature).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _hook_for(routing_replay, ids):
    return RoutingRecorder(ids.shape[0], ids.shape[1]) if routing_replay is None else RoutingReplayer(routing_replay)


def _used(hook) -> Dict[int, torch.Tensor]:
    return hook.used if isinstance(hook, RoutingReplayer) else hook.layers


class _TrainModelBase(nn.Module):
    def logprobs(self, input_ids, routing_replay=None, temperature: float = 1.0, **kw):
        return self.forward_train(input_ids, routing_replay=routing_replay, temperature=temperature, **kw).logprobs


class ReferenceTrainModel(_TrainModelBase):
    """The reference model (:class:`kernels.reference.model.DeepseekV4Model`) as a TrainModel, on ``device``
    (the run's: a GPU target's CUDA device). Inputs may live elsewhere (the trainer's batches are CPU tensors):
    the forward runs on ``device``, the log-probs are taken there too (the ``true_on_policy`` engine takes its
    log-probs with the same op on the same device) and come back next to the ids, as an implementation's do."""

    impl = REFERENCE

    def __init__(self, config, *, dtype: torch.dtype = torch.float32, seed: int = 0, device=None,
                 initialize: bool = True):
        super().__init__()
        from kernels.reference.model import DeepseekV4Model, init_weights

        self.config = config
        # true_on_policy: forward with kernels.reference.moe.row_invariant_experts, as the rollout engine does
        self.row_invariant = False
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.model = DeepseekV4Model(config)
        if initialize:
            init_weights(self.model, seed)    # CPU generators: the same values on every device
        else:                                 # a checkpoint fills it (see build_train_model)
            from core.finite import fill_unwritten_

            fill_unwritten_(self.model)
        if dtype != torch.float32:
            self.model.to(dtype)  # KeepFP32 modules keep their fp32 tensors
        self.model.to(self.device)

    def forward_train(self, input_ids, *, routing_replay=None, temperature: float = 1.0, with_mtp: bool = False,
                      indexer_replay=None):
        m = self.model
        from kernels.reference.moe import row_invariant_experts

        ids = input_ids.to(self.device)
        hook = _hook_for(routing_replay, input_ids)
        irep = IndexerPicksReplayer.of(m, self.config, indexer_replay)
        with routing_context(hook), (row_invariant_experts() if self.row_invariant else contextlib.nullcontext()):
            with indexer_context(irep):
                logits, streams = m(ids, return_hidden_streams=True)
            mtp = self._mtp_logits_detached(ids, streams) if with_mtp and len(m.mtp) else None
        lp = token_logprobs(logits, ids, temperature).to(input_ids.device)
        return TrainForward(lp, mtp, _used(hook), indexer_replay=irep and irep.result(REFERENCE))

    def _mtp_logits_detached(self, input_ids, streams) -> List[torch.Tensor]:
        """Like ``DeepseekV4Model.mtp_logits`` but the shared embedding and output head are detached."""
        from kernels.reference.layers import compute_dtype
        from kernels.reference.model import Block

        m = self.model
        emb_w, head_w = m.embed.weight.detach(), m.head.weight.detach()
        out, h = [], streams
        for k, block in enumerate(m.mtp):
            tau = input_ids[:, k + 1:]
            e = block.enorm(F.embedding(tau, emb_w))
            x = block.e_proj(e).unsqueeze(2) + block.h_proj(block.hnorm(h[:, :-1]))
            h = Block.forward(block, x, tau)
            y = block.collapse(h)
            ct = compute_dtype(y)
            out.append(F.linear(y.to(ct), head_w.to(ct)))
        return out

    # -- weights ---------------------------------------------------------
    def official_state(self) -> Dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def native_tensors(self):
        return wc.hf_to_native(self.model.state_dict().items(), self.config)

    def load_native_state(self, state):
        official = dict(wc.native_to_hf(state.items(), self.config))
        self.load_official_state(official)

    def load_official_state(self, official: Dict[str, torch.Tensor]) -> None:
        sd = self.model.state_dict()
        missing = sorted(set(sd) - set(official))
        extra = sorted(set(official) - set(sd))
        if missing or extra:
            raise ValueError(f"state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for n, t in official.items():
                sd[n].copy_(t.to(sd[n].dtype))

    def held_native_names(self):
        return None                                  # one process holds everything

    def native_shards(self):
        """``{name: (shape, [(offsets, tensor)])}``: one process, so every tensor is one whole piece."""
        return {n: (tuple(t.shape), [((0,) * t.dim(), t.detach())]) for n, t in self.native_tensors()}

    def load_checkpoint(self, path) -> None:
        from core.checkpoint import load_into, open_checkpoint

        load_into(self.model, open_checkpoint(path, config=self.config), progress=False)


@contextlib.contextmanager
def _reuse_hidden_streams(module: nn.Module):
    """For implementations whose ``mtp_logits`` recomputes the trunk through ``module.hidden_streams``
    (megatron): the first call in the context (the trunk forward) is computed and kept, a later call
    with the same ids / cu_seqlens returns it, so the MTP blocks read the very streams the main loss
    used (one trunk forward, as in the reference). Instance attribute; removed on exit."""
    orig = module.hidden_streams
    kept = []

    def hidden_streams(input_ids, cu_seqlens=None, *a, **kw):
        for ids, cu, out in kept:
            if ids.shape == input_ids.reshape(-1).shape and torch.equal(ids, input_ids.reshape(-1)) and (
                    (cu is None and cu_seqlens is None) or
                    (cu is not None and cu_seqlens is not None and torch.equal(cu, cu_seqlens))):
                return out
        out = orig(input_ids, cu_seqlens, *a, **kw)
        kept.append((input_ids.reshape(-1), cu_seqlens, out))
        return out

    module.hidden_streams = hidden_streams
    try:
        yield
    finally:
        del module.hidden_streams


class ImplTrainModel(_TrainModelBase):
    """A module built by an implementation's factory (through ``core.assembly``), native names.

    Layouts: ``qkv_format="bshd"`` runs ``module(ids [B, S])``; ``"thd"`` packs the rows into one stream
    (:func:`pack_rows`) and runs ``module(stream [T], cu_seqlens=cu)``; the module returns the next tokens'
    log-probs (``labels=``, ``temperature=``: its op table's ``head_logprobs``). MTP: the implementation's own
    ``mtp_logits`` run with the output head and the word embedding DETACHED (:func:`detached_weights`),
    on the trunk streams of the same forward; normalized to ``[B, S-1-k, V]`` per depth.
    ``indexer_loss_coeff`` (megatron's ``dsa_indexer_loss_coeff``): the forward asks for the indexer KL
    loss (``return_indexer_loss=True``) and returns it as ``TrainForward.aux_loss`` (None in eval).
    Routing replay works because the shared router calls ``apply_routing_hook``."""

    def __init__(self, module: nn.Module, config, impl: str, *, qkv_format: str = "bshd",
                 indexer_loss_coeff: Optional[float] = None, device: Optional[torch.device] = None):
        super().__init__()
        if qkv_format not in ("bshd", "thd"):
            raise ValueError(f"--impl {impl}: the trainer runs the bshd and thd layouts, not {qkv_format!r}")
        self.module, self.config, self.impl = module, config, impl
        self.qkv_format = qkv_format
        self.indexer_loss_coeff = indexer_loss_coeff
        self.device = torch.device("cpu") if device is None else torch.device(device)
        # true_on_policy: forward with kernels.reference.moe.row_invariant_experts (engine.moe honours it), as
        # the rollout engine that draws from this module does (rollout.reference_engine.TrainModuleEngine)
        self.row_invariant = False
        params = inspect.signature(module.mtp_logits).parameters if hasattr(module, "mtp_logits") else {}
        self._mtp_takes_streams = "hidden_streams" in params

    def _has_mtp(self) -> bool:
        return hasattr(self.module, "mtp_logits") and self.config.n_mtp_layers > 0

    def _check_replay_reached(self, routing_replay, hook) -> None:
        """A replayed forward of a model with learned-routing layers must have gone through the routing seam."""
        if routing_replay is not None and not hook.used and self.config.n_layers > self.config.n_hash_layers:
            raise NotImplementedError(f"--impl {self.impl}: its router does not call "
                                      f"kernels.reference.moe.apply_routing_hook, so routing replay cannot work")

    @property
    def packs_streams(self) -> bool:
        """True for THD: ``forward_train(..., lengths=...)`` packs the real tokens into one stream."""
        return self.qkv_format == "thd"

    def _call_module(self, stack: contextlib.ExitStack, x, with_mtp: bool, **kw):
        """One forward of the implementation: ``(logits, indexer aux loss or None, hidden streams or None)``.

        Asks for the hidden streams when the MTP block takes them, and otherwise (inside ``stack``)
        lets the implementation's ``mtp_logits`` reuse this forward's streams."""
        want_streams = with_mtp and self._mtp_takes_streams
        if want_streams:
            kw["return_hidden_streams"] = True
        if self.indexer_loss_coeff is not None:
            kw["return_indexer_loss"] = True
        if with_mtp and not self._mtp_takes_streams:
            stack.enter_context(_reuse_hidden_streams(self.module))
        out = self.module(x, **kw)
        if want_streams:
            return out[0], None, out[1]
        if self.indexer_loss_coeff is not None:
            return out[0], out[1], None
        return out, None, None

    def forward_train(self, input_ids, *, routing_replay=None, temperature: float = 1.0, with_mtp: bool = False,
                      lengths: Optional[List[int]] = None, indexer_replay=None):
        if lengths is not None:
            if not self.packs_streams:
                raise ValueError(f"--impl {self.impl}: packed micro-batches need --qkv-format thd")
            if self.row_invariant:
                raise ValueError(f"--impl {self.impl}: true_on_policy scores the padded rows, not packed "
                                 f"micro-batches (drop max_tokens_per_rank)")
            irep = IndexerPicksReplayer.of(self.module, self.config, self._stream_picks(indexer_replay, lengths))
            with indexer_context(irep):
                fwd = self._forward_stream(input_ids, list(lengths), routing_replay, temperature, with_mtp)
            fwd.indexer_replay = irep and irep.result(self.impl)
            return fwd
        if indexer_replay is not None and self.qkv_format == "thd":   # one segment per row (pack_rows)
            indexer_replay = indexer_replay.reshape(1, -1, *indexer_replay.shape[2:])
        irep = IndexerPicksReplayer.of(self.module, self.config, indexer_replay)
        with indexer_context(irep):
            lp, ids, hook, mtp, aux = self._forward_rows(input_ids, routing_replay, with_mtp, temperature)
        # log-probs on the model's device: only [B, S-1] of them travel, never the [B, S, vocab] logits
        lp = lp.to(input_ids.device)
        if aux is not None:
            aux = aux.to(input_ids.device)
        return TrainForward(lp, mtp, _used(hook), aux, irep and irep.result(self.impl))

    def forward_stage(self, input_ids, streams=None, *, routing_replay=None, temperature: float = 1.0,
                      with_mtp: bool = False):
        """This pipeline stage's forward (:func:`engine.pipeline.run_items`): ``(the streams [B, S, hc x d] for the
        next stage, or on the last stage the TrainForward; the routing of this stage's layers)``; ``streams``: the
        previous stage's (None on the first). ``with_mtp``: the token embeddings [B, S, d] travel after the streams
        (detached: the MTP loss does not train the embedding) to the last stage's MTP blocks."""
        from engine.layout import current
        from engine.pipeline import is_first, is_last

        m = getattr(self.module, "row_stage", self.module)   # a THD-only model's row API (backends.megatron.stage)
        ids, hook, c, dt = input_ids.to(self.device), _hook_for(routing_replay, input_ids), self.config, \
            m.tconfig.params_dtype
        x, emb = (None, None) if streams is None else (streams[..., :c.hc_mult * c.dim].reshape(
            *ids.shape, c.hc_mult, c.dim).to(self.device, dt), streams[..., c.hc_mult * c.dim:].to(self.device, dt))
        with routing_context(hook):
            emb = m.embedding(ids).detach() if with_mtp and is_first(current()) else emb
            if not is_last(current()):
                out = m.hidden_streams(ids, streams=x).flatten(2)
                return (torch.cat([out, emb.to(out.dtype)], -1) if with_mtp else out), _used(hook)
            logits, h = m(ids, streams=x, return_hidden_streams=True)
            with detached_weights(self.module):
                mtp = m.mtp_logits(ids, h, embedded=emb) if with_mtp and self._has_mtp() else None
        return TrainForward(token_logprobs(logits, ids, temperature).to(input_ids.device), mtp, _used(hook)), \
            _used(hook)

    def next_token_logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0
                            ) -> Tuple[torch.Tensor, Dict[int, torch.Tensor]]:
        """``[B, S]`` ids -> (``[B, S-1, V]`` log-probs of every next token on the model's device, the learned
        layers' routing ``{layer: idx [B, S, k]}``): the very forward and op of :meth:`forward_train` (which
        gathers the next token's entry from this tensor), for the ``true_on_policy`` engine that samples from
        this module (:class:`rollout.reference_engine.TrainModuleEngine`)."""
        logits, _ids, hook, _mtp, _aux = self._forward_rows(input_ids, None, False)
        return next_token_logprobs(logits, temperature), _used(hook)

    def _stream_picks(self, picks, lengths):
        """Indexer replay of a packed micro-batch: the rows' picks ``[B, S, n_csa, k]`` laid out as this rank's
        slice of the stream :meth:`_forward_stream` packs (``[1, n, n_csa, k]``, -1 on padding); None: None."""
        if picks is None:
            return None
        from engine.thd_attention import cp_group_info

        from .distributed import pack

        B, S = picks.shape[:2]
        cp, rank, _ = cp_group_info()
        (mb,) = pack(list(lengths), self.config, cp, None).micro_batches
        n = mb.num_tokens // cp
        flat = picks.reshape(B * S, *picks.shape[2:])
        stream = torch.full((mb.num_tokens,) + tuple(flat.shape[1:]), -1, dtype=flat.dtype)
        stream[:mb.num_real_tokens] = flat[torch.cat([i * S + torch.arange(L) for i, L in enumerate(lengths)])]
        return stream[rank * n:(rank + 1) * n][None]

    def _forward_rows(self, input_ids, routing_replay, with_mtp, temperature: Optional[float] = None):
        """Rows ``[B, S]`` (BSHD, or THD a segment per row) -> ``(logits [B, S, V] or with a ``temperature`` the next
        tokens' log-probs [B, S-1] (the module's ``head_logprobs``; under true_on_policy the engine's op,
        next_token_logprobs), ids on the model's device, routing hook, MTP logits or None, aux loss or None)``."""
        from kernels.reference.moe import row_invariant_experts

        B, S = input_ids.shape
        ids = input_ids.to(self.device)
        thd = self.qkv_format == "thd"
        x, cu = pack_rows(ids) if thd else (ids, None)
        with_mtp = with_mtp and self._has_mtp()
        hook = _hook_for(routing_replay, input_ids)
        mtp = None
        with routing_context(hook), contextlib.ExitStack() as stack:
            if self.row_invariant:
                stack.enter_context(row_invariant_experts())
            scored = temperature is not None and not self.row_invariant
            kw = {} if cu is None else {"cu_seqlens": cu, **self._kept_layout(x, cu)}
            if scored:        # the next tokens (a row's last label is the next row's first token: dropped)
                kw.update(labels=torch.roll(x, -1, dims=-1), temperature=temperature)
            out, aux, streams = self._call_module(stack, x, with_mtp, **kw)
            if with_mtp:
                with detached_weights(self.module):
                    mtp = list(self._mtp(ids, x, cu, streams))
        self._check_replay_reached(routing_replay, hook)
        if temperature is not None:
            out = out.reshape(B, S)[:, :-1] if scored else token_logprobs(out.reshape(B, S, -1), ids, temperature)
        return (out.reshape(B, S, -1) if temperature is None else out), ids, hook, mtp, aux

    def _kept_layout(self, x, cu) -> dict:
        """``layout=`` for a model that takes one (megatron's): rows of a shape pack into one stream (``pack_rows``),
        so its layout, indices and host facts are kept per shape (a new one cost ~60 host syncs a micro-batch)."""
        from engine.thd_attention import cp_group_info
        if "layout" not in inspect.signature(self.module.forward).parameters or cp_group_info()[0] > 1:
            return {}
        kept, key = self.__dict__.setdefault("_layouts", {}), (cu.numel() - 1, x.numel())   # rows, tokens
        if key not in kept:
            kept[key] = self.module.layout_for(x, cu)
        return {"layout": kept[key]}

    def _forward_stream(self, input_ids, lengths, routing_replay, temperature, with_mtp) -> TrainForward:
        """Rows ``[B, S]`` whose first ``lengths[i]`` tokens are real -> ONE packed stream of the real tokens
        (a segment per row, padded at its end per :func:`train.distributed.pad_rule`); this CP rank runs its
        contiguous slice. Log-probs / MTP logits of the local rows are all-gathered (backward: this rank's
        rows only, see :mod:`train.distributed`) and scattered back to ``[B, S-1]`` (0 past a row's end)."""
        from engine.thd_attention import cp_group_info

        from .distributed import pack

        B, S = input_ids.shape
        cp, rank, group = cp_group_info()
        if len(lengths) != B or any(n < 1 or n > S for n in lengths):
            raise ValueError(f"lengths {lengths} do not fit rows of shape {tuple(input_ids.shape)}")
        (mb,) = pack(lengths, self.config, cp, None).micro_batches
        T, real = mb.num_tokens, mb.num_real_tokens
        n = T // cp
        start = rank * n
        dev = self.device
        rows = torch.cat([i * S + torch.arange(L) for i, L in enumerate(lengths)])        # [real]
        stream = torch.zeros(T, dtype=torch.long)
        stream[:real] = input_ids.reshape(-1)[rows]
        cu = mb.cu_seqlens.to(dev)
        x = stream[start:start + n].to(dev)
        labels = torch.roll(stream, -1)[start:start + n].to(dev)
        if routing_replay is not None:
            flat = routing_replay.reshape(B * S, *routing_replay.shape[2:])
            sr = torch.full((T,) + tuple(flat.shape[1:]), -1, dtype=flat.dtype)
            sr[:real] = flat[rows]
            hook = RoutingReplayer(sr[start:start + n][None])
        else:
            hook = RoutingRecorder(1, n)
        raw_mtp = None
        with routing_context(hook), contextlib.ExitStack() as stack:
            scored = {} if self.row_invariant else dict(labels=labels.view_as(x), temperature=temperature)
            out, aux, streams = self._call_module(stack, x, with_mtp, cu_seqlens=cu, **scored)
            if with_mtp:
                with detached_weights(self.module):
                    if self._mtp_takes_streams:
                        raw_mtp = self.module.mtp_logits(x, streams, cu_seqlens=cu)
                    else:
                        raw_mtp = self.module.mtp_logits(x, cu)
        self._check_replay_reached(routing_replay, hook)
        lp_local = out.reshape(n) if scored else label_logprobs(out.reshape(n, -1), labels, temperature)
        # gathered on the model's device (NCCL needs it), then brought next to the ids
        lp = gather_rows(lp_local, cp, rank, group).to(input_ids.device)                     # [T]
        lp_rows = torch.zeros(B * S, dtype=lp.dtype).index_copy(0, rows, lp[:real]).reshape(B, S)[:, :-1]
        lens = torch.tensor(lengths)
        valid = torch.arange(S - 1)[None, :] < (lens[:, None] - 1)
        lp_rows = torch.where(valid, lp_rows, torch.zeros((), dtype=lp_rows.dtype))
        used = {}
        for layer, idx in _used(hook).items():
            full = gather_rows(idx.reshape(n, -1).to(dev), cp, rank, group, grad=False).to(input_ids.device)
            u = torch.full((B * S, full.shape[-1]), -1, dtype=full.dtype)
            u[rows] = full[:real]
            used[layer] = u.reshape(B, S, -1)
        mtp = None
        if raw_mtp is not None:
            mtp = []
            for k, m in enumerate(raw_mtp):
                W = S - 1 - k
                if isinstance(m, (tuple, list)):    # (logits [sum of shortened segments, V], cu_k); cp 1 only
                    lg, cu_k = m[0], m[1].tolist()
                    keep = [max(L - 1 - k, 0) for L in lengths]
                    src = torch.cat([cu_k[i] + torch.arange(w) for i, w in enumerate(keep)]).to(lg.device)
                    dst = torch.cat([i * W + torch.arange(w) for i, w in enumerate(keep)]).to(lg.device)
                    full = lg.new_zeros(B * W, lg.shape[-1]).index_copy(0, dst, lg[src])
                    mtp.append(full.reshape(B, W, -1))
                    continue
                m = gather_rows(m.reshape(n, -1).to(dev), cp, rank, group)             # stays on the device
                full = m.new_zeros(B * S, m.shape[-1]).index_copy(0, rows.to(m.device), m[:real])
                mtp.append(full.reshape(B, S, -1)[:, :W])
        if aux is not None:
            if cp > 1:  # this rank's share: the value becomes the stream's total, the gradient stays the share's
                total = aux.detach().clone()
                torch.distributed.all_reduce(total, group=group)
                aux = aux + (total - aux.detach())
            aux = aux.to(input_ids.device)
        return TrainForward(lp_rows, mtp, used, aux)

    def _mtp(self, ids, x, cu, streams) -> List[torch.Tensor]:
        """Per depth k: ``[B, S-1-k, V]`` (row i predicts ``ids[:, i+k+2]``)."""
        B, S = ids.shape
        m = self.module
        if cu is None:
            raw = m.mtp_logits(ids, streams) if self._mtp_takes_streams else m.mtp_logits(ids)
        elif self._mtp_takes_streams:
            raw = m.mtp_logits(x, streams, cu_seqlens=cu)
        else:
            raw = m.mtp_logits(x, cu)
        out = []
        for k, lg in enumerate(raw):
            n = S - 1 - k
            if isinstance(lg, (tuple, list)):        # (logits [sum of shortened segments, V], cu_k)
                lg = lg[0].reshape(B, n, -1)
            elif cu is not None:                     # same rows as the stream; rows past a segment are junk
                lg = lg.reshape(B, S, -1)[:, :n]
            out.append(lg)
        return out

    def native_tensors(self):
        return wc.module_tensors(self.module, self.config)

    def load_native_state(self, state):
        """FULL native tensors (any layout's checkpoint) -> this rank's share: its tensor-parallel slices and,
        under expert parallelism, its experts (``engine.loading.load_native_tensors``)."""
        from engine.loading import load_native_tensors

        missing = sorted(n for n in self.held_native_names() if n not in state)
        if missing:
            raise ValueError(f"native state lacks {len(missing)} tensors, e.g. {missing[:5]}")
        load_native_tensors(self.module, state.items(), strict=False)   # other ranks' experts are skipped there

    def held_native_names(self) -> set:
        """The contract tensors this rank holds (under expert parallelism: its experts): what it reads."""
        return {n for n, _ in self.native_tensors()}

    def native_shards(self):
        """``{contract name: (full shape, [(full offsets, view)])}``: where this rank's tensors lie in the full
        ones (tensor-parallel slices; its experts, whole), for checkpoints written piece by piece
        (``core.dcp_shards``; :meth:`load_native_shards` reads them back). The views share the tensors'
        memory."""
        from engine.layout import current as parallel_layout
        from engine.tp import full_shape, tp_pieces, tp_spec

        layout = parallel_layout()

        rank, world = layout.tp_rank, layout.tp
        out = {}
        for n, t in self.native_tensors():
            spec = tp_spec(t)
            flat = t.detach().view(-1)
            out[n] = (full_shape(t.shape, spec, world), tp_pieces(flat, tuple(t.shape), 0, spec, rank, world))
        return out

    @torch.no_grad()
    def load_native_shards(self, path) -> dict:
        """Read this rank's pieces of a native checkpoint (any layout's, or whole tensors) straight into its
        tensors: only the stored chunks overlapping them are read. Returns the checkpoint's metadata."""
        from engine.loading import load_native_slices

        return load_native_slices(self.native_tensors(), path, self.config)

    def full_native_tensors(self) -> Dict[str, torch.Tensor]:
        """Every contract tensor in FULL (tensor-parallel slices gathered, every expert-parallel rank's
        experts, every pipeline stage's tensors): a collective over the tensor-, expert- and pipeline groups."""
        from engine.loading import with_every_expert
        from engine.layout import current as parallel_layout
        from engine.tp import gather_tensor, tp_spec

        from engine.pipeline import full_stage_tensors

        group = parallel_layout().group("tp")
        local = {n: gather_tensor(t.detach(), tp_spec(t), group) for n, t in self.native_tensors()}
        return full_stage_tensors(with_every_expert(local), parallel_layout())   # and every pipeline stage's

    def load_checkpoint(self, path) -> None:
        """An HF checkpoint: this rank reads only its share (its tensor-parallel rows / columns, its experts;
        ``engine.loading.load_hf_tensors``)."""
        from core.checkpoint import open_checkpoint

        from engine.loading import load_hf_tensors

        load_hf_tensors(dict(self.native_tensors()), open_checkpoint(path, config=self.config), self.config)


class _FullView:
    """A training model's FULL native tensors, gathered once (what weight sync, checkpoints and export read)."""

    def __init__(self, model, tensors: Dict[str, torch.Tensor]):
        self.config = model.config
        self.impl = getattr(model, "impl", REFERENCE)
        self._tensors = tensors

    def native_tensors(self):
        return iter(self._tensors.items())


def full_view(model, groups=None):
    """``model`` itself on one rank; on several, a view of its full tensors (collective: every rank calls it)."""
    if groups is None or groups.world == 1 or not hasattr(model, "full_native_tensors"):
        return model
    return _FullView(model, model.full_native_tensors())


def setup_process(parts):
    """What a job does before building a model: the run's hardware target (``parts``, the run's
    ``core.assembly.Assembly``) sets the process up (on the CPU: megatron-core's shims) and, when no process
    group exists, starts a one-rank group with megatron's parallel state. Several-rank runs start their
    groups first (:func:`orchestration.launch.init_rank`). Returns the target."""
    from engine.thd_attention import cp_group_info

    import torch.distributed as dist

    cp = parts.run.cp
    if dist.is_initialized() and cp_group_info()[0] != cp:
        raise ValueError(f"--cp {cp}: this process's context-parallel group has "
                         f"{cp_group_info()[0]} ranks (orchestration.launch starts them)")
    return parts.setup_process()


def build_train_model(model_config, run_config=None, *, impl: Optional[str] = None,
                      dtype: Optional[torch.dtype] = None, seed: int = 0,
                      dsa_indexer_loss_coeff: Optional[float] = None,
                      compile_blocks: bool = False, cuda_graphs: bool = False,
                      recompute: str = "none", initialize: bool = True, parts=None) -> _TrainModelBase:
    """THE place an implementation is plugged in.

    ``impl``: ``None`` = the run's implementation (``run_config.impl``; ``"reference"`` without a run
    config), or ``"reference"`` explicitly (the reference model: for tests of the loop itself). An
    implementation's module comes from the assembly step (``core.assembly``: the run's implementation,
    kernel ops, hardware target and quantization scheme), in ``dtype`` (default: the run's ``--dtype``).
    ``dsa_indexer_loss_coeff``: weight of the indexer KL loss, for an implementation whose factory takes it
    (megatron); ``None`` = off. ``compile_blocks``: ``torch.compile`` the blocks in place (``engine.compile``);
    ``cuda_graphs``: in Inductor's reduce-overhead mode (the model may refuse: ``cuda_graphs_refusal``).
    ``recompute``: activation recomputation of the blocks (``engine.recompute``: none, selective, full).
    ``initialize=False``: the caller loads weights next (:func:`load_model_source`), so the random init is
    skipped (it took most of the startup of a large model: a one-core draw of every weight, all overwritten)
    and every floating weight starts as NaN instead; :func:`load_model_source` then checks that the load
    wrote them all (``core.finite.check_written``). ``parts``: the run's assembly (``core.assembly.assemble``), made
    once per rank by its caller (None: assembled here).
    """
    if parts is None and run_config is not None:
        from core.assembly import assemble

        parts = assemble(run_config)
    impl = impl or (run_config.impl if run_config is not None else REFERENCE)
    if impl == REFERENCE:
        if recompute != "none":
            raise ValueError(f"recompute={recompute!r} checkpoints the blocks of an implementation (miles, megatron); "
                             f"the reference training model has none: use recompute=none or train --impl miles|megatron")
        if compile_blocks:
            raise ValueError("--compile compiles the blocks of an implementation (miles, megatron); "
                             "the reference training model has none: drop --compile or train --impl miles|megatron")
        if dsa_indexer_loss_coeff is not None:
            raise ValueError("dsa_indexer_loss_coeff: the reference training model has no indexer KL loss")
        return ReferenceTrainModel(model_config, dtype=dtype or torch.float32, seed=seed,
                                   device=_reference_device(parts), initialize=initialize)
    if run_config is None:
        raise ValueError(f"--impl {impl}: building an implementation's training model needs the run config")
    if impl != run_config.impl:
        raise ValueError(f"train_impl {impl!r} is not the run's implementation ({run_config.impl!r}); "
                         f"use the run's or 'reference'")
    setup_process(parts)
    options = {} if dsa_indexer_loss_coeff is None else {"dsa_indexer_loss_coeff": float(dsa_indexer_loss_coeff)}
    torch.manual_seed(seed)
    module = parts.build_model(model_config, params_dtype=dtype, initialize=initialize, **options)
    from engine.layout import current
    from engine.pipeline import split_stage

    split_stage(module, model_config.n_layers, current())   # --pp: this stage's layers (global names) only
    parts.scheme.prepare_training(module)            # QAT: fake quantization; the other schemes: nothing
    device = parts.device()
    module.to(device)
    from engine.recompute import apply_recompute

    apply_recompute(module, recompute)               # before compiling: the compiled block calls the checkpoint
    if compile_blocks:
        from engine.compile import compile_blocks as compile_in_place

        compile_in_place(module, cuda_graphs=cuda_graphs)
    elif cuda_graphs:
        raise ValueError("cuda_graphs replays the compiled blocks: it needs compile_blocks (--compile)")
    return ImplTrainModel(module, model_config, impl, qkv_format=run_config.qkv_format,
                          indexer_loss_coeff=dsa_indexer_loss_coeff, device=device)


def _reference_device(parts):
    """The device of the reference training model: the run's (``parts``, its assembly: a GPU target's current CUDA
    device, set up as the target sets a process up: TF32 off), the CPU without a run config."""
    if parts is None:
        return torch.device("cpu")
    if parts.selection.hardware.gpu:
        parts.target.setup()
    return parts.device()


def load_model_source(model: _TrainModelBase, source) -> str:
    """Initialise weights from ``source``: an HF-format checkpoint folder (``config.json`` +
    safetensors), a native checkpoint folder (``dsv4 convert``; refused if written under
    pre-contract names), a megatron-core torch_dist folder (upstream names) or ``None``
    (deterministic init, already done). Returns a description. After any load, every weight of ``model`` must
    have been written (``core.finite.check_written``: a model built with ``initialize=False`` starts NaN)."""
    if source is None:
        return "random init"
    desc = _load_source(model, Path(str(source)), source)
    from core.finite import check_written

    check_written(model, source=desc)
    return desc


def _load_source(model: _TrainModelBase, p: Path, source) -> str:
    """The load of :func:`load_model_source` by the folder's kind; returns its description."""
    if p.is_dir():
        from converters.torch_dist import is_torch_dist_checkpoint, load_torch_dist
        from core.native_checkpoint import is_native_checkpoint, load_native

        if is_native_checkpoint(p):
            if hasattr(model, "load_native_shards"):      # an implementation: this rank's slices only
                meta = model.load_native_shards(p)
            else:                                         # the one-process reference model: everything
                state, meta = load_native(p, config=model.config)
                model.load_native_state(state)
            return f"native checkpoint {p} (written by --impl {meta['impl']})"
        if is_torch_dist_checkpoint(p):
            state, _config = load_torch_dist(p, model.config)
            model.load_native_state(state)
            return f"megatron-core torch_dist checkpoint {p}"
        model.load_checkpoint(p)
        return f"checkpoint {p}"
    raise FileNotFoundError(f"model source {source!r}: not a checkpoint folder")
