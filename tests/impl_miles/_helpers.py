"""Shared helpers for the miles implementation tests (tiny config, CPU, fp32)."""

from __future__ import annotations

import torch

from core.config import preset

TINY = preset("tiny")


def run_config(tp: int = 1, hardware: str = "cpu", dtype: str | None = None):
    """The normalized run configuration of `dsv4 --impl miles --tp TP` (reference kernels; CPU by default;
    ``dtype`` None: the hardware's default, bf16 on GPUs)."""
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl="miles", tp=tp, hardware=hardware, dtype=dtype, model=TINY),
                     make_host(third_party=False), model_name="tiny")


def single_process_group() -> None:
    """What a one-process CPU job does before building a model: the cpu target's setup."""
    import torch.distributed as dist

    from backends.cpu.target import CpuTarget

    if not dist.is_initialized():
        CpuTarget().init_process_group(0, 1, tp=1)


def official_from_checkpoint(path) -> dict:
    from core.checkpoint import open_checkpoint

    return dict(open_checkpoint(path).iter_tensors(dtype=torch.float32, progress=False))


def perturb(official: dict, seed: int = 7) -> dict:
    """Richer weights for sharper parity checks: linears x2.5 (std ~0.05), non-zero sinks, ape,
    mHC bases and router biases (so selection-only bias and the sink matter)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in official.items():
        if not t.is_floating_point():
            out[name] = t.clone()
        elif name.endswith(("attn_sink", ".ape", "_base", "gate.bias")):
            out[name] = torch.randn(t.shape, generator=g, dtype=torch.float32) * 0.3
        elif name.endswith("_scale") or name.endswith("norm.weight"):
            out[name] = t.float() + 0.1 * torch.randn(t.shape, generator=g, dtype=torch.float32)
        else:
            out[name] = t.float() * 2.5
    return out


def reference_model(official: dict):
    from kernels.reference.model import DeepseekV4Model

    ref = DeepseekV4Model(TINY)
    missing, unexpected = ref.load_state_dict(official, strict=True)
    return ref


def miles_model(official: dict, tp: int = 1, hardware: str = "cpu", dtype: str | None = None):
    from core.assembly import assemble
    from engine.loading import load_hf_state_dict

    m = assemble(run_config(tp, hardware, dtype)).build_model(TINY)
    load_hf_state_dict(m, official.items(), TINY)
    return m


def token_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model, ids: torch.Tensor, mtp_weight: float = 0.3) -> torch.Tensor:
    """Mean NLL of the trunk plus ``mtp_weight`` x mean NLL of MTP depth 0 (t_{i+2})."""
    logits, streams = model(ids, return_hidden_streams=True)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -lp.mean()
    if mtp_weight:
        ml = model.mtp_logits(ids, streams)[0]  # [B, S-1, V] predicts t_{i+2}
        mlp = torch.log_softmax(ml[:, :-1], -1).gather(-1, ids[:, 2:, None]).squeeze(-1)
        loss = loss - mtp_weight * mlp.mean()
    return loss


def grad_norm(grads: dict) -> float:
    return float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))


def miles_step(model, ids, lr: float = 1e-3):
    """One Adam step on the miles model; returns (loss, official-named full grads, loss after)."""
    from core.weight_contract import native_to_hf
    from engine.loading import full_native_grads

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    opt.zero_grad()
    loss = loss_of(model, ids)
    loss.backward()
    grads = dict(native_to_hf(full_native_grads(model).items(), TINY))
    opt.step()
    with torch.no_grad():
        after = loss_of(model, ids)
    return loss.item(), grads, after.item()


def reference_step(ref, ids, lr: float = 1e-3):
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    opt.zero_grad()
    loss = loss_of(ref, ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    opt.step()
    with torch.no_grad():
        after = loss_of(ref, ids)
    return loss.item(), grads, after.item()
