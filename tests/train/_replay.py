"""The rollout that the routing-replay tests replay: a model's weights synced into the reference engine,
two samples of one prompt, and the experts the engine routed every token to."""

from __future__ import annotations

import torch


def synced_rollout(model, config):
    """``(ids [2, S], routed [2, S, n_layers, top-k])`` of two samples generated from ``model``'s synced weights
    (``-1`` where the engine recorded nothing: hash layers and positions past a sample)."""
    from rollout.reference_engine import ReferenceEngine, SamplingParams
    from rollout.weight_sync import sync_weights

    engine = ReferenceEngine(config)
    assert sync_weights(model, engine, version=1).ok
    samples = engine.generate([[0, 5, 6, 7, 8]], SamplingParams(max_new_tokens=6), n=2, seed=0)[0]
    ids = torch.tensor([x.prompt_ids + x.response_ids for x in samples])
    routed = torch.full((2, ids.shape[1], config.n_layers, config.n_activated_experts), -1)
    for i, x in enumerate(samples):
        routed[i, :x.routed_experts.shape[0]] = x.routed_experts
    return ids, routed
