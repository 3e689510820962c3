"""On a GPU, ``dsv4 train``'s optimizer (megatron-core's distributed optimizer, train.optim.MegatronOptimizer)
runs the one-pass Triton AdamW (kernels.triton.adamw: masters, moments and the bf16 weights in one kernel, and a
flag for non-finite weights) and the device-side gradient norm of engine.fused_optim, reads the gradient norm back
to the host once per step, and takes the same step as torch's AdamW on the same model (TorchOptimizer, the CPU
target's optimizer: an independent implementation of the same update) and, in bf16, as torch's fused AdamW
followed by megatron-core's own copy of the masters into the model.

    python -m pytest -q tests/train/test_fused_optim_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from ._impl_helpers import small_config
from ._ops import RecordedOps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")



def _run_config(dtype: str):
    from core.assembly import assemble
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    rc = normalize(Choices(impl="miles", hardware="nvidia", dtype=dtype, model=small_config()),
                   make_host(third_party=False), model_name="small")
    assemble(rc).setup_process()
    return rc


def _model(rc):
    from train.model import build_train_model

    return build_train_model(small_config(), rc, seed=0, dtype=rc.torch_dtype)


def _step(model, optim, ids):
    optim.zero_grad()
    fwd = model.forward_train(ids)
    (-fwd.logprobs.float().mean()).backward()
    with RecordedOps() as ops:
        gnorm = optim.step()
    return gnorm, ops.names


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_megatron_optimizer_runs_the_fused_kernels_with_one_host_read(dtype):
    from train.optim import MegatronOptimizer
    from train.trainer import TrainConfig

    rc = _run_config(dtype)
    model = _model(rc)
    optim = MegatronOptimizer(model, TrainConfig(lr=1e-3, grad_clip=0.5), dtype=rc.torch_dtype)
    assert optim.kernels == {"adam": "Triton one-pass AdamW writing the bf16 weights (kernels.triton.adamw)",
                             "grad_norm": "torch._foreach_norm (on the device)"}
    ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    gnorm, names = _step(model, optim, ids)
    assert gnorm > 0.5                                    # clipped: inside the fused kernel, no extra pass
    assert "_fused_adamw_" not in names and "_foreach_norm" in names and "_foreach_mul_" not in names
    for n, p in optim.named.items():                      # the kernel wrote every model weight from its master
        _part, main, start, end = optim._main_map()[p]
        assert torch.equal(p.detach().reshape(-1)[start:end], main.to(p.dtype)), n
    assert optim.weights_finite() is True
    assert names.count("_local_scalar_dense") == 1, sorted(set(names))   # the norm, read once
    assert names.count("linalg_vector_norm") == 1         # one norm of the norms, not one per tensor


def test_fused_step_equals_torch_adamw_on_the_same_model():
    from train.optim import MegatronOptimizer, TorchOptimizer
    from train.trainer import TrainConfig

    rc = _run_config("fp32")
    cfg = TrainConfig(lr=1e-3, grad_clip=0.5, weight_decay=0.1)
    fused_model, plain_model = _model(rc), _model(rc)
    plain_model.load_state_dict(fused_model.state_dict())
    fused, plain = MegatronOptimizer(fused_model, cfg, dtype=torch.float32), TorchOptimizer(plain_model, cfg)
    # Gradients that are zero but for rounding noise (the first layer's hyper-connection sees n identical copies
    # of the embedding: ~1e-10, differing between the two models once their weights differ by an ulp) become
    # +-lr * g / eps updates; with eps 1e-8 that noise moved two tensors by 4% of lr (H200, 2026-12-02). A
    # larger eps, the same in both, keeps this comparison about the optimizer's math.
    for group in [g for part in fused._parts() for g in part.optimizer.param_groups] + plain.opt.param_groups:
        group["eps"] = 1e-5
    for seed in range(3):
        ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(seed)).cuda()
        g_fused, _ = _step(fused_model, fused, ids)
        g_plain, _ = _step(plain_model, plain, ids)
        assert g_fused == pytest.approx(g_plain, rel=1e-4)
    want = dict(plain.named)
    off = {name: float((p.detach() - want[name].detach()).abs().max()) for name, p in fused.named.items()}
    bad = {n: (d, tuple(fused.named[n].shape)) for n, d in off.items() if d > 1e-6 + 1e-4 * float(
        want[n].detach().abs().max())}
    assert not bad, f"{len(bad)} of {len(off)} parameters differ: {sorted(bad.items())[:12]}"


def _triton_off(monkeypatch):
    from engine import fused_optim

    monkeypatch.setattr(fused_optim, "install_triton_adam", lambda parts: False)


def test_bf16_step_equals_torch_fused_adamw_and_megatrons_copy(monkeypatch):
    """The Triton step against megatron-core's own path (torch's fused AdamW, then its master -> bf16 copy), from
    the same weights and gradients: masters to fp32 rounding, model weights to one bf16 rounding."""
    from train.optim import MegatronOptimizer
    from train.trainer import TrainConfig

    rc = _run_config("bf16")
    cfg = TrainConfig(lr=1e-3, grad_clip=0.5, weight_decay=0.1)
    a_model, b_model = _model(rc), _model(rc)
    b_model.load_state_dict(a_model.state_dict())
    a = MegatronOptimizer(a_model, cfg, dtype=torch.bfloat16)
    _triton_off(monkeypatch)
    b = MegatronOptimizer(b_model, cfg, dtype=torch.bfloat16)
    assert a.triton_adam and not b.triton_adam and b.kernels["adam"] == "torch fused AdamW"
    ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    _step(a_model, a, ids)          # one step: equal gradients (a later step's bf16 forward already differs by
    _step(b_model, b, ids)          # the last bit of some weights, which Adam's normalised update amplifies)
    for n, p in a.named.items():
        q = b.named[n]
        ma, mb = a._states(p)["param"], b._states(q)["param"]
        torch.testing.assert_close(ma, mb, rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=1e-2, atol=1e-5)


def _adamw_definition(p, grads, lr, betas, eps, wd, scale):
    """AdamW by its definition, float64."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double() / scale
        p *= 1 - lr * wd
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p -= lr / (1 - betas[0] ** t) * m / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return p


@pytest.mark.parametrize("unaligned", [False, True], ids=["own-tensors", "unaligned-views"])
def test_kernel_matches_adamw_by_definition_on_ragged_tensors(unaligned):
    """Sizes around the kernel's chunk and block edges, per-tensor weight decay, a gradient scale, bf16 outputs on
    some tensors only, and the non-finite flag; masters that are their own tensors (16-byte aligned: the
    vectorized path) or views into one buffer at odd element offsets (the kernel must not assume alignment)."""
    from kernels.triton.adamw import BLOCK, CHUNK, MultiTensorAdamW

    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, BLOCK - 1, BLOCK + 1, CHUNK, CHUNK + 3, 3 * CHUNK - 7]
    if unaligned:
        buf = torch.randn(sum(sizes) + 3 * len(sizes) + 1, device="cuda", generator=gen)
        offsets = [1 + sum(sizes[:i]) + 3 * i for i in range(len(sizes))]
        params = [buf[o:o + n] for o, n in zip(offsets, sizes)]
    else:
        params = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    start = [p.clone() for p in params]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device="cuda") for _ in params]
    outs = [torch.empty(n, dtype=torch.bfloat16, device="cuda") if i % 2 else None for i, n in enumerate(sizes)]
    wds = [0.1 if i % 3 else 0.0 for i in range(len(sizes))]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    scale = torch.tensor(2.0, device="cuda")
    kernel, grads = MultiTensorAdamW(), []
    for _ in range(3):
        g = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
        grads.append(g)
        torch._foreach_add_(steps, 1.0)
        kernel.step(params, g, ms, vs, steps, outs, wds, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                    grad_scale=scale, flag=flag)
    assert int(flag) == 0
    assert {plan.aligned for plan in kernel._plans.values()} == {not unaligned}   # (a plan per gradient list)
    for i, p in enumerate(params):
        want = _adamw_definition(start[i], [g[i] for g in grads], 1e-2, (0.9, 0.95), 1e-8, wds[i], 2.0)
        torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6)
        if outs[i] is not None:
            assert torch.equal(outs[i], p.to(torch.bfloat16))
    grads[0][2][5] = float("inf")
    torch._foreach_add_(steps, 1.0)
    kernel.step(params, grads[0], ms, vs, steps, outs, wds, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                grad_scale=None, flag=flag)
    assert int(flag) == 1


def test_a_blown_up_update_is_flagged_and_the_trainer_check_names_the_tensor():
    from train import step_guard
    from train.optim import MegatronOptimizer
    from train.trainer import TrainConfig

    rc = _run_config("bf16")
    model = _model(rc)
    cfg = TrainConfig(lr=1e-3)
    object.__setattr__(cfg, "lr", float("inf"))         # (the run's option checks refuse it before a run starts)
    optim = MegatronOptimizer(model, cfg, dtype=torch.bfloat16)
    ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    _step(model, optim, ids)
    assert optim.weights_finite() is False
    with pytest.raises(step_guard.NonFiniteError, match="weights after the optimizer step"):
        step_guard.check_parameters(model)


def test_loading_the_optimizer_state_leaves_the_loaded_model_weights():
    """A resume loads the model, then the optimizer state, whose creation is megatron-core's dummy step: with the
    Triton kernel writing the bf16 weights it must not write them there (the masters are stale until the load)."""
    from train.optim import MegatronOptimizer
    from train.trainer import TrainConfig

    rc = _run_config("bf16")
    model = _model(rc)
    optim = MegatronOptimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1), dtype=torch.bfloat16)
    assert optim.triton_adam
    ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    _step(model, optim, ids)
    saved, steps = optim.shard_state()
    saved = {k: [t.clone() for *_box, t in pieces] for k, (_shape, pieces) in saved.items()}
    weights = {n: p.detach().clone() for n, p in optim.named.items()}
    with torch.no_grad():
        for _part, main, _s, _e in optim._main_map().values():
            main.fill_(float("nan"))                   # stale masters, as before a load

    def read(wanted):
        for k, pieces in wanted.items():
            for (*_box, dst), src in zip(pieces, saved[k]):
                dst.copy_(src)

    optim.load_shard_state(read, steps)
    for n, p in optim.named.items():
        assert torch.equal(p.detach(), weights[n]), n
        _part, main, start, end = optim._main_map()[p]
        assert torch.equal(main.to(p.dtype), p.detach().reshape(-1)[start:end]), n


@pytest.mark.parametrize("kernel_backend", ["none", "triton"])
def test_copy_first_gradient_buffer_equals_megatron_cores_accumulation(kernel_backend):
    """``engine.grad_buffers.CopyFirstDDP``: no zeroing pass; a step's first gradient copied into the fp32 buffer,
    a second micro-batch's added; a parameter no backward reached this step reads zero after the settle, not last
    step's gradient. Bit for bit megatron-core's zero-then-add (0 + g is exact) on two copies of one model; in a
    triton run every copy and add is the Triton cast kernel (``kernels.triton.grad_copy``), else torch's op."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from engine.grad_buffers import CopyFirstDDP

    _run_config("bf16")                                       # process groups
    torch.manual_seed(0)

    def toy():
        layers = torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        return torch.nn.Sequential(*layers).cuda().bfloat16()

    a, b = toy(), toy()
    b.load_state_dict(a.state_dict())
    tconfig = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, bf16=True,
                                params_dtype=torch.bfloat16, calculate_per_token_loss=True)
    dcfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         use_distributed_optimizer=True, bucket_size=40_000_000)
    plain = DistributedDataParallel(tconfig, dcfg, a)
    ours = CopyFirstDDP(tconfig, dcfg, b, kernel_backend=kernel_backend)
    assert ours.copies_first
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(3):
        xs = [torch.randn(32, 64, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        frozen = step == 1                                    # the last weight gets no gradient in this step
        for ddp, m in ((plain, a), (ours, b)):
            with RecordedOps() as ops:
                ddp.zero_grad_buffer()
            assert (ddp is plain) == any(n in ("zero_", "fill_") for n in ops.names), ops.names
            m[2].weight.requires_grad_(not frozen)
            for x in xs:                                      # two micro-batches
                m(x).float().square().mean().backward()
            m[2].weight.requires_grad_(True)
        assert ours.settle_grad_buffer() == (1 if frozen else 0)
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.main_grad, q.main_grad), (step, n)
        assert bool(b[2].weight.main_grad.abs().sum() == 0) == frozen
    served = (ours.kernel_casts, ours.torch_casts)            # (by the Triton kernel, by torch's op)
    want_kernel = kernel_backend == "triton"
    assert (served[0] > 0, served[1] > 0) == (want_kernel, not want_kernel), served



class _FusionToy(torch.nn.Module):
    """One of each linear the fusion serves: megatron-core's ColumnParallelLinear, engine.layers.Linear, and the
    fp32-output linear of the head (kernels.reference.layers.linear_fp32); and a norm weight it does not."""

    def __init__(self, tconfig):
        super().__init__()
        from megatron.core import tensor_parallel

        from engine.layers import Linear

        self.col = tensor_parallel.ColumnParallelLinear(64, 128, config=tconfig, init_method=torch.nn.init.normal_,
                                                        bias=False, gather_output=False)
        self.own = Linear(128, 96, torch.bfloat16)
        self.head = Linear(96, 256, torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(96, dtype=torch.bfloat16))

    def forward(self, x):
        from kernels.reference.layers import linear_fp32

        h, _ = self.col(x)
        return linear_fp32(self.own(torch.nn.functional.gelu(h)) * self.norm, self.head.weight)


def test_fused_weight_gradients_equal_the_cast_path_without_its_rounding():
    """``wgrad_fusion`` (engine.wgrad_fusion, kernels.wgrad): megatron-core's linear (through its own
    gradient_accumulation_fusion path and the Apex API written here), the project's Linear and the fp32 head write
    their weight gradients into the fp32 buffer with one mixed-dtype GEMM each: stored at a step's first micro-batch,
    added at the second, the buffer of a weight no backward reached zeroed by the settle. Against the copy-first
    path (bf16 gradients cast in), within the bf16 rounding the fused path skips; no cast serves a fused weight."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from engine.grad_buffers import CopyFirstDDP
    from engine.wgrad_fusion import enable

    _run_config("bf16")
    torch.manual_seed(0)
    tconfig = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, bf16=True,
                                params_dtype=torch.bfloat16, calculate_per_token_loss=True)
    dcfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         use_distributed_optimizer=True, bucket_size=40_000_000)
    a = _FusionToy(tconfig).cuda()
    b = _FusionToy(tconfig).cuda()
    b.load_state_dict(a.state_dict())
    plain, fused = CopyFirstDDP(tconfig, dcfg, a), CopyFirstDDP(tconfig, dcfg, b)
    assert enable(b) == {"megatron_linears": 1, "expert_banks": 0, "parameters": 4}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(3):
        xs = [torch.randn(32, 64, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        frozen = step == 1                                     # the head gets no gradient in this step
        for ddp, m in ((plain, a), (fused, b)):
            ddp.zero_grad_buffer()
            m.head.weight.requires_grad_(not frozen)
            casts = ddp.torch_casts + ddp.kernel_casts
            for x in xs:
                m(x).square().mean().backward()
            m.head.weight.requires_grad_(True)
            n_cast = ddp.torch_casts + ddp.kernel_casts - casts
            assert n_cast == (2 if ddp is fused else 2 * (3 if frozen else 4)), (step, n_cast)   # fused: the norm
            assert ddp.settle_grad_buffer() == (1 if frozen else 0)
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            scale = p.main_grad.abs().max().clamp_min(1e-30)
            err = float((p.main_grad - q.main_grad).abs().max() / scale)
            assert err < 2e-2, (step, n, err)                  # the unfused gradient's bf16 rounding, twice
        assert bool(b.head.weight.main_grad.abs().sum() == 0) == frozen

def test_fused_expert_weight_gradients_in_megatron_cores_buffer_equal_the_cast_path():
    """The routed experts under ``wgrad_fusion``: megatron-core's DDP lays each bank's fp32 buffers out in expert
    order, so ``enable`` fuses both banks of a MoE layer, and one mixed-dtype cuBLAS GEMM per expert
    (``kernels.wgrad.grouped_wgrad_gemms``) writes them: over two steps of two micro-batches the buffers equal the
    cast path's within its bf16 rounding, and no cast serves an expert."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from core.config import preset
    from engine.config import make_transformer_config
    from engine.grad_buffers import CopyFirstDDP
    from engine.moe import DSv4MoE
    from engine.wgrad_fusion import enable

    _run_config("bf16")
    c = preset("tiny")
    torch.manual_seed(0)
    tc = make_transformer_config(c, params_dtype=torch.bfloat16)
    a, b = (DSv4MoE(c, tc, 2, params_dtype=torch.bfloat16).cuda() for _ in range(2))
    b.load_state_dict(a.state_dict())
    tconfig = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, bf16=True,
                                params_dtype=torch.bfloat16, calculate_per_token_loss=True)
    dcfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         use_distributed_optimizer=True, bucket_size=40_000_000)
    plain, fused = CopyFirstDDP(tconfig, dcfg, a), CopyFirstDDP(tconfig, dcfg, b)
    assert enable(b)["expert_banks"] == 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(2):
        batches = [(torch.randn(2, 33, c.dim, device="cuda", generator=gen).bfloat16(),
                    torch.randint(0, c.vocab_size, (2, 33), device="cuda", generator=gen)) for _ in range(2)]
        for ddp, m in ((plain, a), (fused, b)):
            ddp.zero_grad_buffer()
            for x, ids in batches:
                m(x, ids).float().square().mean().backward()
            ddp.settle_grad_buffer()
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            if "experts.linear_fc" in n:
                assert q.grad_added_to_main_grad, n
            scale = float(p.main_grad.abs().max().clamp_min(1e-30))
            assert float((p.main_grad - q.main_grad).abs().max()) <= 1e-2 * scale, (step, n)

def _adamw_step_with_bf16_moments(p, m, v, g, t, lr, betas, eps, wd):
    """One AdamW step by its definition in float64 from the stored state, both moments rounded to bf16 after the
    update (what the kernel stores); returns (p, m, v)."""
    p, m, v, g = p.double(), m.double(), v.double(), g.double()
    p = p * (1 - lr * wd)
    m = betas[0] * m + (1 - betas[0]) * g
    v = betas[1] * v + (1 - betas[1]) * g * g
    p = p - lr / (1 - betas[0] ** t) * m / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return p, m.to(torch.bfloat16).double(), v.to(torch.bfloat16).double()


def test_kernel_with_bf16_moments_matches_the_definition():
    """``adam_moments_dtype=bf16``: the kernel reads bf16 moments into fp32 and writes them back rounded. Each step
    is AdamW's definition applied to the stored state, over sizes around the chunk and block edges: moments within
    one bf16 rounding (checked step by step, since one flipped rounding carries into the next steps and grows where
    a moment drops a binade; H200, 2026-12-03: 2 ulps after three steps), masters within fp32 arithmetic of the
    update from the unrounded moments (2e-6; an update from the rounded ones is off by up to about 5e-5). Where ``0.9 m + 0.1 g`` nearly cancels, the kernel's fp32 arithmetic carries an absolute error
    of fp32's epsilon times the terms (about 1e-4 here), hence the first moment's ``atol`` of 1e-10."""
    from kernels.triton.adamw import BLOCK, CHUNK, MultiTensorAdamW

    gen = torch.Generator(device="cuda").manual_seed(1)
    sizes = [1, BLOCK + 1, CHUNK + 3, 2 * CHUNK - 5]
    params = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    ms = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    vs = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    steps = [torch.zeros((), device="cuda") for _ in params]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    kernel = MultiTensorAdamW()
    for t in range(1, 4):
        g = [torch.randn(n, device="cuda", generator=gen) * 1e-3 for n in sizes]
        before = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(params, ms, vs)]
        torch._foreach_add_(steps, 1.0)
        kernel.step(params, g, ms, vs, steps, [None] * len(sizes), [0.1] * len(sizes), lr=1e-2, beta1=0.9,
                    beta2=0.95, eps=1e-8, grad_scale=None, flag=flag)
        for i, p in enumerate(params):
            want_p, want_m, want_v = _adamw_step_with_bf16_moments(*before[i], g[i], t, 1e-2, (0.9, 0.95), 1e-8, 0.1)
            torch.testing.assert_close(ms[i].double(), want_m, rtol=2 ** -7, atol=1e-10)
            torch.testing.assert_close(vs[i].double(), want_v, rtol=2 ** -7, atol=1e-15)
            torch.testing.assert_close(p.double(), want_p, rtol=0, atol=2e-6)
    assert int(flag) == 0 and all(m.dtype == torch.bfloat16 for m in ms + vs)
    with pytest.raises(ValueError, match="all fp32 or all bf16"):
        kernel.step(params, g, ms[:1] + [torch.zeros_like(p) for p in params[1:]], vs, steps,
                    [None] * len(sizes), [0.1] * len(sizes), lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                    grad_scale=None, flag=flag)


def test_bf16_moments_train_like_fp32_moments_and_round_trip_a_checkpoint():
    """``adam_moments_dtype=bf16`` through the trainer's optimizer: both moments are bf16 (half the state), two
    steps land where the fp32-moment steps land, and the state saved and loaded back is the same bf16 tensors. Two
    steps, because the first step's update does not see the rounding (both start from zero moments), so the second
    step's forward is the same in both runs and its update differs only by the moments' rounding: at most about
    0.3% of lr an element (half a bf16 ulp of m and of v). A third step's forward already differs where a master a
    rounding away flips its bf16 parameter (H200, 2026-12-03: 40 of 262,144 elements up to 1.2 lr apart)."""
    from train.optim import MegatronOptimizer
    from train.trainer import TrainConfig

    rc, lr = _run_config("bf16"), 1e-3
    a_model, b_model = _model(rc), _model(rc)
    b_model.load_state_dict(a_model.state_dict())
    a = MegatronOptimizer(a_model, TrainConfig(lr=lr, adam_moments_dtype="bf16"), dtype=torch.bfloat16)
    b = MegatronOptimizer(b_model, TrainConfig(lr=lr), dtype=torch.bfloat16)
    for seed in range(2):
        ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(seed)).cuda()
        _step(a_model, a, ids)
        _step(b_model, b, ids)
        if seed == 0:       # the premise: the first update does not see the rounding
            for n, p in a.named.items():
                assert torch.equal(a._states(p)["param"], b._states(b.named[n])["param"]), n
    for n, p in a.named.items():
        st, ref = a._states(p), b._states(b.named[n])
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16, n
        assert ref["exp_avg"].dtype == torch.float32, n
        torch.testing.assert_close(st["param"], ref["param"], rtol=0, atol=lr * 2 ** -6, msg=n)
    saved, steps = a.shard_state()
    saved = {k: [t.clone() for *_box, t in pieces] for k, (_shape, pieces) in saved.items()}
    assert any(t.dtype == torch.bfloat16 for pieces in saved.values() for t in pieces)

    def read(wanted):
        for k, pieces in wanted.items():
            for (*_box, dst), src in zip(pieces, saved[k]):
                assert dst.dtype == src.dtype, k
                dst.copy_(src)

    c = MegatronOptimizer(_model(rc), TrainConfig(lr=1e-3, adam_moments_dtype="bf16"), dtype=torch.bfloat16)
    c.load_shard_state(read, steps)
    for n, p in c.named.items():
        got, want = c._states(p), a._states(a.named[n])
        assert torch.equal(got["exp_avg"], want["exp_avg"]) and torch.equal(got["exp_avg_sq"], want["exp_avg_sq"]), n
