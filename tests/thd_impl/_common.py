"""Shared helpers of the packed-sequence (THD) / context-parallel (CP) implementation tests (tiny, fp32, CPU)."""

from __future__ import annotations

import torch

from core.config import preset
from tests.impl_miles._helpers import perturb  # one weight perturbation for every parity test

TINY = preset("tiny")

# Segment lengths of the packed stream: 1-token segments, segments shorter than a ratio (3 < 4),
# exactly one ratio-128 group (129, 128), past the window (150, 260 > 128), plus a pad segment that
# makes the stream split evenly over 2 and 4 CP ranks with >= 128 rows each (560 = 4 * 140).
LENGTHS = (1, 3, 150, 7, 260, 4, 129)
STREAM = 560


def cu_seqlens(lengths=LENGTHS, total: int | None = STREAM) -> torch.Tensor:
    lens = list(lengths)
    if total is not None and total > sum(lens):
        lens.append(total - sum(lens))  # the pad segment
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)])


def samples(lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    return [torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed + i))
            for i, n in enumerate(lengths)]


def stream(lengths=LENGTHS, total: int | None = STREAM, seed: int = 0) -> torch.Tensor:
    ids = torch.cat(samples(lengths, seed))
    if total is not None and total > ids.numel():
        ids = torch.cat([ids, torch.zeros(total - ids.numel(), dtype=torch.long)])
    return ids


def run_config(impl: str, *, tp: int = 1, cp: int = 1, ep: int = 1, qkv_format: str | None = None,
               hardware: str = "cpu", dtype: str | None = None):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, tp=tp, cp=cp, ep=ep, qkv_format=qkv_format, hardware=hardware,
                             dtype=dtype, model=TINY),
                     make_host(third_party=False), model_name="tiny")


def official_weights(tmp_path) -> dict:
    from core.checkpoint import open_checkpoint, prepare_checkpoint

    ckpt = prepare_checkpoint(tmp_path / "ckpt", TINY, dtype="bf16", seed=0)
    return perturb(dict(open_checkpoint(ckpt).iter_tensors(dtype=torch.float32, progress=False)))


def saved_official_weights(tmp_path) -> tuple:
    """``(official weights, path of their torch.save copy)``: what spawned workers load."""
    official = official_weights(tmp_path)
    path = tmp_path / "official.pt"
    torch.save(official, path)
    return official, path


def build(impl: str, official: dict, *, tp: int = 1, cp: int = 1, ep: int = 1, qkv_format: str | None = None,
          indexer_coeff: float | None = None, hardware: str = "cpu", dtype: str | None = None):
    """A model of ``impl`` with the official-name weights (process already set up by the hardware target;
    built on the CPU, move it to a GPU yourself); ``indexer_coeff``: megatron's ``dsa_indexer_loss_coeff``
    (its indexer KL loss; None = off)."""
    from engine.loading import load_hf_state_dict

    rc = run_config(impl, tp=tp, cp=cp, ep=ep, qkv_format=qkv_format, hardware=hardware, dtype=dtype)
    if impl == "miles":
        from core.assembly import assemble

        m = assemble(rc).build_model(TINY)
    else:
        from core.assembly import assemble

        m = assemble(rc).build_model(TINY, dsa_indexer_loss_coeff=indexer_coeff)
    load_hf_state_dict(m, official.items(), TINY)
    return m


def reference(official: dict):
    from kernels.reference.model import DeepseekV4Model

    ref = DeepseekV4Model(TINY)
    ref.load_state_dict(official, strict=True)
    return ref


def local_slice(t: torch.Tensor, cp: int, rank: int, dim: int = -1) -> torch.Tensor:
    n = t.shape[dim] // cp
    return t.narrow(dim, rank * n, n)


def packed_loss(model, impl: str, ids: torch.Tensor, cu: torch.Tensor, cp: int, rank: int,
                mtp_weight: float = 0.3) -> torch.Tensor:
    """This rank's share of the global mean next-token NLL (+ MTP depth-0 NLL for miles, + the indexer KL
    loss for megatron built with a coefficient) of a packed
    stream; summing the shares (and gradients) over the CP ranks gives the full loss. The pad segment
    counts like any segment here (it is tokens too; only the sum matters for parity)."""
    from engine.thd_attention import ThdContext

    local = local_slice(ids, cp, rank)
    thd = ThdContext.build(cu, local_len=local.numel())
    lay = thd.layout
    def shifted(k):
        lab = torch.roll(ids, -k)[lay.global_start:lay.global_start + lay.local_len]
        ok = lay.positions + k < lay.segment_ends - lay.segment_starts
        return lab, ok
    n_all = lambda k: float(((lambda L: (L - k).clamp(min=0).sum())(cu[1:] - cu[:-1])))  # noqa: E731
    lab, ok = shifted(1)
    if impl == "miles":
        logits, streams = model(local[None], True, thd=thd)
        logits = logits[0]
        kl = None
    else:
        logits, kl = model(local, cu, return_indexer_loss=True)   # kl: this rank's share (None when off)
    lp = torch.log_softmax(logits, -1).gather(-1, lab[:, None]).squeeze(-1)
    loss = -(lp * ok).sum() / n_all(1)
    if kl is not None:
        loss = loss + kl
    if impl == "miles" and mtp_weight:
        ml = model.mtp_logits(local[None], streams, cu_seqlens=cu)[0][0]
        lab2, ok2 = shifted(2)
        lp2 = torch.log_softmax(ml, -1).gather(-1, lab2[:, None]).squeeze(-1)
        loss = loss - mtp_weight * (lp2 * ok2).sum() / n_all(2)
    return loss


def grads_official(model) -> dict:
    from core.weight_contract import native_to_hf
    from engine.loading import full_native_grads

    return dict(native_to_hf(full_native_grads(model).items(), TINY))


def single_process_group() -> None:
    """What a one-process CPU job does before building a model: the cpu target's setup."""
    import torch.distributed as dist

    from backends.cpu.target import CpuTarget

    if not dist.is_initialized():
        CpuTarget().init_process_group(0, 1, tp=1)
