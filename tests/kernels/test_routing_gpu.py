"""The triton backend's router of the decode step (``kernels/triton/routing.py``) against the reference router
(``kernels.reference.moe.route``) it replaces in the eager step.

Oracle: the reference router on the same bf16 inputs (fp32 gate GEMM, score function, top-k of scores + bias or
the hash table's row, renormalized and scaled weights). Bound: the experts equal; the weights within 1e-5 (the
gate's dot products are exact fp32 products summed in another order). Cases: V4-Flash's router (sqrt-softplus,
top 6 of 256 experts, learned and hash), the Flash-shaped preset's 32 experts, the other score functions, odd
sizes. Refusals name the fix. With no GPU, ``TRITON_INTERPRET=1`` runs them; otherwise they skip.
"""

import types

import pytest
import torch

from ._backends import compiles_for_sm90_without_spills, triton_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("E,k,func,hashed,T", [
    pytest.param(256, 6, "sqrtsoftplus", False, 4, id="flash-learned"),
    pytest.param(256, 6, "sqrtsoftplus", True, 4, id="flash-hash"),
    pytest.param(32, 6, "sqrtsoftplus", False, 64, id="flash-shaped-64-rows"),
    pytest.param(8, 2, "sigmoid", False, 3, id="sigmoid"),
    pytest.param(16, 4, "softmax", True, 3, id="softmax-hash"),
    pytest.param(7, 3, "sqrtsoftplus", False, 1, id="odd-sizes"),
    pytest.param(384, 6, "sqrtsoftplus", False, 20, id="pro-learned-two-programs"),
])
def test_route_experts_matches_the_reference_router(E, k, func, hashed, T):
    from kernels.reference.moe import route
    from kernels.triton.routing import route_experts

    dev = triton_device()
    g = torch.Generator().manual_seed(E + k + T)
    d = 200
    x = torch.randn(T, d, generator=g).bfloat16()
    gate = types.SimpleNamespace(weight=(torch.randn(E, d, generator=g) * 0.2).bfloat16(), score_func=func, topk=k,
                                 route_scale=1.5, hash=hashed, replayable=False, layer_id=None,
                                 tid2eid=torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)]))
    ids = torch.randint(0, 50, (T,), generator=g)
    bias = None if hashed else torch.randn(E, generator=g) * 0.1
    want_w, want_idx = route(gate, x, ids, bias, replay=False)
    got_w, got_idx = route_experts(x.to(dev), gate.weight.to(dev), None if hashed else bias.to(dev),
                                   gate.tid2eid.to(dev) if hashed else None, ids.to(dev) if hashed else None, k, 1.5,
                                   func)
    assert got_w.dtype == torch.float32 and got_idx.dtype == torch.long and got_idx.shape == (T, k)
    assert torch.equal(got_idx.cpu(), want_idx)
    assert (got_w.cpu() - want_w).abs().max() <= 1e-5


@pytest.mark.parametrize("E,hashed,T", [(32, False, 64), (256, False, 1), (256, True, 20), (7, False, 3)])
def test_the_split_router_is_the_reference_router(E, hashed, T):
    """A decode step's few tokens split the gate GEMM over channel ranges (``split_of``: 4 ranges of 256 channels
    here) and a second kernel sums and picks: the reference router's experts and weights, as the one-pass kernel
    (forced with ``SPLIT=1``) gives them; and the split the launcher takes for these sizes is that one."""
    from kernels.reference.moe import route
    from kernels.triton.routing import route_experts_launch, split_of

    dev = triton_device()
    g = torch.Generator().manual_seed(E + T)
    d, k = 1024, min(6, E)
    assert split_of(T, d) == 4 and split_of(T, 200) == 1 and split_of(16 * 128, 4096) == 1
    x = torch.randn(T, d, generator=g).bfloat16()
    w = (torch.randn(E, d, generator=g) * 0.05).bfloat16()
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)])
    ids = torch.randint(0, 50, (T,), generator=g)
    bias = None if hashed else torch.randn(E, generator=g) * 0.1
    gate = types.SimpleNamespace(weight=w, score_func="sqrtsoftplus", topk=k, route_scale=1.5, hash=hashed,
                                 replayable=False, layer_id=None, tid2eid=table)
    want_w, want_idx = route(gate, x, ids, bias, replay=False)
    args = (x.to(dev), w.to(dev), None if hashed else bias.to(dev), table.to(dev) if hashed else None,
            ids.to(dev) if hashed else None, k, 1.5, "sqrtsoftplus")
    for config in (None, dict(SPLIT=1)):
        got_w, got_idx = route_experts_launch(*args, config=config)
        assert torch.equal(got_idx.cpu(), want_idx), config
        assert (got_w.cpu() - want_w).abs().max() <= 1e-5, config


def test_route_experts_refuses_what_it_cannot_serve():
    from kernels.triton.routing import MAX_EXPERTS, route_experts

    dev = triton_device()
    x = torch.randn(2, 32).bfloat16().to(dev)
    w = torch.randn(8, 32).bfloat16().to(dev)
    bias = torch.zeros(8, device=dev)
    with pytest.raises(ValueError, match="--kernel-backend none"):
        route_experts(x.float(), w, bias, None, None, 2, 1.0, "sqrtsoftplus")
    with pytest.raises(ValueError, match="needs 1 to"):
        route_experts(x, w, bias, None, None, 9, 1.0, "sqrtsoftplus")
    with pytest.raises(ValueError, match="needs 1 to"):
        route_experts(x, torch.zeros(MAX_EXPERTS + 1, 32).bfloat16().to(dev), torch.zeros(MAX_EXPERTS + 1, device=dev),
                      None, None, 2, 1.0, "sqrtsoftplus")
    with pytest.raises(ValueError, match="serves sqrtsoftplus"):
        route_experts(x, w, bias, None, None, 2, 1.0, "tanh")
    with pytest.raises(ValueError, match="hash layer's int64 table"):
        route_experts(x, w, None, None, None, 2, 1.0, "sqrtsoftplus")
    with pytest.raises(ValueError, match="needs fp32"):
        route_experts(x, w, bias.bfloat16(), None, None, 2, 1.0, "sqrtsoftplus")
    assert MAX_EXPERTS >= 384                                             # V4-Flash's and V4-Pro's routers fit


@pytest.mark.parametrize("experts,hashed", [(32, False), (256, False), (256, True), (512, False)])
def test_the_router_compiles_for_sm90(experts, hashed):
    """The kernel compiles to PTX for sm_90 (H100/H200) with triton alone, no GPU (the interpreter runs code the
    compiler rejects)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs triton, not in interpreter mode")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels.triton import routing as R

    c = R.launch_settings(experts)
    consts = dict(K=6, KP=8, BT=R.TOKENS, BE=experts, BD=c["BD"], STAGES=c["STAGES"], FUNC=0, HASH=hashed,
                  RENORM=True, F32=False)
    sig = {"X": "*bf16", "W": "*bf16", "BIAS": "*fp32", "TABLE": "*i64", "IDS": "*i64", "WEIGHTS": "*fp32",
           "IDX": "*i64", "T": "i32", "D": "i32", "E": "i32", "scale": "fp32", **{k: "constexpr" for k in consts}}
    compiled = compile(ASTSource(R._route_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=c["WARPS"], num_stages=c["STAGES"]))
    assert ".entry" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared      # an H100 / H200 SM's limit
    # the split router (a decode step's few tokens): partial logits, the block's last ticket sums and picks
    part = dict(consts, BD=R.part_channels(experts))
    kinds = {"X": "*bf16", "W": "*bf16", "PART": "*fp32", "TICKETS": "*i32", "BIAS": "*fp32", "TABLE": "*i64",
             "IDS": "*i64", "WEIGHTS": "*fp32", "IDX": "*i64", "T": "i32", "D": "i32", "E": "i32", "DPER": "i32",
             "SPLIT": "i32", "scale": "fp32"}
    compiles_for_sm90_without_spills(R._route_part_kernel, kinds, part, c["WARPS"])
