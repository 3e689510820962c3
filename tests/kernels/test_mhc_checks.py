"""What the Triton mHC kernels refuse, checked without a GPU and without triton (``kernels/triton/mhc_checks.py``
imports torch only): every input they do not take raises one ValueError that names the input and, where the
run can change it, the fix; inputs they take pass. The kernels themselves: ``test_mhc_gpu.py`` (GPU, or
Triton's CPU interpreter)."""

import re

import pytest
import torch

from kernels.triton import mhc_checks as C

ITERS = 20


def _inputs(n=4, d=64, lead=(1, 4)):
    x = torch.zeros(*lead, n, d, dtype=torch.bfloat16)
    rows = (2 + n) * n
    return x, torch.zeros(rows, n * d), torch.ones(3), torch.zeros(rows)


@pytest.fixture
def interpret(monkeypatch):
    """Triton's CPU interpreter: CPU tensors pass the device check, so the other checks are reached."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_cpu_tensors_are_refused_naming_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, fn, scale, base = _inputs()
    with pytest.raises(ValueError, match=re.escape("the triton mHC kernels need CUDA tensors, got ['cpu', 'cpu', "
                                                   "'cpu', 'cpu']. Fix: run with --dtype bf16 on a GPU target, or "
                                                   "choose --kernel-backend none")):
        C.check_hc_pre(x, fn, scale, base, ITERS)


def test_inputs_the_kernels_take_pass(interpret):
    x, fn, scale, base = _inputs(n=3, d=80)
    assert C.check_hc_pre(x, fn, scale, base, ITERS) is None
    assert C.check_hc_head(x, torch.zeros(3, 240), torch.ones(1), torch.zeros(3)) is None
    assert C.check_hc_post(torch.zeros(1, 4, 80), x, torch.zeros(1, 4, 3), torch.zeros(1, 4, 3, 3)) is None
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert C.check_sinkhorn(torch.zeros(5, 4, 4, dtype=dtype), ITERS) is None


def test_hc_pre_refusals(interpret):
    x, fn, scale, base = _inputs()
    with pytest.raises(ValueError, match=r"hc_pre kernel takes bf16/fp16 streams; got torch.float32\. Fix: .*"
                                         r"--kernel-backend none"):
        C.check_hc_pre(x.float(), fn, scale, base, ITERS)
    with pytest.raises(ValueError, match=r"hc_pre kernel takes fp32 fn .*; got torch.bfloat16"):
        C.check_hc_pre(x, fn.bfloat16(), scale, base, ITERS)
    with pytest.raises(ValueError, match=re.escape("takes fn [24, 256], scale [3], base [24] for streams [..., 4, 64]; "
                                                   "got (24, 128), (3,), (24,)")):
        C.check_hc_pre(x, fn[:, :128], scale, base, ITERS)
    with pytest.raises(ValueError, match=r"hc_pre needs sinkhorn_iters >= 1; got 0"):
        C.check_hc_pre(x, fn, scale, base, 0)
    with pytest.raises(ValueError, match=re.escape("takes streams [..., n, d]; got shape (4, 64)")):
        C.check_hc_pre(x[0, 0], fn, scale, base, ITERS)


def test_hc_mult_beyond_the_register_tile_is_refused(interpret):
    x = torch.zeros(1, 2, 9, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"hc_head kernel keeps a token's 9x9 mixing matrix in registers and takes "
                                         r"hc_mult 1\.\.8; got 9\. Fix: choose --kernel-backend none"):
        C.check_hc_head(x, torch.zeros(9, 72), torch.ones(1), torch.zeros(9))
    assert [C.padded(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]


def test_hc_post_refusals(interpret):
    x = torch.zeros(1, 4, 4, 64, dtype=torch.bfloat16)
    f, post, comb = torch.zeros(1, 4, 64), torch.zeros(1, 4, 4), torch.zeros(1, 4, 4, 4)
    with pytest.raises(ValueError, match=re.escape("with one leading shape; got (1, 4, 64), (1, 4, 4, 64), (1, 3, 4)")):
        C.check_hc_post(f, x, post[:, :3], comb)
    with pytest.raises(ValueError, match=r"bf16/fp16/fp32 sublayer output f; got torch.int32\. Fix: "):
        C.check_hc_post(f.int(), x, post, comb)
    with pytest.raises(ValueError, match=r"hc_post kernel takes fp32 post .*; got torch.bfloat16"):
        C.check_hc_post(f, x, post.bfloat16(), comb)


def test_sinkhorn_refusals(interpret):
    with pytest.raises(ValueError, match=r"bf16/fp16/fp32 logits \(fp32 math\); got torch.float64\. "
                                         r"Fix: choose --kernel-backend none for fp64"):
        C.check_sinkhorn(torch.zeros(3, 4, 4, dtype=torch.float64), ITERS)
    with pytest.raises(ValueError, match=re.escape("takes [..., n, n] logits; got shape (3, 4, 5)")):
        C.check_sinkhorn(torch.zeros(3, 4, 5), ITERS)
    with pytest.raises(ValueError, match=r"sinkhorn needs iters >= 1; got 0"):
        C.check_sinkhorn(torch.zeros(3, 4, 4), 0)
