"""Weight sync: trainer (native names) -> export buckets -> publish (bf16 / fp8 / nvfp4) -> engine -> check.

:func:`sync_weights` runs the whole path every step:

1. ``train_model.native_tensors()`` (the contract names both implementations hold);
2. :func:`core.export.export_buckets` -> official-named buckets (atomic groups kept together), cast to
   the engine's dtype except fp32-kept tensors (``lossless``: every tensor in the trainer's own dtype, for the
   true-on-policy engine);
3. :func:`converters.publish.publish_bucket` with the publish scheme (``bf16`` = unchanged);
4. ``engine.begin_update / load_bucket / finish_update``;
5. :func:`core.export.check_weights`: what the engine now holds (``held_weights()``) against the
   decoded published tensors - names, shapes, dtypes (fp32-kept tensors must still be fp32), values
   (exactly), ``tid2eid`` tables (not all 0 / -1). For quantized schemes the quantization error against
   the unquantized export is reported as ``max_quant_rel_err`` (max |deq - w| / max|w| per tensor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from core.finite import check_finite
from core.export import WeightCheckReport, check_weights, export_buckets, tensor_nbytes

from .reference_engine import decode_published, published_in_fp32

DEFAULT_BUCKET_BYTES = 64 << 20

# the HF checkpoint weight format that holds weights published in each format (converters.publish)
_CHECKPOINT_FORMAT = {"bf16": "bf16", "fp8": "fp8"}


def checkpoint_format(publish_format: str, *, purpose: str) -> str:
    """The HF checkpoint weight format (``write_checkpoint``) of weights published as ``publish_format``; a
    one-line error for a format no checkpoint writer here produces (NVFP4). ``purpose`` says what needs it."""
    from core.errors import UserInputError

    fmt = _CHECKPOINT_FORMAT.get(publish_format)
    if fmt is None:
        raise UserInputError(f"{purpose} needs an HF checkpoint in the published format {publish_format}, and "
                             f"dsv4 writes checkpoints in {' or '.join(sorted(_CHECKPOINT_FORMAT))} only. Fix: "
                             f"choose a --quant that publishes one of those")
    return fmt


@dataclass
class SyncReport:
    seconds: float
    buckets: int
    tensors: int
    bytes: int
    check: Optional[WeightCheckReport]
    max_quant_rel_err: float = 0.0
    shared_bytes: int = 0           # bytes the engine reads in place (rollout.shared_weights), none moved

    @property
    def ok(self) -> bool:
        return self.check is None or self.check.ok


def _expected_dtype(name: str, t: torch.Tensor, engine_dtype: torch.dtype) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    if published_in_fp32(name):
        return t.to(torch.float32)
    return t.to(engine_dtype)


def sync_weights(train_model, engine, *, version: int, scheme: str = "bf16",
                 engine_dtype: torch.dtype = torch.float32, max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 check: bool = True, lossless: bool = False) -> SyncReport:
    """``lossless``: send every tensor in the dtype the trainer holds it in, not cast to ``engine_dtype`` (the
    ``true_on_policy`` engine holds the reference training model's own dtypes: in a bf16 run its RMSNorm weights
    are fp32 and, once trained, not bf16 values); only with the ``bf16`` scheme (weights published as they are)."""
    from converters.publish import publish_bucket

    if lossless and scheme != "bf16":
        raise ValueError(f"lossless weight sync publishes the weights as they are, and scheme {scheme!r} quantizes "
                         f"them. Fix: use scheme 'bf16' (--quant bf16)")
    t0 = time.perf_counter()
    config = train_model.config
    export_dtype = None if engine_dtype == torch.float32 or lossless else engine_dtype
    expected: Dict[str, torch.Tensor] = {}
    n_buckets = n_tensors = n_bytes = 0
    max_err = 0.0
    engine.begin_update(version)
    with torch.no_grad():
        native = ((n, t.detach()) for n, t in train_model.native_tensors())
        for bucket in export_buckets(native, config, max_bucket_bytes=max_bucket_bytes, dtype=export_dtype,
                                     expect_complete=True):
            check_finite(bucket, where=f"weight sync to the rollout engine (version {version})")
            published = publish_bucket(bucket, scheme)
            engine.load_bucket(published)
            n_buckets += 1
            n_tensors += len(bucket)
            n_bytes += sum(tensor_nbytes(t) for _, t in published)
            if check:
                decoded = decode_published(published, engine_dtype)
                for name, t in bucket:
                    want = decoded[name] if lossless else _expected_dtype(name, decoded[name], engine_dtype)
                    expected[name] = want
                    if scheme != "bf16" and t.is_floating_point() and t.numel():
                        scale = float(t.abs().max())
                        if scale > 0:
                            err = float((want.float() - t.float()).abs().max()) / scale
                            max_err = max(max_err, err)
    engine.finish_update()
    report = None
    if check:
        held = engine.held_weights()
        if held is not None:
            report = check_weights(held, expected)
    return SyncReport(time.perf_counter() - t0, n_buckets, n_tensors, n_bytes, report, max_err)
