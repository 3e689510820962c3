"""Sequence lengths checked against the model's maximum and the memory at hand, before anything is allocated.

Why: a token file (``dsv4 logprobs``) or SFT data with a sequence longer than the model's
``max_position_embeddings`` was run as given: the first large allocation failed with "can't allocate 4.5 GB"
(or 85.9 GB), shown as "unexpected RuntimeError", after the model had been built. Here the longest sequence
is held to the model's maximum, and the tokens' activations to the memory available on the device (a lower
bound: the fp32 logits and their log-softmax over the vocabulary, and a few block activations; the weights
are already placed), each refusal naming the sequence, its length, the limit and the fix.
"""

from __future__ import annotations

from typing import Optional, Sequence

from core.errors import UserInputError

__all__ = ["SequenceTooLong", "check_sequences", "tokens_bytes", "available_bytes"]


class SequenceTooLong(UserInputError):
    """A sequence is longer than the model takes, or than the memory at hand holds."""


def tokens_bytes(config, tokens: int, *, dtype_bytes: int = 4) -> int:
    """A lower bound of the bytes ``tokens`` tokens take at once in a forward pass: fp32 logits and their
    log-softmax over the vocabulary, and four block activations of ``hc_mult`` residual streams."""
    return tokens * (2 * config.vocab_size * 4 + 4 * config.hc_mult * config.dim * dtype_bytes)


def available_bytes(device: str = "cpu") -> Optional[int]:
    """Free memory of ``device`` ("cpu": the host's MemAvailable; "cuda": the current GPU's free bytes plus
    what PyTorch's caching allocator holds unused); None when it cannot be told."""
    if device.startswith("cuda"):
        try:
            import torch

            cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            return int(torch.cuda.mem_get_info()[0]) + max(0, int(cached))
        except Exception:
            return None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(65536).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_sequences(lengths: Sequence[int], config, *, source: str, rows_at_once: int = 1,
                    device: str = "cpu", dtype_bytes: int = 4) -> None:
    """Refuse the longest of ``lengths`` (``source`` names the file) when it exceeds the model's
    ``max_position_embeddings``, or when ``rows_at_once`` sequences of that length would not fit in the
    memory available on ``device``."""
    if not lengths:
        return
    longest = max(lengths)
    which = list(lengths).index(longest)
    limit = int(config.max_position_embeddings)
    if longest > limit:
        raise SequenceTooLong(f"{source}: sequence {which} has {longest:,} tokens, more than the model's maximum "
                              f"of {limit:,} (max_position_embeddings). Fix: shorten or split that sequence")
    need = tokens_bytes(config, longest * rows_at_once, dtype_bytes=dtype_bytes)
    free = available_bytes(device)
    if free is not None and need > free:
        raise SequenceTooLong(f"{source}: sequence {which} has {longest:,} tokens, which need at least "
                              f"{need / 2**30:,.1f} GiB for their logits and activations, more than the "
                              f"{free / 2**30:,.1f} GiB free on {device}. Fix: shorten or split that sequence, "
                              f"or run on a machine with more memory")
