"""megatron-core's optimizer fallbacks replaced by torch's fused kernels (engine.fused_optim): the same math as an
independent float64 reference, and the fused kernels are the ones that run."""

import math

import pytest
import torch

from ._ops import RecordedOps


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in ((3, 5), (7,), (0,), (2, 2, 2))]


def test_foreach_l2_norm_is_the_norm_of_all_elements():
    from engine.fused_optim import foreach_l2_norm

    ts = _tensors()
    norm, per = foreach_l2_norm(2048, None, [ts], False)
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts))
    assert per is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert float(norm) == pytest.approx(want, rel=1e-6)
    empty, _ = foreach_l2_norm(2048, None, [[]], False)
    assert float(empty) == 0.0
    with pytest.raises(ValueError, match="per-tensor"):
        foreach_l2_norm(2048, None, [ts], True)


def test_foreach_scale_scales_in_place_and_copies_with_a_cast():
    from engine.fused_optim import foreach_scale

    ts = _tensors()
    before = [t.clone() for t in ts]
    foreach_scale(2048, None, [ts, ts], 0.5)
    for t, b in zip(ts, before):
        torch.testing.assert_close(t, b * 0.5)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
    foreach_scale(2048, None, [ts, dst], 1.0)
    for t, d in zip(ts, dst):
        torch.testing.assert_close(d, t.to(torch.bfloat16))


def _adamw_reference(p, grads, lr, betas, eps, wd):
    """AdamW by its definition (Loshchilov & Hutter), float64, one tensor."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p *= 1 - lr * wd
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        mhat, vhat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p -= lr * mhat / (vhat.sqrt() + eps)
    return p


def test_fused_adamw_runs_the_fused_kernel_and_matches_adamw_by_definition():
    from engine.fused_optim import use_fused_adam

    params = [torch.nn.Parameter(t.clone()) for t in _tensors(1) if t.numel()]
    start = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert use_fused_adam(opt)
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * k + i)) for i, p in
              enumerate(params)] for k in range(3)]
    with RecordedOps() as ops:
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
    assert "_fused_adamw_" in ops.names
    for i, p in enumerate(params):
        want = _adamw_reference(start[i], [g[i] for g in grads], 1e-2, (0.9, 0.95), 1e-8, 0.1)
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_default_adamw_does_not_run_the_fused_kernel_and_a_stepped_optimizer_is_refused():
    from engine.fused_optim import use_fused_adam

    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.ones(4)
    with RecordedOps() as ops:
        opt.step()
    assert "_fused_adamw_" not in ops.names      # what the test above would see without use_fused_adam
    with pytest.raises(RuntimeError, match="already stepped"):
        use_fused_adam(opt)
    assert not use_fused_adam(torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1))


def test_install_replaces_megatron_cores_fallbacks_only():
    from backends.cpu.target import CpuTarget

    CpuTarget().setup()                          # the cpu target's megatron-core shims
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer as mcore_optimizer

    from engine import fused_optim

    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mcore_optimizer.multi_tensor_scale_impl)
    try:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=1e-3)
        clip_grads.l2_norm_impl = mcore_utils.local_multi_tensor_l2_norm
        got = fused_optim.install([opt])
        assert clip_grads.l2_norm_impl is fused_optim.foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is fused_optim.foreach_scale
        assert mcore_optimizer.multi_tensor_scale_impl is fused_optim.foreach_scale
        assert got == {"grad_norm": "torch._foreach_norm (on the device)", "adam": "torch fused AdamW"}
        assert opt.param_groups[0]["fused"] is True
        sentinel = object()                      # a fused kernel from Apex / TE stays
        clip_grads.l2_norm_impl = sentinel
        fused_optim.install([torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=1e-3)])
        assert clip_grads.l2_norm_impl is sentinel
    finally:
        clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mcore_optimizer.multi_tensor_scale_impl = saved


def test_clipping_inside_the_fused_kernel_equals_scaled_gradients():
    from engine.fused_optim import clipped, use_fused_adam

    def run(fused: bool, coef: float):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 12))
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
        if fused:
            assert use_fused_adam(opt)
        for k in range(3):
            p.grad = torch.sin(torch.arange(12.0) + k) * 1e-7     # small next to eps: the scale shows
            with RecordedOps() as ops, clipped([opt], coef):
                opt.step()
        assert not hasattr(opt, "grad_scale")              # the scale applies to that one step only
        return p.detach(), ops.names

    fused, names = run(True, 0.25)
    assert "_foreach_mul_" not in names and "_fused_adamw_" in names   # no separate pass over the gradients
    plain, names = run(False, 0.25)
    assert "_foreach_mul_" in names
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)
    unclipped, _ = run(True, 1.0)
    assert (unclipped - fused).abs().max() > 1e-4           # the clip changed the update


def test_the_cpu_optimizer_follows_megatron_cores_update_rules():
    """TorchOptimizer (the CPU target) takes megatron-core's step: no weight decay on one-dimensional parameters
    and biases, and a parameter without a gradient is stepped with a zero one (decayed, its moments kept).
    Measured on an H200 (2026-12-02) before this rule: the two optimizers differed exactly there."""
    from train.optim import TorchOptimizer
    from train.trainer import TrainConfig

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.used = torch.nn.Linear(3, 2)                  # weight: decayed; bias: not
    model.norm = torch.nn.Parameter(torch.ones(2))      # one-dimensional: not decayed
    model.unused = torch.nn.Linear(3, 2, bias=False)    # no gradient: decayed by (1 - lr * wd) exactly
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr, wd = 1e-2, 0.5
    opt = TorchOptimizer(model, TrainConfig(lr=lr, weight_decay=wd, grad_clip=1e9))
    x = torch.randn(4, 3)
    ((model.used(x) * model.norm).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    after = {n: p.detach() for n, p in model.named_parameters()}

    def adam_first_step(p, g, decay):      # m = (1-b1) g, v = (1-b2) g^2, bias-corrected: g / (|g| + eps)
        return p * (1 - lr * decay) - lr * g / (g.abs() + 1e-8)

    torch.testing.assert_close(after["used.weight"], adam_first_step(start["used.weight"], grads["used.weight"], wd))
    torch.testing.assert_close(after["used.bias"], adam_first_step(start["used.bias"], grads["used.bias"], 0.0))
    torch.testing.assert_close(after["norm"], adam_first_step(start["norm"], grads["norm"], 0.0))
    torch.testing.assert_close(after["unused.weight"], start["unused.weight"] * (1 - lr * wd))


def test_megatron_groups_take_their_multipliers_as_the_cpu_optimizer_decays(tmp_path):
    """megatron-core's parameter groups mark norms and biases with ``wd_mult`` 0 and leave the multiplying to its
    lr scheduler, which the trainer does not run: ``train.optim.scheduled_groups`` applies it, so the GPU
    optimizer decays exactly the parameters the CPU optimizer (``weight_decay_groups``) decays."""
    from backends.cpu.target import CpuTarget

    CpuTarget().setup()                          # the cpu target's megatron-core shims
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides

    from train.optim import scheduled_groups, weight_decay_groups
    from train.trainer import TrainConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1)
    oconfig = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay)
    import torch.distributed as dist

    own_group = not dist.is_initialized()            # megatron-core logs through torch.distributed's rank
    if own_group:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        groups = _get_param_groups([model], oconfig, get_standard_config_overrides(oconfig))
    finally:
        if own_group:
            dist.destroy_process_group()
    assert all("weight_decay" not in g for g in groups)     # megatron-core leaves it to its scheduler
    scheduled_groups(groups, cfg)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert all(g["weight_decay"] in (0.0, 0.1) and g["lr"] == 1e-3 for g in groups)
    want = weight_decay_groups(dict(model.named_parameters()), cfg.weight_decay)
    assert decayed == {id(p) for g in want if g["weight_decay"] > 0 for p in g["params"]}
    assert len(decayed) == 2                                  # the two weight matrices only


@pytest.mark.parametrize("accumulate", [False, True], ids=["copy", "add"])
def test_copy_first_ddp_casts_with_torch_where_the_kernel_does_not_serve(accumulate):
    """``engine.grad_buffers.CopyFirstDDP._into_main_grad``: the Triton cast kernel only in a triton/cuda run and
    for tensors it takes; otherwise torch's ``copy_`` / ``add_``, counted as such (``torch_casts``), never the
    kernel's import (a CPU run has no Triton: megatron-core's shims stand in for it). The GPU side
    (``test_fused_optim_gpu.py``) checks the kernel's casts bit for bit against megatron-core's."""
    from backends.cpu.target import CpuTarget

    CpuTarget().setup()                          # the cpu target's megatron-core shims
    from engine.grad_buffers import TRITON_BACKENDS, CopyFirstDDP

    assert CopyFirstDDP.__init__.__kwdefaults__["kernel_backend"] == "none" and "triton" in TRITON_BACKENDS
    ddp = CopyFirstDDP.__new__(CopyFirstDDP)    # the cast alone (no process groups, no buffers)
    ddp.cast_kernel, ddp.kernel_casts, ddp.torch_casts = False, 0, 0
    g = torch.Generator().manual_seed(0)
    main, grad = torch.randn(37, generator=g), torch.randn(37, generator=g).bfloat16()
    want = main + grad.float() if accumulate else grad.float()
    ddp._into_main_grad(main, grad, accumulate)
    assert torch.equal(main, want) and (ddp.kernel_casts, ddp.torch_casts) == (0, 1)
