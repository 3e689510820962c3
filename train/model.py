"""The trainer's view of a model: the ``TrainModel`` protocol and its adapters.

The trainer never touches an implementation's internals. It needs (``TrainModel``):

* ``config`` - the :class:`core.config.ModelConfig`;
* ``forward_train(input_ids, *, routing_replay=None, temperature=1.0, with_mtp=False) -> TrainForward``:
  per-token log-probs ``[B, S-1]`` of ``log softmax(logits / temperature)`` at the next token, the MTP
  logits (when asked; computed with the output head and embedding DETACHED, so the MTP loss trains the
  MTP blocks and the trunk only) and the routing actually used in learned layers (for replay checks);
  ``routing_replay`` is ``[B, S, n_layers, k]`` (see :mod:`train.replay`);
* ``logprobs(input_ids, routing_replay=None, temperature=1.0) -> [B, S-1]``;
* ``native_tensors()`` - ``(native name, tensor)`` of every contract tensor (weight sync, checkpoints);
* ``load_native_state(state)`` - the inverse (resume);
* ``parameters()`` / ``train()`` / ``eval()`` (an ``nn.Module``).

:class:`ReferenceTrainModel` wraps the reference model (official names inside; native names through
:mod:`core.weight_contract`). :class:`ImplTrainModel` wraps a module from an implementation's
``build_model(model_config, run_config)`` (native names already; routing replay works when its router
calls :func:`kernels.reference.moe.apply_routing_hook`). :func:`build_train_model` is the ONE place
where an implementation is plugged in.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from core import weight_contract as wc

from .replay import RoutingRecorder, RoutingReplayer, routing_context

REFERENCE = "reference"


@dataclass
class TrainForward:
    logprobs: torch.Tensor                          # [B, S-1]
    mtp_logits: Optional[List[torch.Tensor]] = None  # per depth k: [B, S-1-k, V]
    routing_used: Optional[Dict[int, torch.Tensor]] = None  # learned layer -> [B, S, k]


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
    lg = logits[:, :-1].float()
    if temperature != 1.0:
        lg = lg / temperature
    return torch.log_softmax(lg, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _hook_for(routing_replay, ids):
    if routing_replay is not None:
        return RoutingReplayer(routing_replay)
    return RoutingRecorder(ids.shape[0], ids.shape[1])


def _used(hook) -> Dict[int, torch.Tensor]:
    return hook.used if isinstance(hook, RoutingReplayer) else hook.layers


class _TrainModelBase(nn.Module):
    def logprobs(self, input_ids, routing_replay=None, temperature: float = 1.0):
        return self.forward_train(input_ids, routing_replay=routing_replay, temperature=temperature).logprobs


class ReferenceTrainModel(_TrainModelBase):
    """The reference model (:class:`kernels.reference.model.DeepseekV4Model`) as a TrainModel."""

    impl = REFERENCE

    def __init__(self, config, *, dtype: torch.dtype = torch.float32, seed: int = 0):
        super().__init__()
        from kernels.reference.model import DeepseekV4Model, init_weights

        self.config = config
        self.model = DeepseekV4Model(config)
        init_weights(self.model, seed)
        if dtype != torch.float32:
            self.model.to(dtype)  # KeepFP32 modules keep their fp32 tensors

    def forward_train(self, input_ids, *, routing_replay=None, temperature: float = 1.0, with_mtp: bool = False):
        m = self.model
        hook = _hook_for(routing_replay, input_ids)
        with routing_context(hook):
            logits, streams = m(input_ids, return_hidden_streams=True)
            mtp = self._mtp_logits_detached(input_ids, streams) if with_mtp and len(m.mtp) else None
        return TrainForward(token_logprobs(logits, input_ids, temperature), mtp, _used(hook))

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

    def load_checkpoint(self, path) -> None:
        from core.checkpoint import load_into, open_checkpoint

        load_into(self.model, open_checkpoint(path, config=self.config), progress=False)


class ImplTrainModel(_TrainModelBase):
    """A module from ``backends.<impl>.impl.build_model`` (native names; ``logprobs`` / ``forward``)."""

    def __init__(self, module: nn.Module, config, impl: str):
        super().__init__()
        self.module, self.config, self.impl = module, config, impl

    def forward_train(self, input_ids, *, routing_replay=None, temperature: float = 1.0, with_mtp: bool = False):
        hook = _hook_for(routing_replay, input_ids)
        with routing_context(hook):
            if with_mtp and hasattr(self.module, "mtp_logits"):
                logits, streams = self.module(input_ids, return_hidden_streams=True)
                mtp = self.module.mtp_logits(input_ids, streams)  # TODO(impls): detached head/embedding
            else:
                logits, mtp = self.module(input_ids), None
        if routing_replay is not None and not hook.used:
            raise NotImplementedError(f"--impl {self.impl}: its router does not call "
                                      f"kernels.reference.moe.apply_routing_hook, so routing replay cannot work")
        return TrainForward(token_logprobs(logits, input_ids, temperature), mtp, _used(hook))

    def native_tensors(self):
        return wc.module_tensors(self.module, self.config)

    def load_native_state(self, state):
        targets = dict(self.native_tensors())
        missing = sorted(set(targets) - set(state))
        if missing:
            raise ValueError(f"native state lacks {len(missing)} tensors, e.g. {missing[:5]}")
        with torch.no_grad():
            for n, t in targets.items():
                t.copy_(state[n].to(t.dtype))

    def load_checkpoint(self, path) -> None:
        from core.checkpoint import open_checkpoint

        reader = open_checkpoint(path, config=self.config)
        self.load_native_state(dict(wc.hf_to_native(reader.iter_tensors(dequantize=True, dtype=torch.float32,
                                                                           progress=False), self.config)))


def build_train_model(model_config, run_config=None, *, impl: Optional[str] = None,
                      dtype: torch.dtype = torch.float32, seed: int = 0) -> _TrainModelBase:
    """THE place an implementation is plugged in.

    ``impl``: ``"reference"`` (default while the megatron-core implementations are being written) or an
    attention-impl name (``miles``, ``megatron``), whose ``backends.<impl>.impl.build_model(model_config,
    run_config)`` builds the module. ``None`` -> ``"reference"``.
    """
    impl = impl or REFERENCE
    if impl == REFERENCE:
        return ReferenceTrainModel(model_config, dtype=dtype, seed=seed)
    torch.manual_seed(seed)
    mod = importlib.import_module(f"backends.{impl}.impl")
    module = mod.build_model(model_config, run_config, params_dtype=dtype)
    return ImplTrainModel(module, model_config, impl)


def load_model_source(model: _TrainModelBase, source) -> str:
    """Initialise weights from ``source``: an HF-format checkpoint folder (``config.json`` +
    safetensors) or ``None`` (deterministic init, already done). Returns a description."""
    if source is None:
        return "random init"
    p = Path(str(source))
    if p.is_dir():
        model.load_checkpoint(p)
        return f"checkpoint {p}"
    raise FileNotFoundError(f"model source {source!r}: not a checkpoint folder")
