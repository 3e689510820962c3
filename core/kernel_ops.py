"""A kernel backend's ops as one typed table, and the record of which kernels ran.

Why a table of its own rather than a namespace: the models call ``ops.sparse_attention_with_sink(...)``
without knowing which backend answers, so the answer must be visible somewhere else. Every op in an
:class:`OpTable` is wrapped once, when the table is built, to count its calls under
``"<backend>.<op>"`` (the backend that really provides the op: a GPU backend's table names ``none``
for the ops it takes from the reference set). Tests and ``dsv4`` read the counts with
:func:`kernels_ran`; a test that claims a backend ran asserts it there.

What is counted: in eager code, every call. Under ``torch.compile`` (``engine.compile``), a call is
counted when Dynamo traces it (once per compilation of the calling code, again on a recompile), not on
the compiled graph's runs: the op is then a node of the graph (a reference op's torch code, or a kernel
backend's ``torch.library`` custom ops, ``kernels.gpu_ops``), and a count in a traced op records which
backend's code the graph holds. An op that ``engine.compile`` keeps out of the graph
(``torch.compiler.disable``) runs eagerly and is counted on every call.

Only the standard library is imported at module level (listing plugins never imports torch).
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, Iterable, Mapping, Optional

__all__ = ["OP_NAMES", "INDEXER_INPUTS", "OpTable", "kernels_ran", "reset_kernels_ran"]

# Every op a kernel backend provides (the reference set; a GPU backend answers the ones it has kernels for
# and names the reference op for the rest). A backend may add extras (the GPU backends' THD entry points).
OP_NAMES = (
    "sparse_attention_with_sink",
    "indexer_scores",
    "hadamard_transform",
    "sinkhorn",
    "hc_pre",
    "hc_post",
    "hc_head",
    "apply_rope",
    "rms_normalize",
    "rms_norm",
    "weighted_swiglu",
    "head_logprobs",
)

# The dtype an op table's ``indexer_scores`` takes its ``q`` and ``k`` in (``OpTable.indexer_inputs``):
# "compute": the compute dtype (fp32; fp64 for fp64 activations), the reference op's contract;
# "activation": the model's activation dtype (bf16 in a bf16 run), a bf16/fp16 kernel's (fp32 accumulation).
INDEXER_INPUTS = ("compute", "activation")

# The reference ops' backend (``--kernel-backend none``; kernels.reference.backend.NAME, which core cannot import).
REFERENCE_BACKEND = "none"

_RAN: collections.Counter = collections.Counter()


def kernels_ran() -> dict:
    """``{"<backend>.<op>": calls}`` since the last :func:`reset_kernels_ran` (a copy; under ``torch.compile``
    a call counts when traced, see the module docstring)."""
    return dict(_RAN)


def reset_kernels_ran() -> None:
    _RAN.clear()


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def _count(key: str) -> bool:
    _RAN[key] += 1
    return True


_count_traced: Optional[Callable] = None


def _trace_counter() -> Callable:
    """:func:`_count` for traced code: ``torch.compiler.assume_constant_result`` makes Dynamo run it once
    while tracing (and bake in its result) instead of tracing the counter's update, which would guard the
    graph on the counts and recompile it on every call. Made when a table is built (torch is imported
    then: a table holds torch functions), so the traced wrapper only reads a global."""
    global _count_traced
    if _count_traced is None:
        import torch

        _count_traced = torch.compiler.assume_constant_result(_count)
    return _count_traced


def _counted(key: str, fn: Callable) -> Callable:
    _trace_counter()

    @functools.wraps(fn)  # keeps __module__ and marks (``traceable``): engine.compile reads them
    def op(*args, **kwargs):
        if _compiling():
            _count_traced(key)
        else:
            _count(key)
        return fn(*args, **kwargs)

    op.counted_as = key
    return op


class OpTable:
    """The ops of one kernel backend, by op name, each counted (see the module docstring).

    ``backend``: the backend's name; ``dtypes``: the compute dtypes its own kernels serve (``None`` =
    any); ``own``: its own ops; ``delegated``: ops it takes from another backend (``{name: (backend,
    fn)}``: the reference set, for a GPU backend without a kernel for that op).

    ``indexer_inputs`` (one of :data:`INDEXER_INPUTS`): the dtype this table's ``indexer_scores`` takes ``q``
    and ``k`` in, declared here so that every caller casts them by one rule
    (:func:`kernels.reference.indexer.indexer_input_dtype`) and the precision is on the record: ``"compute"``
    (default; the reference op) or ``"activation"`` (a bf16/fp16 GPU kernel: this backend's own, or another
    GPU backend's it includes; a table whose ``indexer_scores`` is the reference op cannot declare it).
    """

    def __init__(self, backend: str, own: Mapping[str, Callable], *,
                 delegated: Optional[Mapping[str, tuple]] = None, dtypes: Optional[Iterable[str]] = None,
                 indexer_inputs: str = "compute"):
        if indexer_inputs not in INDEXER_INPUTS:
            raise ValueError(f"kernel backend {backend!r}: indexer_inputs must be one of {INDEXER_INPUTS}, "
                             f"got {indexer_inputs!r}")
        self.backend = backend
        self.dtypes = None if dtypes is None else frozenset(dtypes)
        self.indexer_inputs = indexer_inputs
        self.provider: dict[str, str] = {}
        self._ops: dict[str, Callable] = {}
        for name, (who, fn) in {**(delegated or {}), **{n: (backend, f) for n, f in own.items()}}.items():
            self.provider[name] = who
            self._ops[name] = fn if getattr(fn, "counted_as", None) else _counted(f"{who}.{name}", fn)
        missing = [n for n in OP_NAMES if n not in self._ops]
        if missing:
            raise TypeError(f"kernel backend {backend!r}: its op table lacks {', '.join(missing)}")
        if indexer_inputs != "compute" and self.provider["indexer_scores"] == REFERENCE_BACKEND:
            raise TypeError(f"kernel backend {backend!r} declares indexer_inputs={indexer_inputs!r}, but its "
                            f"indexer_scores is backend {self.provider['indexer_scores']!r}'s op")
        self.__dict__.update(self._ops)   # plain attributes: protocol checks (getattr_static) see them

    def __getattr__(self, name: str) -> Callable:  # only reached for a name that is not an op
        raise AttributeError(f"kernel backend {self.__dict__.get('backend')!r} has no op {name!r}")

    def names(self) -> list[str]:
        return list(self._ops)

    def map(self, wrap: Callable[[str, Callable], Callable]) -> "OpTable":
        """A table of the same backend whose op ``name`` is ``wrap(name, op)`` (counting kept)."""
        return self._derived({name: wrap(name, fn) for name, fn in self._ops.items()})

    def without(self, names: Iterable[str]) -> "OpTable":
        """This table less the extra ops ``names`` (their callers run the torch code instead: an A/B of one
        kernel, ``bench.rollout --ablate``). A required op (:data:`OP_NAMES`) or one the table lacks is refused."""
        names = set(names)
        bad = sorted(n for n in names if n in OP_NAMES or n not in self._ops)
        if bad:
            raise ValueError(f"kernel backend {self.backend!r}: cannot leave out {', '.join(bad)} (only the extra "
                             f"ops it has: {', '.join(n for n in self._ops if n not in OP_NAMES)})")
        return self._derived({n: fn for n, fn in self._ops.items() if n not in names})

    def _derived(self, ops: Mapping[str, Callable]) -> "OpTable":
        """A table of this backend, dtypes and indexer inputs holding ``ops`` (already counted), each from the
        provider it has here."""
        out = OpTable.__new__(OpTable)
        out.backend, out.dtypes, out.indexer_inputs = self.backend, self.dtypes, self.indexer_inputs
        out.provider = {name: self.provider[name] for name in ops}
        out._ops = dict(ops)
        out.__dict__.update(out._ops)
        return out

    def __repr__(self) -> str:
        own = sorted(n for n, who in self.provider.items() if who == self.backend)
        return f"OpTable({self.backend!r}, own={own})"
