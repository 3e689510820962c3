"""On a GPU, ``dsv4 train``'s optimizer (megatron-core's distributed optimizer, train.optim.MegatronOptimizer)
runs torch's fused AdamW and the device-side gradient norm of train.fused_optim, reads the gradient norm back to
the host once per step, and takes the same step as torch's AdamW on the same model (TorchOptimizer, the CPU
target's optimizer: an independent implementation of the same update).

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
    assert optim.kernels == {"adam": "torch fused AdamW", "grad_norm": "torch._foreach_norm (on the device)"}
    ids = torch.randint(2, 250, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    gnorm, names = _step(model, optim, ids)
    assert gnorm > 0.5                                    # clipped: inside the fused kernel, no extra pass
    assert "_fused_adamw_" in names and "_foreach_norm" in names and "_foreach_mul_" not in names
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
