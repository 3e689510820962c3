"""One supported combination: it resolves to the right plugins and configuration, its implementation
scores like the reference model on a checkpoint in the row's weight format, its kernel backend runs, and
its quantization scheme does what the row promises.

Bazel runs this file once per row of the combination table (tests/matrix.bzl). GPU rows are tagged "gpu"
and only run on a GPU machine (plain pytest there), where the availability check is a real probe.

Every row:

* scores a parity checkpoint (tests/parity_weights.py: attention sinks, ape, hc bases, hc scales (the
  alphas) and the router bias are random and non-neutral, so a swapped mapping shows) **in the row's
  format**: bf16 (bf16, nvfp4, qat rows); an FP8 128x128 checkpoint (fp8 row); an MXFP4-experts
  checkpoint taken through the scheme's ``prepare`` (the prepare-fp8 stage) (mxfp4-fp8 row);
* compares per-token log-probabilities with the fp32 reference model on the CPU, on the same file
  (:data:`PARITY_TOL`: the CPU rows run fp32; the GPU rows run bf16, the run's default there);
* checks that its kernel backend's ``sparse_attention_with_sink`` ran (and, for a GPU kernel backend,
  its ``indexer_scores``: the tiny model has CSA layers), through ``core.kernel_ops.kernels_ran``;
* publishes the implementation's exported weights (nudged off every quantization grid, as after a
  training step) through ``assemble(run).scheme.publish``, checks the published format and an
  element-wise bound per format, decodes them (``rollout.reference_engine.decode_published``) and checks that the
  decoded weights score within :data:`PUBLISH_TOL` of the source.

The qat row also checks ``scheme.prepare_training(model)``: the fake-quant forward differs from the
high-precision one by a nonzero, bounded amount (:data:`QAT_FORWARD_TOL`), gradients reach the master
weights straight through, and removing it restores the high-precision forward bit for bit.
"""

import json

import pytest
from click.testing import CliRunner

from core.config import preset
from core.combinations import Combination, supported_combinations
from core.records import ATTENTION, HARDWARE, KERNEL, QUANT
from core.run_config import Choices, availability_problems, normalize
from launchers.builtin_plugins import make_host
from launchers.cli import main
from tests.runner import param

IMPL, KERNEL_NAME, QUANT_NAME, HARDWARE_NAME = (param(k) for k in ("impl", "kernel_backend", "quant", "hardware"))
# the row's model: tiny, or tiny with V4's attention heads (64 x 512) for a backend built for those only
MODEL_NAME = "tiny-wide-heads" if KERNEL_NAME == "cuda" else "tiny"
TINY = preset(MODEL_NAME)
LENGTHS = (5, 140)          # one short sequence; one past the 128-token window, with compressed entries

# |implementation - fp32 reference| per token, nats, by the dtype the row computes in (max, mean).
# fp32 (CPU rows): summation order only. bf16 (GPU rows): bf16 weights and activations against the fp32
# oracle (bf16 `none` vs fp32 `none` is ~1e-2 mean on this model; kernels add their own accumulation order).
PARITY_TOL = {"float32": (1e-4, 1e-5), "bfloat16": (0.25, 2e-2)}
# |reference(decoded published weights) - reference(source weights)| per token, nats (max, mean), fp32.
# The decoded weights carry the publish format's rounding: FP8 e4m3 (3 mantissa bits) on every allow-listed
# weight, NVFP4 (e2m1, 1x16 e4m3 block scales) on the routed experts; bf16 publishes the weights unchanged.
PUBLISH_TOL = {"bf16": (0.0, 0.0), "fp8": (0.15, 2e-2), "nvfp4": (0.3, 4e-2)}
# QAT's fake-quant forward vs the high-precision forward of the same weights, nats: (min of max, max, mean).
QAT_FORWARD_TOL = (1e-3, 0.25, 5e-2)


@pytest.fixture(scope="module")
def host():
    return make_host(third_party=False)


@pytest.fixture(scope="module")
def run(host):
    choices = Choices(impl=IMPL, kernel_backend=KERNEL_NAME, quant=QUANT_NAME, hardware=HARDWARE_NAME, model=TINY)
    return normalize(choices, host, model_name=MODEL_NAME)


@pytest.fixture(scope="module")
def parts(run):
    from core.assembly import assemble

    return assemble(run)


def test_resolves_to_the_named_builtin_plugins(run, host):
    sel = run.selection
    assert (sel.impl.name, sel.kernel.name, sel.quant.name, sel.hardware.name) == (IMPL, KERNEL_NAME, QUANT_NAME, HARDWARE_NAME)
    for record in (sel.impl, sel.kernel, sel.quant, sel.hardware):
        assert record.provider == "dsv4"
    assert sel.impl is host.get(ATTENTION, IMPL)
    assert sel.kernel is host.get(KERNEL, KERNEL_NAME)
    assert sel.quant is host.get(QUANT, QUANT_NAME)
    assert sel.hardware is host.get(HARDWARE, HARDWARE_NAME)


def test_configuration_takes_the_documented_defaults(run, host):
    import torch

    assert run.qkv_format == host.get(ATTENTION, IMPL).qkv_formats[0]
    assert (run.tp, run.pp, run.cp, run.ep) == (1, 1, 1, 1)
    # GPU rows compute in bf16 (GPU kernels refuse fp32); CPU rows in fp32
    assert run.torch_dtype == (torch.bfloat16 if host.get(HARDWARE, HARDWARE_NAME).gpu else torch.float32)


def test_the_bazel_row_is_still_supported_by_the_plugins(host):
    """This target's row was written into tests/combinations.bzl when the table was last generated; the table
    computed from today's plugin records must still hold it (a plugin that dropped the combination fails here,
    not in a user's run). That the generated files are current is //tests:generated_files_test's check, and
    that each row really runs is the rest of this file's."""
    gpu = host.get(HARDWARE, HARDWARE_NAME).gpu
    assert Combination(IMPL, KERNEL_NAME, QUANT_NAME, HARDWARE_NAME, gpu) in supported_combinations(host)


def test_every_backend_factory_imports(run):
    sel = run.selection
    for record in (sel.impl, sel.kernel, sel.quant, sel.hardware):
        assert callable(record.load()), record


def test_backends_can_run_on_this_machine(run):
    # On the CPU this checks the cpu target and reference kernels; GPU rows
    # only run on a GPU machine, where it probes CUDA/ROCm and kernel packages.
    assert availability_problems(run) == []


def test_cli_validate_prints_the_same_configuration(run):
    result = CliRunner().invoke(
        main,
        ["validate", "--json", "--impl", IMPL, "--kernel-backend", KERNEL_NAME, "--quant", QUANT_NAME, "--hardware", HARDWARE_NAME,
         "--model", MODEL_NAME],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == run.as_dict()


# -- the row's checkpoint ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(parts, tmp_path_factory):
    """(the checkpoint the row starts from, the checkpoint it scores): the same file except for mxfp4-fp8,
    whose MXFP4-experts checkpoint goes through the scheme's prepare (prepare-fp8) first."""
    from tests.parity_weights import prepare_parity_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    if QUANT_NAME == "mxfp4-fp8":
        src = prepare_parity_checkpoint(root / "mxfp4", TINY, dtype="mxfp4-experts", seed=5)
        return src, parts.scheme.prepare(src, root / "fp8", verbose=False)
    fmt = "fp8" if QUANT_NAME == "fp8" else "bf16"
    ckpt = prepare_parity_checkpoint(root / fmt, TINY, dtype=fmt, seed=5)
    return ckpt, ckpt


EXPERT = "layers.3.ffn.experts.0.w1.weight"
SHARED = "layers.3.ffn.shared_experts.w1.weight"
LINEAR = "layers.3.attn.wq_a.weight"


def test_the_scored_checkpoint_is_in_the_rows_format(checkpoints):
    import torch

    from core.checkpoint import open_checkpoint

    source, scored = (open_checkpoint(p) for p in checkpoints)
    stored = {n: scored.get_tensor(n, dequantize=False).dtype for n in (EXPERT, SHARED, LINEAR)}
    if QUANT_NAME in ("fp8", "mxfp4-fp8"):
        assert set(stored.values()) == {torch.float8_e4m3fn}, stored
        assert all(n[: -len("weight")] + "scale" in scored.tensor_names() for n in stored)
    else:
        assert set(stored.values()) == {torch.bfloat16}, stored
    if QUANT_NAME == "mxfp4-fp8":   # the source held MXFP4 experts; prepare-fp8 kept every value
        assert source.get_tensor(EXPERT, dequantize=False).dtype == torch.int8
        assert source.get_tensor(SHARED, dequantize=False).dtype == torch.float8_e4m3fn
        a = dict(source.iter_tensors(dtype=torch.float32, progress=False))
        b = dict(scored.iter_tensors(dtype=torch.float32, progress=False))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # the parity checkpoint has no neutral sink / ape / hc base / hc scale / router bias
    t = dict(scored.iter_tensors(dtype=torch.float32, progress=False))
    for n in ("layers.1.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.1.hc_attn_base",
              "layers.3.ffn.gate.bias", "hc_head_base"):
        assert t[n].abs().min() > 0, n
    alphas = t["layers.1.hc_attn_scale"]
    assert alphas.numel() == 3 and len({round(float(a), 3) for a in alphas}) == 3
    assert not torch.allclose(t["hc_head_scale"], torch.ones(1))


# -- scoring ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(run, checkpoints):
    from launchers.stages import build_impl_model

    return build_impl_model(run, checkpoints[1])


def reference_model(tensors):
    from kernels.reference.model import DeepseekV4Model

    ref = DeepseekV4Model(TINY)
    ref.load_state_dict(tensors, strict=True)
    return ref.eval()


@pytest.fixture(scope="module")
def sequences():
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in LENGTHS]


def reference_logprobs(ref, sequences):
    import torch

    with torch.no_grad():
        return torch.cat([ref.logprobs(s[None])[0] for s in sequences])


def impl_logprobs(model, run, sequences):
    """Per-token log-probs of each sequence (concatenated, fp32 on the CPU), in the run's layout; keeps the graph."""
    import torch

    device = next(model.parameters()).device
    out = []
    for s in sequences:
        ids = s.to(device)
        if run.qkv_format == "thd":
            cu = torch.tensor([0, len(s)], dtype=torch.int32, device=device)
            out.append(model.logprobs(ids, cu)[:-1])
        else:
            out.append(model.logprobs(ids[None])[0])
    return torch.cat(out).float().cpu()


def assert_close(got, want, tol, what):
    worst, mean = (got - want).abs().max().item(), (got - want).abs().mean().item()
    assert worst <= tol[0] and mean <= tol[1], f"{what}: max |d| {worst:.3e} (bound {tol[0]}), mean {mean:.3e} (bound {tol[1]})"
    return worst, mean


@pytest.fixture(scope="module")
def source_tensors(checkpoints):
    import torch

    from core.checkpoint import open_checkpoint

    return dict(open_checkpoint(checkpoints[1]).iter_tensors(dtype=torch.float32, progress=False))


def test_implementation_scores_like_the_reference_model_and_its_kernels_run(run, parts, model, source_tensors,
                                                                            sequences):
    import torch

    from core.kernel_ops import kernels_ran, reset_kernels_ran

    want = reference_logprobs(reference_model(source_tensors), sequences)
    reset_kernels_ran()
    with torch.no_grad():
        got = impl_logprobs(model, run, sequences)
    ran = kernels_ran()
    assert_close(got, want, PARITY_TOL[str(run.torch_dtype).removeprefix("torch.")], "implementation vs reference")
    expected = [f"{KERNEL_NAME}.sparse_attention_with_sink"]
    if KERNEL_NAME != "none" and any(r == 4 for r in TINY.compress_ratios):   # a CSA layer: the indexer runs
        provider = parts.ops.provider["indexer_scores"]          # cuda: the triton backend's indexer kernel
        assert provider != "none", provider
        expected.append(f"{provider}.indexer_scores")
    for key in expected:
        assert ran.get(key, 0) > 0, (key, ran)


# -- the scheme ------------------------------------------------------------------------------------

def exported_and_nudged(model):
    """The implementation's weights as the trainer exports them (official names, bf16 / fp32-kept), each
    floating tensor times (1 + 1% noise): off the FP8 / FP4 grids the checkpoint put them on."""
    import torch

    from core.export import export_buckets
    from engine.loading import full_native_state

    g = torch.Generator().manual_seed(11)
    out = []
    for bucket in export_buckets(full_native_state(model).items(), TINY, max_bucket_bytes=1 << 40, dtype=torch.bfloat16):
        for n, t in bucket:
            t = t.cpu()
            if t.is_floating_point():
                t = (t.float() * (1 + 0.01 * torch.randn(t.shape, generator=g))).to(t.dtype)
            out.append((n, t))
    return out


def fp8_bound_holds(x, q, scale):
    """e4m3 with a per-128x128-block power-of-two scale s: |q*s - x| <= 2^-4 |x| + 2^-10 s (half an ulp in
    the normal range, half the subnormal step below it)."""
    import torch

    from converters.fp8_quantizer import dequantize_fp8_blocks

    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[: x.shape[0], : x.shape[1]]
    err = (dequantize_fp8_blocks(q, scale) - x.float()).abs()
    return bool((err <= 2.0 ** -4 * x.float().abs() + 2.0 ** -10 * s).all())


def nvfp4_bound_holds(x, decoded, global_scale):
    """Per 1x16 block: |W' - W| <= 0.18 amax_blk + 6 * 2^-10 g: e2m1's largest half-gap (1, between 4 and 6)
    times the effective scale amax_blk / 6 (e4m3-rounded up by at most 2^-4), or saturation at 6 scales
    (at most amax_blk 2^-4); e4m3 subnormal block scales add up to 2^-10 g per code unit."""
    x = x.float()
    amax = x.abs().reshape(x.shape[0], -1, 16).amax(-1, keepdim=True)
    err = (decoded - x).abs().reshape(x.shape[0], -1, 16)
    return bool((err <= 0.18 * amax + 6 * 2.0 ** -10 * global_scale.float()).all())


def test_published_weights_decode_within_the_formats_bound_and_score_like_the_source(parts, model, sequences):
    import torch

    from converters.quant_allowlist import is_routed_expert_weight
    from rollout.reference_engine import decode_published

    scheme = parts.scheme
    fmt = {"bf16": "bf16", "fp8": "fp8", "nvfp4": "nvfp4"}[scheme.publish_format]
    assert fmt == {"bf16": "bf16", "qat": "bf16", "fp8": "fp8", "mxfp4-fp8": "fp8", "nvfp4": "nvfp4"}[QUANT_NAME]
    source = exported_and_nudged(model)
    published = dict(scheme.publish(source))
    src = dict(source)
    if fmt == "bf16":
        assert published.keys() == src.keys() and all(torch.equal(published[n], src[n]) for n in src)
    elif fmt == "fp8":
        fp8 = [n for n, t in published.items() if t.dtype == torch.float8_e4m3fn]
        assert EXPERT in fp8 and SHARED in fp8 and LINEAR in fp8
        for n in fp8:
            assert fp8_bound_holds(src[n], published[n], published[n[: -len("weight")] + "scale"]), n
    else:
        routed = [n for n in src if is_routed_expert_weight(n)]
        assert routed and EXPERT in routed
        for n in src:
            if n in routed:
                assert published[n].dtype == torch.uint8 and published[n + "_scale"].dtype == torch.float8_e4m3fn
            else:   # shared experts and everything else stay high precision
                assert torch.equal(published[n], src[n]) and n + "_scale" not in published, n
    decoded = decode_published(published.items(), torch.float32)
    assert decoded.keys() == src.keys()
    if fmt == "nvfp4":
        for n in routed:
            assert nvfp4_bound_holds(src[n], decoded[n], published[n + "_scale_2"]), n
    want = reference_logprobs(reference_model({n: t.float() for n, t in src.items()}), sequences)
    got = reference_logprobs(reference_model({n: t.float() for n, t in decoded.items()}), sequences)
    d = assert_close(got, want, PUBLISH_TOL[fmt], f"{fmt} published and decoded vs source")
    print(f"\n{fmt} publish: max {d[0]:.3e} mean {d[1]:.3e}")
    if fmt != "bf16":
        assert d[0] > 0   # the format's rounding reached the scores


@pytest.mark.skipif(QUANT_NAME != "qat", reason="the qat row's training-side check")
def test_qat_prepare_training_fake_quantizes_with_straight_through_gradients(parts, run, model, sequences):
    import torch

    from engine.moe import DSv4GroupedExperts

    experts = [p for m in model.modules() if isinstance(m, DSv4GroupedExperts) for p in m.parameters()]
    assert experts

    def forward_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            lp = impl_logprobs(model, run, sequences)
            (-lp.mean()).backward()
        return lp.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in experts]

    # the indexer trains only under an indexer KL loss (GPU indexer kernels have no backward): frozen here
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n and p.requires_grad]
    for p in indexer:
        p.requires_grad_(False)
    plain, plain_grads = forward_and_grads()
    try:
        parts.scheme.prepare_training(model)
        fake, fake_grads = forward_and_grads()
    finally:
        parts.scheme.remove(model)
        for p in indexer:
            p.requires_grad_(True)
    worst, mean = (fake - plain).abs().max().item(), (fake - plain).abs().mean().item()
    print(f"\nqat forward: max {worst:.3e} mean {mean:.3e}")
    assert QAT_FORWARD_TOL[0] < worst <= QAT_FORWARD_TOL[1] and mean <= QAT_FORWARD_TOL[2], (worst, mean)
    # straight through: the master weights get the gradient at the quantized weights, close to (not equal
    # to) the high-precision gradient
    g, h = torch.cat([x.flatten() for x in fake_grads]).double(), torch.cat([x.flatten() for x in plain_grads]).double()
    assert torch.isfinite(g).all() and g.abs().sum() > 0 and not torch.equal(g, h)
    assert torch.nn.functional.cosine_similarity(g, h, dim=0) > 0.9
    back, _ = forward_and_grads()
    assert torch.equal(back, plain)      # removed: the high-precision forward again
    model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
