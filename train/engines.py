"""Rollout engines: the protocol, published-weight decoding, and the built-in reference engine.

A rollout engine (the fifth plugin axis, ``dsv4_rollout_engines``; records in
:mod:`train.engines_plugin`) generates samples and takes weight updates:

* ``generate(prompts, params, *, n, seed) -> [[Sample] * n for each prompt]``;
* ``begin_update(version)`` / ``load_bucket([(official name, published tensor)])`` / ``finish_update()``;
* ``held_weights() -> {official name: tensor}`` - what it computes with (for the weight checker), or
  ``None`` when it cannot show them (a remote server);
* ``shutdown()``.

:class:`ReferenceEngine` generates with the reference model built from the EXPORTED, official-named
(HF) weights it was sent - never from the trainer's module - so every step exercises the real weight
sync path (export -> optional FP8 / NVFP4 publishing -> decode + load here -> weight checker). It has no
KV cache: each new token re-runs the prefix (fine for short tasks on small models). Sampling: temperature
and top-p; the log-probability of a sampled token is taken under ``softmax(logits / temperature)`` (the
full distribution, not the top-p truncated one), which is what the trainer recomputes. Routed experts
of the learned-routing layers are recorded per token when the token is first fed (the prompt at
prefill, each response token at the next decode step), like an engine with a KV cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .replay import RoutingRecorder, empty_routing, routing_context


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: Tuple[int, ...] = (1,)

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy decoding is not supported by the sampler)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


@dataclass
class Sample:
    prompt_ids: List[int]
    response_ids: List[int]                 # includes the stop token when finish_reason == "stop"
    logprobs: torch.Tensor                  # [len(response_ids)] fp32, rollout-side
    finish_reason: str = "length"           # "stop" | "length"
    routed_experts: Optional[torch.Tensor] = None  # [len(prompt)+len(response)-1, n_layers, k], -1 = none
    extra: Dict = field(default_factory=dict)


# ------------------------------------------------------- published weights
def decode_published(named: Iterable[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None
                     ) -> Dict[str, torch.Tensor]:
    """Published tensors (:func:`converters.publish.publish_bucket`) -> logical official tensors.

    FP8: ``x.weight`` (e4m3) + ``x.scale``; NVFP4: ``x.weight`` (uint8) + ``x.weight_scale`` +
    ``x.weight_scale_2``; anything else passes through. ``dtype`` is the dtype dequantised weights get
    (default fp32)."""
    from converters.fp8_quantizer import dequantize_fp8_blocks
    from converters.nvfp4 import nvfp4_dequantize

    items = dict(named)
    out: Dict[str, torch.Tensor] = {}
    used = set()
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for n, t in items.items():
        if n in used:
            continue
        base = n[: -len(".weight")] if n.endswith(".weight") else None
        if base is not None and n + "_scale" in items and n + "_scale_2" in items and t.dtype == torch.uint8:
            out[n] = nvfp4_dequantize(t, items[n + "_scale"], items[n + "_scale_2"], dtype=dtype or torch.float32)
            used.update((n + "_scale", n + "_scale_2"))
        elif base is not None and base + ".scale" in items and t.dtype == fp8:
            out[n] = dequantize_fp8_blocks(t, items[base + ".scale"], dtype=dtype or torch.float32)
            used.add(base + ".scale")
        else:
            out[n] = t
        used.add(n)
    return out


def top_p_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]`` -> (token ids [N], their log-probs under softmax(logits/T)) - fp32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p          # always keeps the top token
        sp = torch.where(keep, sp, torch.zeros_like(sp))
        choice = torch.multinomial(sp / sp.sum(-1, keepdim=True), 1, generator=generator)
        tok = si.gather(-1, choice).squeeze(-1)
    else:
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class RolloutEngineBase:
    name = "base"

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int, seed: int
                 ) -> List[List[Sample]]:
        raise NotImplementedError

    def begin_update(self, version: int) -> None:
        raise NotImplementedError

    def load_bucket(self, bucket: List[Tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def finish_update(self) -> None:
        raise NotImplementedError

    def held_weights(self) -> Optional[Dict[str, torch.Tensor]]:
        return None

    def shutdown(self) -> None:
        pass


class ReferenceEngine(RolloutEngineBase):
    """Generates with :class:`kernels.reference.model.DeepseekV4Model` from exported weights."""

    name = "reference"

    def __init__(self, config, *, dtype: torch.dtype = torch.float32, record_routing: bool = True,
                 device: str = "cpu"):
        from kernels.reference.model import DeepseekV4Model

        self.config, self.dtype, self.record_routing, self.device = config, dtype, record_routing, device
        self.model = DeepseekV4Model(config, device=device)
        if dtype != torch.float32:
            self.model.to(dtype)
        self.model.eval().requires_grad_(False)
        self.version: Optional[int] = None
        self._pending: Optional[Dict[str, torch.Tensor]] = None
        self._loaded_once = False

    # -- weights ---------------------------------------------------------
    def begin_update(self, version: int) -> None:
        self._pending = {}
        self._next_version = version

    def load_bucket(self, bucket) -> None:
        if self._pending is None:
            raise RuntimeError("load_bucket before begin_update")
        for n, t in decode_published(bucket, self.dtype).items():
            if n in self._pending:
                raise ValueError(f"weight update: {n!r} arrived twice")
            self._pending[n] = t

    def finish_update(self) -> None:
        got, self._pending = self._pending, None
        if got is None:
            raise RuntimeError("finish_update before begin_update")
        sd = self.model.state_dict()
        missing = sorted(set(sd) - set(got))
        extra = sorted(set(got) - set(sd))
        if extra or (missing and not self._loaded_once):
            raise ValueError(f"weight update does not fit the engine: missing {missing[:5]} "
                             f"({len(missing)}), unexpected {extra[:5]} ({len(extra)})")
        with torch.no_grad():
            for n, t in got.items():
                dst = sd[n]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"weight update: {n!r} has shape {tuple(t.shape)}, engine {tuple(dst.shape)}")
                dst.copy_(t.to(dst.device, dst.dtype))
        self._loaded_once = True
        self.version = self._next_version

    def held_weights(self):
        return dict(self.model.state_dict())

    # -- generation ------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, *, n: int, seed: int) -> List[List[Sample]]:
        if not self._loaded_once:
            raise RuntimeError("the reference engine has no weights yet (sync weights first)")
        out = []
        for pi, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed((int(seed) * 1_000_003 + pi * 9973 + 1) % (2 ** 63))
            out.append(self._generate_group(list(prompt), params, n, g))
        return out

    def _generate_group(self, prompt: List[int], params: SamplingParams, n: int, g: torch.Generator
                        ) -> List[Sample]:
        c = self.config
        P = len(prompt)
        ids = torch.tensor([prompt] * n, dtype=torch.long, device=self.device)
        routed = empty_routing(P + params.max_new_tokens, c).unsqueeze(0).repeat(n, 1, 1, 1)
        lps = torch.zeros(n, params.max_new_tokens)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), params.max_new_tokens, dtype=torch.long)
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long)
        pad = params.stop_token_ids[0] if params.stop_token_ids else 0
        for t in range(params.max_new_tokens):
            L = ids.shape[1]
            rec = RoutingRecorder(n, L) if self.record_routing else None
            with routing_context(rec):
                logits = self.model(ids)[:, -1]
            if rec is not None:
                first = 0 if t == 0 else L - 1   # positions fed for the first time in this forward
                for layer, idx in rec.layers.items():
                    routed[:, first:L, layer] = idx[:, first:L].cpu()
            tok, lp = top_p_sample(logits, params.temperature, params.top_p, g)
            tok = torch.where(done, torch.full_like(tok, pad), tok.cpu())
            lps[:, t] = torch.where(done, torch.zeros_like(lp), lp.cpu())
            ids = torch.cat([ids, tok[:, None].to(ids.device)], dim=1)
            newly = (~done) & torch.isin(tok, stops)
            lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
            done |= newly
            if bool(done.all()):
                break
        samples = []
        for i in range(n):
            R = int(lengths[i])
            resp = ids[i, P:P + R].tolist()
            finish = "stop" if resp and resp[-1] in params.stop_token_ids else "length"
            samples.append(Sample(prompt, resp, lps[i, :R].clone(), finish,
                                  routed[i, :P + R - 1].clone() if self.record_routing else None))
        return samples


def make_reference_engine(config, **kwargs) -> ReferenceEngine:
    """Factory named by the ``reference`` RolloutEngine record."""
    return ReferenceEngine(config, **kwargs)
