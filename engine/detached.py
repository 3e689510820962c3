"""A module's weights read as detached tensors inside a ``with`` block.

Why: DeepSeek-V4's MTP blocks share the word embedding and the output head with the trunk, and their loss must
not train either (the trainer's MTP loss, ``train.model.ImplTrainModel``); detaching the two weights for the MTP
forward keeps one set of parameters and sends no MTP gradient into them.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["detached_weights"]


@contextlib.contextmanager
def detached_weights(module: nn.Module, paths=("embedding.word_embeddings", "output_layer")):
    """Inside the context, ``<path>.weight`` of ``module`` reads as a DETACHED tensor (same storage), so
    whatever is computed with it sends no gradient to that parameter. Restored on exit."""
    held = []
    try:
        for path in paths:
            try:
                sub = module.get_submodule(path)
            except AttributeError:
                continue
            p = sub._parameters.get("weight")
            if p is None:
                continue
            held.append((sub, p))
            sub._parameters["weight"] = p.detach()   # bypasses nn.Module's Parameter-only assignment check
        yield
    finally:
        for sub, p in held:
            sub._parameters["weight"] = p
