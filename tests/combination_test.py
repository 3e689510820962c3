"""One supported combination: it resolves to the right plugins and configuration,
and its implementation scores like the reference model.

Bazel runs this file once per row of the combination table (tests/matrix.bzl).
GPU rows are tagged and only run on a GPU machine, where the availability check
below is a real probe of the device and the kernel packages.

The parity check loads a tiny checkpoint in the weight format the quantization
scheme reads (bf16; fp8 128x128 blocks; MXFP4 experts converted to FP8 by the
prepare-fp8 converter) into the chosen implementation and compares per-token
log-probabilities with the reference model on the same file. nvfp4 and qat
change publishing and training, not how a checkpoint is scored, so their rows
score a bf16 checkpoint.
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


@pytest.fixture(scope="module")
def host():
    return make_host(third_party=False)


@pytest.fixture(scope="module")
def run(host):
    choices = Choices(impl=IMPL, kernel_backend=KERNEL_NAME, quant=QUANT_NAME, hardware=HARDWARE_NAME, model=preset("tiny"))
    return normalize(choices, host, model_name="tiny")


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
    assert run.qkv_format == host.get(ATTENTION, IMPL).qkv_formats[0]
    assert (run.tp, run.pp, run.cp, run.ep) == (1, 1, 1, 1)


def test_is_a_row_of_the_generated_table(host):
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


CHECKPOINT_FORMAT = {"fp8": "fp8", "mxfp4-fp8": "mxfp4-experts"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from core.checkpoint import prepare_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    ckpt = prepare_checkpoint(root / "tiny", preset("tiny"), dtype=CHECKPOINT_FORMAT.get(QUANT_NAME, "bf16"), seed=5)
    if QUANT_NAME == "mxfp4-fp8":
        from converters.mxfp4_to_fp8 import convert_mxfp4_to_fp8

        ckpt = convert_mxfp4_to_fp8(ckpt, root / "fp8", verbose=False)
    return ckpt


def test_implementation_scores_like_the_reference_model(run, checkpoint):
    import torch

    from core.checkpoint import load_into, open_checkpoint
    from kernels.reference.model import DeepseekV4Model
    from launchers.stages import build_impl_model, sequence_logprobs

    model = build_impl_model(run, checkpoint)
    device = next(model.parameters()).device
    reference = DeepseekV4Model(preset("tiny"))
    load_into(reference, open_checkpoint(checkpoint))
    reference.eval()
    g = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if HARDWARE_NAME == "cpu" else 5e-2  # fp32 on the CPU; GPU kernels accumulate differently
    for length in (5, 140):
        seq = torch.randint(0, preset("tiny").vocab_size, (length,), generator=g).tolist()
        with torch.no_grad():
            got = torch.tensor(sequence_logprobs(model, run.qkv_format, seq, device))
            want = reference.logprobs(torch.tensor([seq]))[0]
        assert (got - want).abs().max().item() <= tolerance, length


def test_cli_validate_prints_the_same_configuration(run):
    result = CliRunner().invoke(
        main,
        ["validate", "--json", "--impl", IMPL, "--kernel-backend", KERNEL_NAME, "--quant", QUANT_NAME, "--hardware", HARDWARE_NAME],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == run.as_dict()


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
