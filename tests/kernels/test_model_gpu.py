"""The full tiny-model check on a GPU: the miles model with GPU kernel backends vs ``--kernel-backend none``.

One process, the nvidia hardware target's setup (TF32 off) and an NCCL process group of world size 1, tp 1.
The model is built by ``backends.miles.impl.build_model`` from the normalized run configuration of
``--impl miles --kernel-backend B --hardware nvidia`` and loaded from a tiny official-format checkpoint
(``core.checkpoint.prepare_checkpoint``), then moved to CUDA. Token ids: batch 2 x 140 tokens (past the
128-token window: window, CSA (indexer top-k) and HCA layers all contribute).

bf16 (the kernels run; ``none`` runs the reference ops on the same bf16 weights, with fp32 math inside
attention). Tolerances, kernel backend vs ``none``:

* per-token log-probabilities: mean |diff| <= 1e-2 nats and max |diff| <= 0.15 nats (bf16 rounding of
  P before the PV product and of every activation; a near-tie MoE routing decision may flip on a token);
* one training step (trunk NLL + 0.3 x MTP NLL, backward, Adam lr 1e-3): loss |diff| <= 1e-2, global
  grad norm relative diff <= 5e-2, loss after the step |diff| <= 2e-2.

fp32: refused. The table refuses ``--dtype fp32`` with a GPU backend, and its kernels refuse fp32 inputs
instead of handing them to the reference op.

``dsv4 logprobs`` itself (the CLI, in-process) with ``--hardware nvidia`` (bf16 by default) runs the
backend's kernels for both implementations: asserted through ``core.kernel_ops.kernels_ran`` and compared
with the fp32 reference model (mean |diff| <= 2e-2, max <= 0.3 nats).

For context the test also prints the error of bf16 ``none`` against fp32 ``none``.
"""

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ, BATCH = 140, 2
BF16_MEAN, BF16_MAX = 1e-2, 0.15
BF16_LOSS, BF16_GNORM_RTOL, BF16_AFTER = 1e-2, 5e-2, 2e-2


def _gpu_backends():
    out = []
    for name in ("triton", "tilelang"):
        have = importlib.util.find_spec(name) is not None
        out.append(pytest.param(name, marks=pytest.mark.skipif(not have, reason=f"{name} is not installed")))
    return out


@pytest.fixture(scope="module")
def tiny():
    from core.config import preset

    return preset("tiny")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny):
    from backends.nvidia.target import NvidiaTarget
    from core.checkpoint import prepare_checkpoint

    NvidiaTarget().init_process_group(0, 1, tp=1)
    return prepare_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny, dtype="bf16", seed=0)


def _model(ckpt, tiny, backend, dtype):
    from core.assembly import assemble
    from core.run_config import Choices, normalize
    from engine.loading import load_hf_checkpoint
    from launchers.builtin_plugins import make_host

    rc = normalize(Choices(impl="miles", kernel_backend=backend, hardware="nvidia", model=tiny),
                   make_host(third_party=False), model_name="tiny")
    torch.manual_seed(0)
    m = assemble(rc).build_model(tiny)
    load_hf_checkpoint(m, ckpt)
    return m.to(device="cuda", dtype=dtype)


def _ids(tiny, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.vocab_size, (BATCH, SEQ), generator=g).cuda()


def _loss(model, ids, mtp_weight=0.3):
    logits, streams = model(ids, return_hidden_streams=True)
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -lp.mean()
    ml = model.mtp_logits(ids, streams)[0]
    mlp = torch.log_softmax(ml[:, :-1].float(), -1).gather(-1, ids[:, 2:, None]).squeeze(-1)
    return loss - mtp_weight * mlp.mean()


def _step(model, ids):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3)
    opt.zero_grad()
    loss = _loss(model, ids)
    loss.backward()
    gnorm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)))
    assert all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    opt.step()
    with torch.no_grad():
        after = _loss(model, ids)
    return loss.item(), gnorm, after.item()


@pytest.fixture(scope="module")
def baseline(ckpt, tiny):
    """``none`` in fp32 and bf16: log-probabilities and one training step."""
    ids = _ids(tiny)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = _model(ckpt, tiny, "none", dtype)
        with torch.no_grad():
            lp = m.logprobs(ids).float()
        out[dtype] = dict(lp=lp, step=_step(m, ids))
        del m
    err = (out[torch.bfloat16]["lp"] - out[torch.float32]["lp"]).abs()
    print(f"\nnone bf16 vs none fp32: logprob mean|d| {err.mean().item():.3e} max|d| {err.max().item():.3e}; "
          f"step fp32 {out[torch.float32]['step']}, bf16 {out[torch.bfloat16]['step']}")
    return ids, out


@pytest.mark.parametrize("backend", _gpu_backends())
def test_bf16_logprobs_and_step_match_none(ckpt, tiny, baseline, backend):
    ids, base = baseline
    want = base[torch.bfloat16]
    m = _model(ckpt, tiny, backend, torch.bfloat16)
    assert m.ops.sparse_attention_with_sink.__module__ == f"kernels.{backend}.attention"
    with torch.no_grad():
        lp = m.logprobs(ids).float()
    assert lp.shape == (BATCH, SEQ - 1) and torch.isfinite(lp).all()
    d = (lp - want["lp"]).abs()
    d32 = (lp - base[torch.float32]["lp"]).abs()
    loss, gnorm, after = _step(m, ids)
    l0, g0, a0 = want["step"]
    print(f"\n{backend} bf16 vs none bf16: logprob mean|d| {d.mean().item():.3e} max|d| {d.max().item():.3e} "
          f"(vs none fp32: mean {d32.mean().item():.3e} max {d32.max().item():.3e}); loss {loss:.6f} vs {l0:.6f}, "
          f"grad norm {gnorm:.6f} vs {g0:.6f}, loss after {after:.6f} vs {a0:.6f}")
    assert d.mean().item() <= BF16_MEAN
    assert d.max().item() <= BF16_MAX
    assert abs(loss - l0) <= BF16_LOSS
    assert abs(gnorm - g0) <= BF16_GNORM_RTOL * g0
    assert after < loss  # the step helps
    assert abs(after - a0) <= BF16_AFTER


@pytest.mark.parametrize("backend", _gpu_backends())
def test_fp32_is_refused_at_parse_time_and_at_the_kernel(ckpt, tiny, baseline, backend):
    """A GPU backend does not compute in fp32: the table refuses the run, and its kernels refuse fp32 inputs
    (no silent hand-off to the reference ops)."""
    from core.combinations import InvalidCombination
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    with pytest.raises(InvalidCombination, match="computes in bf16 only"):
        normalize(Choices(impl="miles", kernel_backend=backend, hardware="nvidia", dtype="fp32", model=tiny),
                  make_host(third_party=False))
    ids, _ = baseline
    m = _model(ckpt, tiny, backend, torch.float32)
    with pytest.raises(ValueError, match="--kernel-backend none"), torch.no_grad():
        m.logprobs(ids)


@pytest.mark.parametrize("impl", ["miles", "megatron"])
@pytest.mark.parametrize("backend", _gpu_backends())
def test_dsv4_logprobs_runs_the_backend_kernels(ckpt, tiny, tmp_path, impl, backend):
    """`dsv4 logprobs --impl IMPL --kernel-backend BACKEND --hardware nvidia` (bf16 by default) runs the
    backend's sparse-attention and indexer kernels, and agrees with the fp32 reference model."""
    import json

    from click.testing import CliRunner

    from core.checkpoint import load_into, open_checkpoint
    from core.kernel_ops import kernels_ran
    from kernels.reference.model import DeepseekV4Model
    from launchers.cli import main

    if impl == "megatron" and backend == "tilelang":
        pytest.skip("tilelang does not serve megatron (the table refuses it)")
    seqs = [[int(t) for t in _ids(tiny, seed=5)[0].tolist()], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(seqs))
    out = CliRunner().invoke(main, ["logprobs", "--impl", impl, "--kernel-backend", backend, "--hardware", "nvidia",
                                    "--checkpoint", str(ckpt), "--tokens", str(tokens)])
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ran = kernels_ran()
    print(f"\n{impl} {backend}: kernels ran {ran}")
    assert ran.get(f"{backend}.sparse_attention_with_sink", 0) > 0, ran
    assert ran.get(f"{backend}.indexer_scores", 0) > 0, ran
    assert not ran.get("none.sparse_attention_with_sink") and not ran.get("none.indexer_scores"), ran
    if backend != "tilelang":    # triton's RoPE, norm and SwiGLU kernels (cuda names them); tilelang has none
        for op in ("apply_rope", "rms_normalize", "rms_norm", "weighted_swiglu"):
            assert ran.get(f"triton.{op}", 0) > 0 and not ran.get(f"none.{op}"), (op, ran)
    ref = DeepseekV4Model(tiny)
    load_into(ref, open_checkpoint(ckpt))
    with torch.no_grad():
        for seq, lp in zip(seqs, got):
            ids = torch.tensor([seq])
            want = torch.log_softmax(ref(ids)[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            d = (torch.tensor(lp) - want).abs()
            assert d.mean().item() <= 2 * BF16_MEAN and d.max().item() <= BF16_MAX * 2, (impl, backend, d.max())


@pytest.mark.parametrize("impl", ["miles", "megatron"])
@pytest.mark.parametrize("backend", _gpu_backends())
def test_the_indexer_kernel_scores_bf16_queries_and_keys(ckpt, tiny, impl, backend):
    """In a bf16 run the backend's indexer kernel gets bf16 q and k and fp32 w (the table declares
    ``indexer_inputs="activation"``; ``kernels.reference.indexer.indexer_input_dtype``), in both
    implementations' forwards and in the rollout engine's decode step (no refusal, no reference op), and the
    log-probs agree with the fp32 reference model as in ``test_dsv4_logprobs_runs_the_backend_kernels``."""
    from core.assembly import assemble
    from core.checkpoint import load_into, open_checkpoint
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from core.run_config import Choices, normalize
    from engine.loading import load_hf_checkpoint
    from kernels.reference.model import DeepseekV4Model
    from launchers.builtin_plugins import make_host
    from rollout.reference_engine import ReferenceEngine

    if impl == "megatron" and backend == "tilelang":
        pytest.skip("tilelang does not serve megatron (the table refuses it)")
    rc = normalize(Choices(impl=impl, kernel_backend=backend, hardware="nvidia", model=tiny),
                   make_host(third_party=False), model_name="tiny")
    seen = []

    def recording(name, fn):
        if name != "indexer_scores":
            return fn

        def indexer_scores(q, k, w):
            seen.append((q.dtype, k.dtype, w.dtype))
            return fn(q, k, w)
        return indexer_scores

    asm = assemble(rc)
    ops = asm.ops.map(recording)
    assert ops.indexer_inputs == "activation" and ops.provider["indexer_scores"] == backend
    torch.manual_seed(0)
    m = rc.selection.impl.load()(tiny, rc, ops=ops, params_dtype=torch.bfloat16)
    load_hf_checkpoint(m, ckpt)
    m = m.to(device="cuda", dtype=torch.bfloat16)
    ids = _ids(tiny, seed=5)[:1]
    reset_kernels_ran()
    with torch.no_grad():
        lp = (m.logprobs(ids)[0] if impl == "miles" else m.logprobs(ids[0])[:-1]).float().cpu()
    assert seen and all(s == (torch.bfloat16, torch.bfloat16, torch.float32) for s in seen), seen
    assert kernels_ran().get(f"{backend}.indexer_scores", 0) == len(seen) and not kernels_ran().get("none.indexer_scores")
    ref = DeepseekV4Model(tiny)
    load_into(ref, open_checkpoint(ckpt))
    with torch.no_grad():
        want = torch.log_softmax(ref(ids.cpu())[0, :-1].float(), -1).gather(-1, ids.cpu()[0, 1:, None]).squeeze(-1)
    d = (lp - want).abs()
    print(f"\n{impl} {backend} bf16 vs reference fp32: mean|d| {d.mean().item():.3e} max|d| {d.max().item():.3e}")
    assert d.mean().item() <= 2 * BF16_MEAN and d.max().item() <= 2 * BF16_MAX
    engine = ReferenceEngine(tiny, dtype=torch.bfloat16, device="cuda", ops=asm.ops)
    assert "indexer_scores" not in engine.decode_refusals and engine.decode_ops["indexer_scores"] == backend


class _HostCopies(TorchDispatchMode):
    """Records the element count of every copy from a CUDA tensor to the host."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and isinstance(out, torch.Tensor) \
                and out.device.type == "cpu" and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize("impl", ["miles", "megatron", "reference"])
def test_the_train_forward_brings_log_probs_not_logits_to_the_host(ckpt, tiny, impl):
    """dsv4 train's batches are host tensors and the model is on the GPU: only the ``[B, S-1]`` log-probs and
    scalar losses come back, never a ``[B, S, vocab]`` tensor (the trunk's or the MTP block's logits). That
    copy was 2 GB per Flash-shaped sequence and 1.8 s of a 3.2 s ``dsv4 train`` step on an H200."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from train.losses import mtp_loss, sft_loss_sum
    from train.model import build_train_model

    rc = normalize(Choices(impl="megatron" if impl == "megatron" else "miles", hardware="nvidia", model=tiny,
                           qkv_format="thd" if impl == "megatron" else None),
                   make_host(third_party=False), model_name="tiny")
    model = build_train_model(tiny, rc, impl=impl)
    ids = _ids(tiny).cpu()
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    with _HostCopies() as copies:
        fwd = model.forward_train(ids, with_mtp=True)
        loss = sft_loss_sum(fwd.logprobs, mask)[0]
        mtp = mtp_loss(fwd.mtp_logits, ids, mask)
    assert fwd.logprobs.device.type == "cpu" and fwd.logprobs.shape == (ids.shape[0], ids.shape[1] - 1)
    assert fwd.mtp_logits and all(m.is_cuda for m in fwd.mtp_logits)          # the MTP logits stay on the GPU
    assert mtp is not None and mtp.device.type == "cpu"
    (loss + mtp).backward()
    vocab_rows = (ids.shape[1] - 2) * tiny.vocab_size           # one row of an MTP depth's logits, and more
    assert copies.sizes and max(copies.sizes) < vocab_rows, (max(copies.sizes), vocab_rows)


@pytest.mark.parametrize("impl,packed", [("miles", False), ("megatron", False), ("megatron", True)],
                         ids=["miles-rows", "megatron-rows", "megatron-packed"])
def test_the_train_forward_scores_through_the_fused_head(ckpt, tiny, impl, packed):
    """dsv4 train's forward takes the next tokens' log-probs from the module's op table (``triton.head_logprobs``:
    the head's GEMM, then one kernel each way instead of log_softmax, the gather and their backward), never
    from logits; they equal the logits path's (the same GEMM; only the lse's summation order differs), and so do
    the gradients (the head's and the trunk's). ``packed``: a micro-batch packed into one stream (``lengths``)."""
    from core.kernel_ops import kernels_ran, reset_kernels_ran
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from train.model import build_train_model, token_logprobs

    rc = normalize(Choices(impl=impl, kernel_backend="triton", hardware="nvidia", model=tiny,
                           qkv_format="thd" if impl == "megatron" else None),
                   make_host(third_party=False), model_name="tiny")
    torch.manual_seed(0)
    model = build_train_model(tiny, rc, impl=impl)
    ids, T = _ids(tiny).cpu(), 0.8
    lengths = [SEQ, SEQ - 17] if packed else None
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    head = next(n for n in params if n.endswith("output_layer.weight"))
    trunk = next(n for n in params if n.startswith("module.decoder.layers.0.self_attention.linear_q"))

    def grads(lp):
        mask = torch.ones_like(lp, dtype=torch.bool)
        if lengths:
            mask = torch.arange(SEQ - 1)[None, :] < torch.tensor(lengths)[:, None] - 1
        for p in params.values():
            p.grad = None
        (-(lp * mask).sum()).backward()
        return {n: params[n].grad.float().clone() for n in (head, trunk)}, mask

    reset_kernels_ran()
    fused = model.forward_train(ids, temperature=T, lengths=lengths).logprobs
    ran = kernels_ran()
    assert ran.get("triton.head_logprobs") == 1 and not ran.get("none.head_logprobs"), ran
    g_fused, mask = grads(fused)
    plain = token_logprobs(model._forward_rows(ids, None, False)[0], ids.cuda(), T).cpu()
    g_plain, _ = grads(plain)
    d = (fused - plain).abs()[mask]
    print(f"\n{impl} packed={packed}: fused vs logits path |lp diff| mean {d.mean().item():.3e} max "
          f"{d.max().item():.3e}")
    if packed:     # another attention layout (one stream): bf16 differences of the trunk, not of the head
        assert d.mean().item() <= BF16_MEAN and d.max().item() <= BF16_MAX
        return
    assert d.max().item() <= 1e-4
    # the bf16 backward's own noise: the logits path again with its upstream gradient moved by a bf16 step
    # (the two paths round the logits' gradient to bf16 apart by a last bit here and there, and every later
    # bf16 rounding of the trunk's backward may then fall the other way)
    nudge = 1 + 2.0 ** -8
    again = token_logprobs(model._forward_rows(ids, None, False)[0], ids.cuda(), T).cpu()
    g_noise, _ = grads(again * nudge)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()     # noqa: E731
    assert rel(g_fused[head], g_plain[head]) <= 1e-3
    noise = rel(g_noise[trunk] / nudge, g_plain[trunk])
    err = rel(g_fused[trunk], g_plain[trunk])
    print(f"{trunk}: relative gradient difference {err:.3e} (bf16 noise of the logits path: {noise:.3e})")
    assert err <= 3 * noise + 1e-4, trunk
