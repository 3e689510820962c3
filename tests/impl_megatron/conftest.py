"""Fixtures of the `megatron` implementation tests.

megatron-core needs the CPU shims before its first import: as a job does, the conftest asks the cpu
hardware target to set the process up (shims, then a one-process gloo group with tensor-parallel
size 1 for the whole session). Models are built from a normalized run configuration."""

from __future__ import annotations

import pytest
import torch

from backends.cpu.target import CpuTarget

CpuTarget().setup()


def run_config(config, kernel_backend: str = "none"):
    """The normalized RunConfig of `dsv4 --impl megatron` on the CPU."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    choices = Choices(impl="megatron", kernel_backend=kernel_backend, model=config)
    return normalize(choices, make_host(third_party=False), model_name="test")


@pytest.fixture(scope="session", autouse=True)
def megatron_process_group():
    CpuTarget().init_process_group(0, 1, tp=1, seed=1234)
    yield


@pytest.fixture(autouse=True)
def _two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_config():
    from core.config import preset

    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_config):
    from core.checkpoint import prepare_checkpoint

    return prepare_checkpoint(tmp_path_factory.mktemp("tiny_ckpt") / "ckpt", tiny_config, dtype="bf16", seed=0)


def perturbation(config, seed: int = 7) -> dict:
    """Official-name tensors that make every path matter: a prepared checkpoint has zero sinks / ape /
    hc bases / router bias and unit hc scales; give them distinct non-trivial values (the three
    ``hc_*_scale`` entries differ, so swapped alphas would show)."""
    from kernels.reference.model import DeepseekV4Model

    g = torch.Generator().manual_seed(seed)
    out = {}
    meta = DeepseekV4Model(config, device="meta")
    named = dict(meta.named_parameters()) | dict(meta.named_buffers())
    for name, t in named.items():
        if name.endswith(("attn_sink", ".ape", "_base")):
            out[name] = torch.randn(t.shape, generator=g) * 0.3
        elif name.endswith("_scale"):
            base = torch.tensor([1.3, 0.6, 1.1])[: t.numel()]
            out[name] = base + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("gate.bias"):
            out[name] = torch.randn(t.shape, generator=g) * 0.05
    return out


@torch.no_grad()
def apply_official(ref_model, megatron_model, tensors: dict) -> None:
    """Write official-name tensors into the reference model and (through the weight contract) into
    the megatron model."""
    from backends.megatron.impl import native_state
    from core.weight_contract import hf_to_native

    rs = dict(ref_model.state_dict(keep_vars=True))
    for n, t in tensors.items():
        rs[n].data.copy_(t)
    ms = native_state(megatron_model)
    for n, t in hf_to_native(list(tensors.items()), megatron_model.config.dsv4_model_config):
        ms[n].data.copy_(t)


def load_pair(config, ckpt, *, dsa_indexer_loss_coeff=None, perturb=True):
    """(reference model, megatron model), both loaded from the same checkpoint (fp32)."""
    from backends.megatron.impl import load_hf_checkpoint
    from core.assembly import assemble
    from core.checkpoint import load_into, open_checkpoint
    from kernels.reference.model import DeepseekV4Model

    ref = DeepseekV4Model(config)
    load_into(ref, open_checkpoint(ckpt))
    meg = assemble(run_config(config)).build_model(config, dsa_indexer_loss_coeff=dsa_indexer_loss_coeff)
    load_hf_checkpoint(meg, ckpt)
    if perturb:
        apply_official(ref, meg, perturbation(config))
    return ref, meg
