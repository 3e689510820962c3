"""Export native weights to a rollout engine, and check what the engine holds.

* :func:`export_buckets` turns native ``(name, tensor)`` pairs (what either
  training implementation holds) into official-named tensors, streamed in
  size-bounded buckets. A bucket never splits an atomic export group
  (:data:`core.weight_contract.ATOMIC_EXPORT_GROUPS`): SGLang fuses
  wq_a+wkv and concatenates the compressor wkv+wgate halves as they arrive, the
  packed ``hc_*_scale`` needs all three alphas and ``linear_fc1`` yields w1+w3.
* :func:`check_weights` compares the tensors an engine would hold with the
  expected ones and names every problem, including the two the reference
  system shipped: an all-zero / all-(-1) ``tid2eid`` (a buffer that weight
  sync never read) and fp32-kept tensors (hc_*, attn_sink, ape, compressor
  norm) that arrived downcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from core import weight_contract as wc

__all__ = ["ExportError", "WeightIssue", "WeightCheckReport", "export_buckets", "check_weights",
           "tensor_nbytes"]


class ExportError(wc.WeightContractError):
    """Export input that breaks the contract (incomplete group, downcast fp32 tensor, ...)."""


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def export_buckets(native_named_tensors: Iterable[Tuple[str, torch.Tensor]], config, *,
                   max_bucket_bytes: int, dtype: Optional[torch.dtype] = None,
                   expect_complete: bool = False) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Yield lists of official ``(hf_name, tensor)`` of at most ``max_bucket_bytes`` each.

    Tensors of one atomic group are held until the whole group has arrived and
    then go out together, in one bucket; a group larger than the limit gets a
    bucket of its own. A group still incomplete when the input ends raises
    :class:`ExportError` naming the missing members. ``dtype`` (e.g. bf16)
    casts floating tensors, except that fp32-kept tensors always go out fp32
    (and one that arrives in lower precision raises: the precision is already
    lost). ``tid2eid`` is exported like any tensor (integer, as held).
    ``expect_complete`` raises at the end if a contract tensor never came (for
    instance a ``tid2eid`` registered as a buffer and missed by the caller).
    """
    if max_bucket_bytes <= 0:
        raise ValueError("max_bucket_bytes must be positive")
    seen: set = set()
    pending: Dict[tuple, Tuple[Tuple[str, ...], Tuple[str, ...], Dict[str, torch.Tensor]]] = {}
    bucket: List[Tuple[str, torch.Tensor]] = []
    bucket_bytes = 0

    def convert(members: Tuple[str, ...], got: Mapping[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
        out = []
        for hf_name, t in wc.native_to_hf(((n, got[n]) for n in members), config):
            t = t.detach()
            if t.is_floating_point():
                if wc.keeps_fp32(hf_name):
                    if t.dtype != torch.float32:
                        raise ExportError(
                            f"tensor {hf_name!r}: kept in fp32 by the weight contract but it arrived as "
                            f"{t.dtype} (from {', '.join(members)}); the training side downcast it")
                elif dtype is not None and t.dtype != dtype:
                    t = t.to(dtype)
            out.append((hf_name, t))
        return out

    for name, t in native_named_tensors:
        if name in seen:
            raise ExportError(f"tensor {name!r}: appears twice in the export stream")
        seen.add(name)
        key, members, _official = wc.export_unit(name, config)
        if len(members) == 1:
            unit = convert(members, {name: t})
        else:
            entry = pending.setdefault(key, (members, _official, {}))
            entry[2][name] = t
            if len(entry[2]) < len(members):
                continue
            del pending[key]
            unit = convert(members, entry[2])
        unit_bytes = sum(tensor_nbytes(x) for _, x in unit)
        if bucket and bucket_bytes + unit_bytes > max_bucket_bytes:
            yield bucket
            bucket, bucket_bytes = [], 0
        bucket.extend(unit)
        bucket_bytes += unit_bytes
        if bucket_bytes >= max_bucket_bytes:
            yield bucket
            bucket, bucket_bytes = [], 0

    if pending:
        parts = []
        for members, official, got in list(pending.values())[:5]:
            missing = [m for m in members if m not in got]
            parts.append(f"missing {', '.join(missing)} (group {', '.join(official)}; "
                         f"got {', '.join(m for m in members if m in got)})")
        more = f"; and {len(pending) - 5} more group(s)" if len(pending) > 5 else ""
        raise ExportError("export stream ended with incomplete atomic groups: " + "; ".join(parts) + more)
    if expect_complete:
        missing = [n for n in wc.native_names(config) if n not in seen]
        if missing:
            raise ExportError(f"{len(missing)} contract tensor(s) were never exported, e.g. {missing[:5]} "
                              f"(a Parameter registered as a buffer is not seen by weight sync)")
    if bucket:
        yield bucket


# ---------------------------------------------------------------- checker
@dataclass(frozen=True)
class WeightIssue:
    """One problem: ``kind`` in missing / extra / shape / dtype / value /
    nonfinite / tid2eid_degenerate / tid2eid_invalid / fp32_downcast."""

    kind: str
    name: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.name}: {self.detail}"


@dataclass
class WeightCheckReport:
    issues: List[WeightIssue] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.issues

    def __bool__(self) -> bool:
        return self.ok

    def of_kind(self, kind: str) -> List[WeightIssue]:
        return [i for i in self.issues if i.kind == kind]

    def names(self, kind: Optional[str] = None) -> List[str]:
        return [i.name for i in self.issues if kind is None or i.kind == kind]

    def summary(self, limit: int = 20) -> str:
        if self.ok:
            return f"weights OK ({self.checked} tensors compared)"
        lines = [f"{len(self.issues)} weight issue(s) in {self.checked} tensors:"]
        lines += [f"  {i}" for i in self.issues[:limit]]
        if len(self.issues) > limit:
            lines.append(f"  ... and {len(self.issues) - limit} more")
        return "\n".join(lines)

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise ExportError(self.summary())


def _is_tid2eid(name: str) -> bool:
    return name.endswith("tid2eid")


def check_weights(exported: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], *,
                  atol: float = 0.0, rtol: float = 0.0) -> WeightCheckReport:
    """Compare what a rollout engine would hold (``exported``) with ``reference``.

    Both map official names to tensors. Reports missing and extra names,
    shape and dtype mismatches, value mismatches (``|a-b| <= atol + rtol*|b|``;
    exact by default; integer tables compared exactly), non-finite values, any
    ``tid2eid`` that is all 0 or all -1 or has negative entries (regardless of
    the reference), and fp32-kept tensors (hc_*, attn_sink, ape, compressor
    norm, expert_bias) that are not fp32 although the reference is (or has no
    entry): the official checkpoint stores the compressor norm in bf16, so a
    bf16 reference there is not a downcast.
    """
    rep = WeightCheckReport()
    add = lambda kind, name, detail: rep.issues.append(WeightIssue(kind, name, detail))  # noqa: E731
    for name in reference:
        if name not in exported:
            add("missing", name, "expected but not exported")
    for name in exported:
        if name not in reference:
            add("extra", name, "exported but not expected")

    for name, got in exported.items():
        got = got.detach() if isinstance(got, torch.Tensor) else got
        if not isinstance(got, torch.Tensor):
            add("dtype", name, f"not a tensor ({type(got).__name__})")
            continue
        if _is_tid2eid(name) or wc.is_integer_tensor(name):
            if got.is_floating_point():
                add("dtype", name, f"tid2eid must be an integer table, got {got.dtype}")
            elif got.numel():
                if bool((got == 0).all()):
                    add("tid2eid_degenerate", name, "all entries are 0 (the routing table never reached "
                        "the engine: was tid2eid a buffer instead of a Parameter?)")
                elif bool((got == -1).all()):
                    add("tid2eid_degenerate", name, "all entries are -1 (the unfilled initial table)")
                elif bool((got < 0).any()):
                    add("tid2eid_invalid", name, f"{int((got < 0).sum())} negative expert ids")
        if got.is_floating_point() and wc.keeps_fp32(name) and got.dtype != torch.float32:
            ref = reference.get(name)
            if not isinstance(ref, torch.Tensor) or ref.dtype == torch.float32:
                add("fp32_downcast", name, f"kept in fp32 by the weight contract, got {got.dtype}")
        if got.is_floating_point() and got.numel() and not bool(torch.isfinite(got).all()):
            add("nonfinite", name, f"{int((~torch.isfinite(got)).sum())} NaN/inf values")

        if name not in reference:
            continue
        want = reference[name].detach()
        rep.checked += 1
        if tuple(got.shape) != tuple(want.shape):
            add("shape", name, f"shape {tuple(got.shape)} != expected {tuple(want.shape)}")
            continue
        if got.dtype != want.dtype and not _lossless_upcast(want.dtype, got.dtype):
            add("dtype", name, f"dtype {got.dtype} != expected {want.dtype}")
        if got.device != want.device:
            got = got.to(want.device)
        if not got.is_floating_point() and not want.is_floating_point():
            if not torch.equal(got.to(torch.int64), want.to(torch.int64)):
                n = int((got.to(torch.int64) != want.to(torch.int64)).sum())
                add("value", name, f"{n} of {want.numel()} entries differ")
            continue
        a, b = got.to(torch.float64), want.to(torch.float64)
        same_nan = torch.isnan(a) & torch.isnan(b)
        close = (a == b) | same_nan
        if atol or rtol:
            close |= (a - b).abs() <= atol + rtol * b.abs()
        if not bool(close.all()):
            bad = ~close
            diff = (a - b).abs()[bad]
            add("value", name, f"{int(bad.sum())} of {want.numel()} values differ "
                f"(max |diff| {float(diff.max()):.3g})")
    return rep


def _lossless_upcast(sent: torch.dtype, held: torch.dtype) -> bool:
    """An engine may hold a 16-bit float it was sent as fp32 (the reference model keeps its norms in fp32):
    every value converts exactly, so the values check alone decides."""
    return sent in (torch.bfloat16, torch.float16) and held == torch.float32
