"""How many kernels one eager decode step launches, and which lines of the engine launch them, counted on the CPU.

    python -m bench.decode_launches [--model flash-shaped] [--batch 8] [--without OP ...] [--out FILE.json]

Why: the eager Flash-shaped step at 64 sequences spends about half its time outside the weight reads, in about 390
small kernels (``bench.rollout --profile-steps``, ``docs/rollout.md``); cutting them is the lever, and their
number does not need a GPU to count. The step (``kernels.reference.slots.static_decode_step``, the engine's
eager step, grouped MoE path) runs on the CPU in bf16 on a model with ``--model``'s layer pattern (its attention
kinds, hash layers, experts and top-k, streams) at the tiny preset's widths, under a stand-in for the triton
backend's decode table: the reference functions under the names of the ops the triton table serves in an eager
step, each counted as the launches its kernel makes at the real widths (:data:`LAUNCHES`: one, three for the mHC
``hc_pre`` and ``hc_head``), with nothing inside it counted; likewise a GEMM
of bf16 operands with an fp32 result (``kernels.reference.layers.mm_fp32_out``: one GEMM on a GPU, casts and a GEMM
on the CPU). Every other torch
operator that makes a tensor is one launch (:class:`_Count`; views and metadata are not). On a GPU some operators
launch more than one kernel (cuBLAS's split-K reduction, a few index kernels), so this is a floor of the profile's
count, not its copy; which ops it leaves out is in the record (``--without``: the torch code runs instead, e.g.
``--without compressor_step``).

The table and a JSON record (date, machine, settings, the count, per call site) go to the terminal and ``--out``
(default ``bench/results/decode-launches-cpu-<model>.json``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import platform
import traceback
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
#: launches of each stand-in op's GPU kernel at a decode step's sizes (the triton mHC pre and head: the split mixing
#: GEMM, its sum, the coefficients); others one (the router's split gate GEMM picks in its last programs), but for
#: the second expert GEMM with the activation at many rows an expert (two: :func:`_launches`)
LAUNCHES = {"hc_pre": 3, "hc_head": 3}
#: the mHC ops with their norm: one launch up to ``PRE_NORM_MAX_TOKENS`` tokens, else two (the split mixing GEMM,
#: then a program a token; ``kernels/triton/mhc_decode.py``), where the mHC op and the norm apart take four
WITH_NORM = ("hc_pre_norm", "hc_head_norm")
#: the triton table's ops of an eager decode step (``rollout.engine_ops.decode_choices`` on bf16, Hopper)
TRITON_DECODE_OPS = ("sparse_attention_with_sink", "indexer_scores", "hadamard_transform", "hc_pre", "hc_post",
                     "hc_head", "rms_norm", "rms_normalize", "apply_rope", "weighted_swiglu", "experts_grouped_mm",
                     "route_experts", "expert_order", "compressor_step", "experts_gather_mm", "experts_scatter_mm",
                     "experts_swiglu_scatter_mm", "moe_combine", "moe_combine_post", "norm_rope", "decode_topk",
                     "index_query", "linear_group", "hc_pre_norm", "hc_head_norm", "attention_rows",
                     "grouped_projection", "attention_inverse_rope", "linear_post")
#: operators that make no kernel: views, metadata, allocations without a fill
_NO_KERNEL = {"view", "_unsafe_view", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze", "permute",
              "transpose", "t", "alias", "detach", "reshape", "split", "chunk", "unbind", "split_with_sizes",
              "_reshape_alias", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "promote_types",
              "scalar_tensor", "item", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride"}


class _Count(TorchDispatchMode):
    """Counts the operators that launch a kernel, by the innermost line of the repository that called them, except
    inside a stand-in op (its own count is added by :func:`_counted`)."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.inside and name not in _NO_KERNEL:
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _site() -> str:
    """``path:line function`` of the innermost frame of the repository's code (not this file)."""
    for frame in reversed(traceback.extract_stack()):
        rel = _in_repo(frame.filename)
        if rel is not None and not rel.endswith("decode_launches.py"):
            return f"{rel}:{frame.lineno} {frame.name}"
    return "(outside the repository)"


@functools.lru_cache(maxsize=None)
def _in_repo(filename: str):
    """``filename`` relative to the repository, or None; resolved first (Bazel runs the files through symlinks)."""
    path = Path(filename).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else None


def _launches(name: str, args) -> int:
    """How many kernels the triton op ``name`` launches on ``args``."""
    if name == "experts_swiglu_scatter_mm":           # (h, weights, limit, w, offs, order, shared)
        from kernels.gpu_common import experts_wide

        return 1 + experts_wide(args[0].shape[0], args[3].shape[0] + (args[6] is not None))
    if name in WITH_NORM:
        from kernels.gpu_common import PRE_NORM_MAX_TOKENS

        return 1 if args[0][..., 0, 0].numel() <= PRE_NORM_MAX_TOKENS else 2
    return LAUNCHES.get(name, 1)


def _counted(name: str, fn, counter: _Count):
    def op(*args, **kwargs):
        if not counter.inside:
            k = _launches(name, args)
            counter.sites[f"{name} (one kernel)" if k == 1 else f"{name} ({k} kernels)"] += k
        counter.inside += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.inside -= 1
    op.counted_as = f"stand-in.{name}"
    return op


def stand_in_table(counter: _Count, without=()):
    """The reference functions under the triton decode table's names (:data:`TRITON_DECODE_OPS` less ``without``),
    each counted by ``counter`` as its kernel's launches."""
    from core.kernel_ops import OpTable
    from kernels.reference import slots
    from kernels.reference.attention import attention_inverse_rope
    from kernels.reference.backend import reference_functions
    from kernels.reference.compressor_step import compressor_step
    from kernels.reference.norm_rope import norm_rope
    from kernels.reference.index_query import index_query
    from kernels.reference.layers import grouped_projection
    from kernels.reference.linear_group import linear_group
    from kernels.reference.mhc import hc_head_norm, hc_pre_norm
    from kernels.reference.moe import route_experts
    from kernels.reference.topk import attention_rows, decode_topk

    required = reference_functions()                     # every table has these; the extras only when kept
    extras = {"experts_grouped_mm": slots._grouped_mm, "expert_order": slots.expert_order,
              "route_experts": route_experts, "compressor_step": compressor_step,
              "experts_gather_mm": slots.gather_grouped_mm, "experts_scatter_mm": slots.scatter_grouped_mm,
              "experts_swiglu_scatter_mm": slots.swiglu_scatter_grouped_mm,
              "moe_combine": slots.combine_pairs, "moe_combine_post": slots.combine_post, "norm_rope": norm_rope,
              "decode_topk": decode_topk,
              "index_query": index_query, "linear_group": linear_group, "hc_pre_norm": hc_pre_norm,
              "hc_head_norm": hc_head_norm, "attention_rows": attention_rows,
              "grouped_projection": grouped_projection, "attention_inverse_rope": attention_inverse_rope,
              "linear_post": slots.linear_post}
    fns = {**required, **{n: f for n, f in extras.items() if n not in without}}
    return OpTable("stand-in", {n: (_counted(n, f, counter) if n in TRITON_DECODE_OPS and n not in without else f)
                                for n, f in fns.items()})


def model_like(name: str):
    """``name``'s preset with its layer pattern, experts, top-k, streams and window, at the tiny preset's widths."""
    from core.config import preset

    c, tiny = preset(name), preset("tiny")
    widths = ("vocab_size", "dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
              "index_n_heads", "index_head_dim", "moe_inter_dim")
    return dataclasses.replace(c, **{f: getattr(tiny, f) for f in widths}, index_topk=tiny.index_topk)


def count_step(config, batch: int, without=(), prompt_len: int = 5) -> _Count:
    """The launches of one eager decode step of ``batch`` slots (module docstring)."""
    from kernels.reference import layers, slots
    from kernels.reference.decode import prefill
    from kernels.reference.model import DeepseekV4Model, init_weights, ops_in_use

    torch.manual_seed(0)
    model = DeepseekV4Model(config)
    init_weights(model)
    model = model.to(torch.bfloat16)
    slots.stack_expert_weights(model)
    counter = _Count()
    table = stand_in_table(counter, without)
    # bf16 operands with an fp32 result: one GEMM on a GPU, upcasts and a GEMM on the CPU
    one_gemm = mock.patch.object(layers, "mm_fp32_out", _counted("mm_fp32_out", layers.mm_fp32_out, counter))
    with torch.no_grad(), ops_in_use(model, table), one_gemm:
        cache, _ = prefill(model, [list(range(1, prompt_len + 1))] * batch, max_len=4 * config.window_size)
        sc = slots.SlotCache.like(cache, batch)
        sc.load(range(batch), cache, range(batch))
        tokens, active = torch.ones(batch, dtype=torch.long), torch.ones(batch, dtype=torch.bool)
        paths = slots.static_step_checks(model, tokens, "grouped", sc.max_len)
        counter.inside = 1                               # the first step makes the lazily built state
        slots.static_step_body(model, sc, tokens, active, paths)
        counter.sites.clear()
        counter.inside = 0
        with counter:
            slots.static_step_body(model, sc, tokens, active, paths)
    return counter


def _code() -> str:
    """The commit of the code counted (``git describe --always --dirty``), or ``unknown``."""
    import subprocess

    got = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return got.stdout.strip() or "unknown"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flash-shaped")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--without", nargs="*", default=[], choices=TRITON_DECODE_OPS,
                   help="ops the stand-in table leaves out (the torch code runs instead)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out")
    a = p.parse_args(argv)
    counter = count_step(model_like(a.model), a.batch, a.without)
    total = sum(counter.sites.values())
    rows = [dict(site=s, launches=n) for s, n in counter.sites.most_common()]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = dict(bench="decode_launches", date=now, machine=f"{platform.machine()} CPU (torch {torch.__version__})",
                  code=_code(), model=a.model, batch=a.batch,
                  widths="tiny", dtype="bf16", moe_path="grouped", table="stand-in for triton",
                  ops=[o for o in TRITON_DECODE_OPS if o not in a.without], without=a.without,
                  launches_per_step=total, sites=rows)
    print(f"{a.model} layer pattern, {a.batch} slots: {total} launches a step (ops left out: {a.without or 'none'})")
    for r in rows[:a.top]:
        print(f"{r['launches']:6d}  {r['site']}")
    out = Path(a.out or REPO / "bench" / "results" / f"decode-launches-cpu-{a.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
