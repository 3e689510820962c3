"""engine.moe.DSv4MoE vs the reference MoE: sqrt(softplus) routing with the selection-only expert
bias, hash routing through tid2eid, the asymmetric SwiGLU clamp on routed experts and the shared
expert clamp switch (both settings)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference.moe import MoE

from ._helpers import TINY


def _pair(config, layer_id, seed=0):
    from engine.config import make_transformer_config
    from engine.moe import DSv4MoE
    g = torch.Generator().manual_seed(seed)
    ref = MoE(config, layer_id)
    with torch.no_grad():
        for n, t in list(ref.named_parameters()) + list(ref.named_buffers()):
            if n.endswith("tid2eid"):
                t.copy_(torch.randint(0, config.n_routed_experts, t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * (0.5 if n.endswith("bias") else 0.2))
    m = DSv4MoE(config, make_transformer_config(config), layer_id)
    with torch.no_grad():
        m.router.weight.copy_(ref.gate.weight)
        if ref.gate.hash:
            m.router.tid2eid.copy_(ref.gate.tid2eid)
        else:
            m.router.expert_bias.copy_(ref.gate.bias)
        for e, ex in enumerate(ref.experts):
            m.experts.linear_fc1[e].copy_(torch.cat((ex.w1.weight, ex.w3.weight)))
            m.experts.linear_fc2[e].copy_(ex.w2.weight)
        se = ref.shared_experts
        m.shared_experts.linear_fc1.weight.copy_(torch.cat((se.w1.weight, se.w3.weight)))
        m.shared_experts.linear_fc2.weight.copy_(se.w2.weight)
    return ref, m


@pytest.mark.parametrize("layer_id", [0, 2])  # 0: hash layer, 2: learned routing with expert bias
@pytest.mark.parametrize("shared_clamp", [True, False])
def test_moe_matches_reference(layer_id, shared_clamp):
    c = TINY.replace(shared_expert_clamp=shared_clamp)
    assert c.is_hash_layer(0) and not c.is_hash_layer(2)
    ref, m = _pair(c, layer_id)
    x = torch.randn(2, 9, c.dim, generator=torch.Generator().manual_seed(1)) * 8.0  # big: clamps active
    ids = torch.randint(0, c.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ym = ref(xr, ids), m(xm, ids)
    torch.testing.assert_close(ym, yr, atol=1e-5, rtol=1e-5)
    yr.square().sum().backward()
    ym.square().sum().backward()
    # fp32, different summation order (fc1 = cat(w1, w3)): error relative to the gradient's scale
    pairs = [(xm.grad, xr.grad), (m.router.weight.grad, ref.gate.weight.grad)]
    for e, ex in enumerate(ref.experts):  # every routed expert's weights, through the grouped GEMM
        if ex.w2.weight.grad is not None:
            pairs.append((m.experts.linear_fc1[e].grad, torch.cat((ex.w1.weight.grad, ex.w3.weight.grad))))
            pairs.append((m.experts.linear_fc2[e].grad, ex.w2.weight.grad))
        else:  # an expert no token chose gets a zero gradient
            assert not m.experts.linear_fc1[e].grad.any()
    assert len(pairs) > 4
    for a, b in pairs:
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    # the clamp is really exercised: the shared expert's pre-activations exceed the limit
    h = x.reshape(-1, c.dim) @ ref.shared_experts.w1.weight.T
    assert h.max() > c.swiglu_limit
    assert m.shared_experts.limit == (c.swiglu_limit if shared_clamp else 0.0)


def test_shared_clamp_switch_changes_output():
    outs = []
    for clamp in (True, False):
        c = TINY.replace(shared_expert_clamp=clamp)
        _, m = _pair(c, 2)
        x = torch.randn(1, 5, c.dim, generator=torch.Generator().manual_seed(3)) * 8.0
        with torch.no_grad():
            outs.append(m(x))
    assert (outs[0] - outs[1]).abs().max() > 1e-3


def test_expert_bias_selects_only():
    """Bias changes which experts are chosen but not the weights' source (scores without bias)."""
    c = TINY
    _, m = _pair(c, 2)
    x = torch.randn(6, c.dim, generator=torch.Generator().manual_seed(4))
    w0, i0 = m.router(x)
    with torch.no_grad():
        m.router.expert_bias.zero_()
        m.router.expert_bias[0] = 100.0  # force expert 0 into every top-k
    w1, i1 = m.router(x)
    assert (i1 == 0).any(dim=-1).all()
    torch.testing.assert_close(w1.sum(-1), torch.full((6,), c.route_scale))
    assert isinstance(m.router.tid2eid if m.router.hash else m.router.expert_bias, torch.Tensor)


@pytest.mark.parametrize("layer_id", [0, 2])
def test_row_invariant_experts(layer_id):
    """Inside ``row_invariant_experts`` a row's output does not depend on the other rows (their routing sizes
    the grouped GEMM's groups otherwise), stays the grouped path's up to rounding, and gradients still flow."""
    from kernels.reference.moe import row_invariant_experts

    _ref, m = _pair(TINY, layer_id)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 9, TINY.dim, generator=g) * 8.0
    ids = torch.randint(0, TINY.vocab_size, (3, 9), generator=g)
    other_x, other_ids = x.clone(), ids.clone()
    other_x[1:] = torch.randn(2, 9, TINY.dim, generator=g)          # rows 1, 2 changed: other routing
    other_ids[1:] = torch.randint(0, TINY.vocab_size, (2, 9), generator=g)
    with row_invariant_experts():
        xi = x.clone().requires_grad_()
        y = m(xi, ids)
        assert torch.equal(y[0], m(other_x, other_ids)[0])
        y.square().sum().backward()
    assert xi.grad is not None and m.experts.linear_fc1[0].grad is not None
    grouped = m(x, ids).detach()          # the same sums in another order: rounding at the outputs' scale
    assert (y.detach() - grouped).abs().max() <= 1e-6 * grouped.abs().max(), grouped.abs().max()


def test_dispatch_row_moves_are_gathers_both_ways():
    """engine.permute: the token rows copied to their expert slots and the expert outputs put back in (token, slot)
    order have the gradients autograd's finite differences give (fp64 gradcheck), and the routed experts'
    forward and backward run no index_add / index_copy / zero fill (the atomic-add backward the gathers replace)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.permute import expand_to_slots, inverse_permutation, permute_rows

    g = torch.Generator().manual_seed(3)
    T, k, d = 5, 3, 4
    order = torch.randperm(T * k, generator=g)
    inv = inverse_permutation(order)
    assert torch.equal(order[inv], torch.arange(T * k)) and torch.equal(inv[order], torch.arange(T * k))
    x = torch.randn(T, d, dtype=torch.float64, generator=g, requires_grad=True)
    out = torch.randn(T * k, d, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: expand_to_slots(t, order, inv, k), (x,))
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, inv, order), (out,))
    assert torch.equal(expand_to_slots(x, order, inv, k), x.index_select(0, order // k))
    assert torch.equal(permute_rows(out, inv, order), torch.zeros_like(out).index_copy(0, order, out))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    _, m = _pair(TINY, 2)
    xm = torch.randn(2, 9, TINY.dim, generator=g).bfloat16().requires_grad_()
    m = m.bfloat16()
    ids = torch.randint(0, TINY.vocab_size, (2, 9), generator=g)
    with Ops() as ops:
        m(xm, ids).float().square().sum().backward()
    assert "index_select" in ops.names and xm.grad is not None
    bad = ops.names & {"index_add", "index_add_", "index_copy", "index_copy_"}
    assert not bad, bad


def test_fused_expert_weight_gradients_land_in_the_banks_buffer():
    """``wgrad_fusion`` for the routed experts (``engine.moe._FusedWgradGroupedLinear``): the per-expert GEMMs the
    trainer uses (``kernels.wgrad.grouped_wgrad_gemms``), whose row counts travel to the host during the forward
    (on a GPU: tests/train/test_fused_optim_gpu.py). Over two micro-batches the bank's fp32 buffer (laid out in
    expert order, as megatron-core's DDP does) first loses the last step's gradient, then gets each micro-batch's;
    it equals autograd's expert gradients of the same bf16 model within their bf16 rounding, and the input
    gradient is the unfused one's."""
    from engine.config import make_transformer_config
    from engine.moe import DSv4MoE
    from kernels import wgrad

    c = TINY
    _, ref = _pair(c, 2)
    tconfig = make_transformer_config(c, params_dtype=torch.bfloat16)
    a = DSv4MoE(c, tconfig, 2, params_dtype=torch.bfloat16)
    b = DSv4MoE(c, tconfig, 2, params_dtype=torch.bfloat16)
    a.load_state_dict(ref.state_dict())
    b.load_state_dict(ref.state_dict())
    banks = (b.experts.linear_fc1, b.experts.linear_fc2)
    for bank in banks:
        buf = torch.full((bank.n, *bank[0].shape), float("nan"))  # the last step's: any read of it shows
        for i, p in enumerate(bank.experts()):
            p.main_grad = buf[i]
            wgrad.mark_last_step(p.main_grad)
        bank.wgrad_fused = True
    g = torch.Generator().manual_seed(3)
    for _ in range(2):                                            # two micro-batches of one step
        x = (torch.randn(2, 7, c.dim, generator=g) * 4).bfloat16()
        ids = torch.randint(0, c.vocab_size, (2, 7), generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a(xa, ids).float().square().sum().backward()
        b(xb, ids).float().square().sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)
    for bank_a, bank_b in ((a.experts.linear_fc1, banks[0]), (a.experts.linear_fc2, banks[1])):
        for pa, pb in zip(bank_a.experts(), bank_b.experts()):
            assert pb.grad_added_to_main_grad
            want = torch.zeros_like(pb.main_grad) if pa.grad is None else pa.grad.float()
            scale = float(want.abs().max().clamp_min(1e-6))
            assert float((pb.main_grad - want).abs().max()) <= 2e-2 * scale
