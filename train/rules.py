"""The trainer's rules of the combination table (``train-*``, ``packing-thd``, ``true-on-policy``), beside the
trainer they guard.

Why here: these limits are the trainer's (how its ranks split, what its context parallelism and CUDA graphs need,
where true on-policy is exact), not capabilities a backend declares, so they live with the trainer and join the
table through the plugin hook ``dsv4_job_rules`` (:func:`core.combinations.table_rules`). They apply when the
command is a training job (``Selection.job == "train"``) or when the trainer's options are set.
"""

from __future__ import annotations

from typing import Optional

from core.combinations import Rule, Selection, divisors, join_choices, join_ordered, layout_world, runnable_records
from core.hookspecs import hookimpl
from core.records import HARDWARE


def _train_layout(sel: Selection, host) -> Optional[str]:
    """The trainer's ranks: ``world = dp x tp x cp x pp``; expert parallelism runs inside data parallelism (its
    ranks train on their own samples; with ``--pp``, the data-parallel ranks of one stage), so ``ep`` divides
    ``dp``."""
    if sel.job != "train":
        return None
    world = layout_world(sel)
    mp = sel.tp * sel.cp
    if world < 1 or world % mp:
        return (f"{world} ranks do not split into --tp {sel.tp} x --cp {sel.cp} groups (the rest is data parallel). "
                f"Fix: use a rank count (--nproc-per-node x nodes) that is a multiple of {mp}.")
    dp = world // (mp * sel.pp)      # --pp: each data-parallel rank is --pp stages (train-pipeline checks the split)
    if sel.ep > 1 and sel.max_tokens_per_rank is not None:
        return (f"--ep {sel.ep} with --max-tokens-per-rank: expert-parallel ranks exchange tokens in every forward, "
                f"so they must run the same number of micro-batches, and packing gives each rank its own count. "
                f"Fix: drop --max-tokens-per-rank, or use --ep 1.")
    if dp % sel.ep:
        pp = f" --pp {sel.pp}" if sel.pp > 1 else ""
        return (f"--ep {sel.ep} runs over data-parallel ranks, and {world} ranks with --tp {sel.tp} --cp {sel.cp}{pp} "
                f"give {dp}. Fix: use --ep {divisors(dp)}, or {sel.ep * mp * sel.pp} x N ranks.")
    return None


def _train_pipeline(sel: Selection, host) -> Optional[str]:
    """The trainer's pipeline stages (engine.pipeline.run_items) are built with data parallelism (each data-
    parallel rank's ``--pp`` stages), tensor parallelism within a stage and expert parallelism over the data-
    parallel ranks of a stage, rows of padded samples sent between stages (BSHD; a THD-only implementation,
    megatron, packs each micro-batch's rows as one segment each: backends.megatron.stage); with ``--vpp``,
    :func:`_virtual_stages`."""
    if sel.vpp > 1 and (problem := _virtual_stages(sel)) is not None:
        return problem
    if sel.job != "train" or sel.pp <= 1:
        return None
    for what, bad, fix in ((f"--cp {sel.cp}", sel.cp > 1, "use --cp 1"),
                           (f"{layout_world(sel)} ranks", layout_world(sel) % (sel.pp * sel.tp),
                            f"use a rank count that is a multiple of {sel.pp * sel.tp} (the rest is data parallel)"),
                           (f"--qkv-format {sel.qkv_format}",     # a THD-only implementation: a segment per row
                            sel.qkv_format != "bshd" and "bshd" in sel.impl.qkv_formats, "use --qkv-format bshd"),
                           ("--max-tokens-per-rank", sel.max_tokens_per_rank is not None,
                            "drop --max-tokens-per-rank")):
        if bad:
            return (f"--pp {sel.pp} runs with data, tensor and expert parallelism only, padded rows "
                    f"(got {what}). Fix: {fix}, or use --pp 1.")
    return None


def _virtual_stages(sel: Selection) -> Optional[str]:
    """``--vpp V``: each of the ``--pp P`` ranks holds V chunks of the decoder layers, run by megatron-core's
    interleaved 1F1B (engine.pipeline); built for the trainer only, with ``P > 1``, the layers cut into ``P x V``
    equal chunks (megatron's interleaving assumes equal chunks; engine.pipeline's split reads the same rule)."""
    if sel.job != "train":
        return f"--vpp {sel.vpp}: virtual pipeline stages are built for dsv4 train and full-train only. Fix: drop --vpp."
    if sel.pp <= 1:
        return (f"--vpp {sel.vpp} interleaves the stages of --pp, and the run has --pp {sel.pp}. Fix: add --pp 2 "
                f"(or more), or drop --vpp.")
    n = sel.n_layers
    if n is not None and n % (sel.pp * sel.vpp):
        fits = [v for v in range(2, n // sel.pp + 1) if n % (sel.pp * v) == 0]
        fix = f"use --vpp {join_ordered([str(v) for v in fits])}, or drop --vpp" if fits else "drop --vpp"
        return (f"--pp {sel.pp} x --vpp {sel.vpp} cuts the decoder layers into {sel.pp * sel.vpp} equal chunks, "
                f"and the model's {n} layers do not divide into them. Fix: {fix}.")
    return None


def _train_cp_thd(sel: Selection, host) -> Optional[str]:
    """The trainer's context parallelism splits packed (THD) micro-batches across ranks (the miles model also
    runs BSHD context parallel, for scoring)."""
    if sel.job != "train" or sel.cp <= 1 or sel.qkv_format == "thd":
        return None
    return f"dsv4 train --cp {sel.cp} splits packed micro-batches across ranks: it needs --qkv-format thd " \
           f"(got {sel.qkv_format}). Fix: add --qkv-format thd, or use --cp 1."


def _train_cuda_graphs(sel: Selection, host) -> Optional[str]:
    """``--cuda-graphs`` records the compiled blocks of one GPU's fixed-shape micro-batches (Inductor's
    reduce-overhead mode, engine.compile): a GPU target, one layout for every step, no data-dependent
    exchanges inside the blocks."""
    if not sel.cuda_graphs:
        return None
    if not sel.hardware.gpu:
        gpus = [h.name for h in runnable_records(host, HARDWARE) if h.gpu] if host is not None else ["nvidia"]
        return (f"--cuda-graphs records the compiled blocks as CUDA graphs, which need a GPU (got --hardware "
                f"{sel.hardware.name}). Fix: use --hardware {join_choices(gpus or ['nvidia'])}, or drop --cuda-graphs.")
    if sel.cp > 1 or sel.max_tokens_per_rank is not None:
        return ("--cuda-graphs replays one shape, and packed (THD) micro-batches change their layout at every step "
                f"(got --cp {sel.cp}, --max-tokens-per-rank {sel.max_tokens_per_rank}). Fix: use --cp 1 without "
                "--max-tokens-per-rank (rows padded to pad_to_length), or drop --cuda-graphs.")
    if sel.ep > 1 or sel.tp > 1:
        return (f"--cuda-graphs is built for blocks without collectives inside (got --tp {sel.tp} --ep {sel.ep}): "
                "expert parallelism exchanges data-dependent token counts (a host sync in every block) and tensor-"
                "parallel all-reduces are not captured. Fix: use --tp 1 --ep 1 (data parallel only), or drop "
                "--cuda-graphs.")
    return None


def _packing_thd(sel: Selection, host) -> Optional[str]:
    if sel.max_tokens_per_rank is None or sel.qkv_format == "thd" or sel.job != "train":
        return None
    return (f"--max-tokens-per-rank packs training samples into THD micro-batches (got --qkv-format "
            f"{sel.qkv_format}). Fix: add --qkv-format thd, or drop --max-tokens-per-rank.")


ON_POLICY_KERNELS = ("none", "triton")      # forward kernels without atomics (docs/rollout.md#true-on-policy)


def _true_on_policy(sel: Selection, host) -> Optional[str]:
    """``true_on_policy`` is exact where the engine and the trainer run the same code on the same shapes on one
    device (the reference model, or the trainer's own miles / megatron module, whose limits
    ``train.config_checks.check_true_on_policy`` applies: this rule does not know ``train_impl``): the CPU in
    fp32 or bf16, an NVIDIA GPU in bf16 (fp32 there is not tested), the reference or triton kernel ops (the
    engine's forward and the trainer's must call the same kernels: triton's only through the trainer's own
    module), weights published as they are, the built-in engine, the local orchestrator, one rank."""
    if not sel.true_on_policy:
        return None
    engine = getattr(sel.rollout, "name", "reference")
    world = sel.world or sel.tp * sel.cp * sel.ep
    dtypes = {"cpu": ("fp32", "bf16"), "nvidia": ("bf16",)}.get(sel.hardware.name)
    for what, bad, fix in (
            (f"--hardware {sel.hardware.name}", dtypes is None, "use --hardware cpu or nvidia"),
            (f"--dtype {sel.dtype} on --hardware {sel.hardware.name}", dtypes is not None and sel.dtype not in dtypes,
             f"use --dtype {' or '.join(dtypes or ())}"),
            (f"--kernel-backend {sel.kernel.name}", sel.kernel.name not in ON_POLICY_KERNELS,
             "use --kernel-backend none or triton"),
            (f"--quant {sel.quant.name} (publishes lossy weights)", sel.quant.name != "bf16", "use --quant bf16"),
            (f"--rollout-engine {engine}", engine != "reference", "use --rollout-engine reference"),
            (f"--orchestrator {sel.orchestrator}", sel.orchestrator != "local", "use --orchestrator local"),
            (f"{world} ranks", world != 1, "train on one rank")):
        if bad:
            return (f"true_on_policy=true is exact only with the built-in engine, the reference or triton kernel "
                    f"ops, one rank, and the CPU (fp32, bf16) or one NVIDIA GPU (bf16), and {what} is not. "
                    f"Fix: {fix}, or drop true_on_policy.")
    return None


RULES = (
    Rule("train-layout", "the run's ranks split into tensor x context x data parallel, expert parallel inside data",
         _train_layout),
    Rule("train-pipeline", "the trainer's pipeline stages run with data, tensor and expert parallelism (no cp), "
         "padded rows; virtual stages (--vpp) cut the layers into --pp x --vpp equal chunks",
         _train_pipeline),
    Rule("train-context-parallel-thd", "the trainer's context parallelism runs the packed (THD) layout", _train_cp_thd),
    Rule("train-cuda-graphs", "the trainer's CUDA graphs run on a GPU, one fixed layout, no collectives inside the "
         "blocks", _train_cuda_graphs, train_option=True),
    Rule("packing-thd", "training with a packing budget runs the packed (THD) layout", _packing_thd),
    Rule("true-on-policy", "true_on_policy=true runs the reference code and kernel ops on the CPU (fp32, bf16) or "
         "one NVIDIA GPU (bf16; triton's kernels through the trainer's own module), one rank, the built-in engine",
         _true_on_policy, train_option=True),
)


@hookimpl
def dsv4_job_rules():
    return list(RULES)
