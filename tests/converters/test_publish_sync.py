"""publish_bucket issues no device-to-host synchronization and matches the plain path bit for bit."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from converters.publish import publish_bucket

# ops that read tensor data on the host (or have data-dependent output shapes)
SYNCING_NAMES = (
    "_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select", "equal",
    "allclose", "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave", "is_set_to",
    "tolist",
)
SYNCING = {"aten." + n for n in SYNCING_NAMES}
INDEX_OPS = {"aten.index", "aten.index_put", "aten._index_put_impl"}


class NoHostSync(TorchDispatchMode):
    """Raises on any op that needs tensor data on the host.

    Dispatched ops: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``),
    ``is_nonzero``, ``nonzero``, boolean-mask indexing, ``unique`` ... ``Tensor.tolist``
    and ``Tensor.numpy`` do not dispatch on the CPU, so they are patched while active.
    """

    def __init__(self):
        super().__init__()
        self.ops = set()
        self._saved = {}

    def __enter__(self):
        for attr in ("tolist", "numpy"):
            self._saved[attr] = getattr(torch.Tensor, attr)

            def boom(*a, _attr=attr, **k):
                raise AssertionError(f"host synchronization: Tensor.{_attr}")
            setattr(torch.Tensor, attr, boom)
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, fn in self._saved.items():
            setattr(torch.Tensor, attr, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SYNCING:
            raise AssertionError(f"host synchronization: {func}")
        if name in INDEX_OPS:
            idx = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx):
                raise AssertionError(f"host synchronization: {func} with a boolean mask")
        self.ops.add(name)
        return func(*args, **(kwargs or {}))


def test_guard_catches_syncs():
    x = torch.ones(3)
    for bad in (lambda: x.sum().item(), lambda: bool(x.sum()), lambda: x.nonzero(), lambda: x.tolist(),
                lambda: x[x > 0], lambda: int(x[0]), lambda: x.numpy(), lambda: torch.unique(x),
                lambda: torch.equal(x, x)):
        with pytest.raises(AssertionError, match="host synchronization"):
            with NoHostSync():
                bad()
    assert torch.Tensor.tolist is not None and x.tolist() == [1.0, 1.0, 1.0]   # restored


def _bucket(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * torch.exp(torch.randn(*s, generator=g))).to(torch.bfloat16)
    return [
        ("layers.3.attn.wq_a.weight", r(256, 384)),
        ("layers.3.attn.wo_a.weight", r(256, 128)),
        ("layers.3.attn.wkv.weight", r(200, 130)),                 # partial blocks
        ("layers.3.attn_norm.weight", r(384)),
        ("layers.3.ffn.gate.weight", r(8, 384)),
        ("layers.3.ffn.experts.0.w1.weight", r(128, 256)),
        ("layers.3.ffn.experts.0.w2.weight", r(256, 128)),
        ("layers.3.ffn.experts.0.w3.weight", r(128, 256)),
        ("layers.3.ffn.shared_experts.w1.weight", r(128, 256)),
        ("mtp.0.e_proj.weight", r(256, 256)),
        ("layers.3.ffn.gate.tid2eid", torch.randint(0, 8, (64, 2), generator=g)),
    ]


@pytest.mark.parametrize("scheme", ["fp8", "fp8-fp32", "nvfp4", "bf16"])
def test_publish_bucket_is_sync_free_and_identical(scheme):
    plain = publish_bucket(_bucket(), scheme)
    guard = NoHostSync()
    with guard:
        guarded = publish_bucket(_bucket(), scheme)
    assert guard.ops or scheme == "bf16"
    assert [n for n, _ in plain] == [n for n, _ in guarded]
    for (n, a), (_, b) in zip(plain, guarded):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), n
    names = [n for n, _ in plain]
    if scheme.startswith("fp8"):
        assert "layers.3.attn.wq_a.scale" in names and "layers.3.attn.wo_a.scale" not in names
        assert "layers.3.ffn.experts.0.w1.scale" in names and "mtp.0.e_proj.scale" in names
    if scheme == "nvfp4":
        assert "layers.3.ffn.experts.0.w3.weight_scale_2" in names
        assert "layers.3.ffn.shared_experts.w1.weight_scale" not in names


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4"])
def test_native_export_and_publish_is_sync_free(scheme):
    """native names -> export buckets -> quantize, all under the guard."""
    from converters.publish import publish_native_buckets
    from core import weight_contract as wc
    from core.checkpoint.tiny import iter_initial_tensors
    from core.config import preset

    config = preset("tiny")
    official = [(n, t) for n, t in iter_initial_tensors(config, "bf16", seed=0) if n.startswith("layers.1.")]
    official += [(n, t) for n, t in iter_initial_tensors(config, "bf16", seed=0) if not n.startswith(("layers.", "mtp."))]
    native = list(wc.hf_to_native(official, config))
    plain = [b for b in publish_native_buckets(native, config, scheme, max_bucket_bytes=400_000)]
    with NoHostSync():
        guarded = [b for b in publish_native_buckets(native, config, scheme, max_bucket_bytes=400_000)]
    assert len(plain) == len(guarded) > 1
    flat_p = [x for b in plain for x in b]
    flat_g = [x for b in guarded for x in b]
    assert [n for n, _ in flat_p] == [n for n, _ in flat_g]
    for (n, a), (_, b) in zip(flat_p, flat_g):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), n
    names = {n for n, _ in flat_p}
    if scheme == "fp8":
        assert "layers.1.attn.wq_a.scale" in names
    else:
        assert "layers.1.ffn.experts.0.w1.weight_scale_2" in names
