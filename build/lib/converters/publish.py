"""Publishing a bucket of trained weights to a rollout engine (export + quantize).

:func:`publish_bucket` turns ``[(official name, tensor), ...]`` into the tensors
the engine loads, for a quantization scheme:

* ``"bf16"``: unchanged (detached).
* ``"fp8"`` / ``"mxfp4-fp8"``: allow-listed weights (:mod:`converters.quant_allowlist`)
  -> e4m3 + ue8m0 ``.scale``; ``"fp8-fp32"``: the same with fp32 scales.
* ``"nvfp4"``: routed experts -> NVFP4 (gate/up pairs share a global amax);
  everything else unchanged.

**No device-to-host synchronization**: only tensor ops, no ``.item()``,
``.tolist()``, tensor truthiness, ``nonzero`` or other data-dependent shapes.
Decisions are made from names and shapes (host data) only. The test suite
runs it under a dispatch mode that raises on every syncing op.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Tuple, Union

import torch

from .fp8_quantizer import quantize_for_publish
from .nvfp4 import quantize_experts_nvfp4

PUBLISH_SCHEMES = ("bf16", "fp8", "fp8-fp32", "mxfp4-fp8", "nvfp4")


def _scheme_name(scheme) -> str:
    name = scheme if isinstance(scheme, str) else getattr(scheme, "publish_format", None) or getattr(scheme, "name", None)
    if name not in PUBLISH_SCHEMES:
        raise ValueError(f"unknown publish scheme {scheme!r}; expected one of {PUBLISH_SCHEMES}")
    return name


def publish_bucket(named_tensors: Iterable[Tuple[str, torch.Tensor]],
                   scheme: Union[str, object] = "fp8") -> List[Tuple[str, torch.Tensor]]:
    """Export + quantize one bucket; returns ``[(name, tensor), ...]`` on the input device."""
    name = _scheme_name(scheme)
    items = [(n, t.detach()) for n, t in named_tensors]
    if name == "bf16":
        return items
    if name in ("fp8", "mxfp4-fp8", "fp8-fp32"):
        fmt = "fp32" if name == "fp8-fp32" else "ue8m0"
        out: List[Tuple[str, torch.Tensor]] = []
        for n, t in items:
            out += quantize_for_publish(n, t, fmt)
        return out
    return quantize_experts_nvfp4(items)


def publish_native_buckets(native_named_tensors: Iterable[Tuple[str, torch.Tensor]], config,
                           scheme: Union[str, object] = "fp8", *, max_bucket_bytes: int = 1 << 30,
                           dtype: torch.dtype = torch.bfloat16) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """The whole weight-sync path: native names -> official buckets
    (:func:`core.export.export_buckets`, atomic groups kept together, so an
    expert's w1/w3 share a bucket) -> :func:`publish_bucket`. Host-sync free
    as long as the export is."""
    from core.export import export_buckets
    for bucket in export_buckets(native_named_tensors, config, max_bucket_bytes=max_bucket_bytes, dtype=dtype):
        yield publish_bucket(bucket, scheme)
