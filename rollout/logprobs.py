"""The one next-token log-prob op that the trainer and the ``true_on_policy`` engine share.

Why here: the trainer (:func:`train.model.token_logprobs`) scores samples with it, and the engine that draws from
the trainer's module (:class:`rollout.reference_engine.TrainModuleEngine`) and the built-in engine's uncached path
sample from it, on the same shape, so a sample's log-prob equals the trainer's bit for bit
(docs/rollout.md#true-on-policy). The rollout side sits below the trainer, so the op lives on this side.
"""

from __future__ import annotations

import torch


def next_token_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B,S,V]`` logits -> ``[B,S-1,V]`` log-probs of every next token under ``softmax(logits/T)``."""
    lg = logits[:, :-1].float()
    if temperature != 1.0:
        lg = lg / temperature
    return torch.log_softmax(lg, dim=-1)
