"""Which kernel moves the rollout engine's log-probabilities: a kernel backend's engine against the reference-op
engine, with all of the backend's ops, with each left out, and with each alone.

    python -m bench.logprob_kernels [--kernel-backend triton] [--device cuda] [--dtype bf16] [--model tiny]
                                    [--samples 10] [--new-tokens 10] [--modes all leave-out alone]
                                    [--ops OP ...] [--out FILE.json]

Why: the engine with a kernel backend should draw the reference-op engine's samples with nearly its
log-probabilities (``tests/kernels/test_decode_step_kernels_gpu.py``); when it strays (once on an H100 at 20
sequences: 0.1219 nats in bf16, where bf16's own rounding moves that case by at most 0.0092, docs/rollout.md),
the question is which of its thirty-odd ops does it, and one GPU call should answer it. Every engine gets the
same weights (``train.model.build_train_model``, seed 0, built once, through ``rollout.weight_sync.sync_weights``),
the same two prompts, ``--samples`` samples each, the same seed; temperature 1, no stop token. A variant's table
(:func:`mixed_table`): the backend's ops in the variant's set, the reference ops for the other required ops, and no
other extra op (its caller runs the torch code, as ``bench.rollout --ablate`` does). Variants: ``all`` (twice: the
second run bounds run-to-run drift; 0 for kernels that sum in a fixed order), ``leave-out`` (every backend op the
full engine ran, one at a time), ``alone`` (each of them on its own), and ``none`` (the reference ops through the
same machinery: 0 by construction, the harness's check). Per variant: the largest log-probability difference over
the comparable positions (:mod:`rollout.sample_compare`: before each sample's first differing token and first
routing flip), where, how many positions compared, how many samples differ or flipped, and which of the backend's
ops the engine ran (``core.kernel_ops.kernels_ran``: an op alone that the engine does not take, such as one of the
MoE's pair kernels without the others, shows as running nothing).

A table is printed and a JSON record (date, machine, code, settings, rows) written to ``--out`` (default
``bench/results/logprob-kernels-<machine>-<backend>-<model>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from bench.rollout import DTYPES, _machine, _ops, _short_machine, model_config
from core.combinations import InvalidCombination
from core.kernel_ops import OP_NAMES, OpTable, kernels_ran, reset_kernels_ran

REPO = Path(__file__).resolve().parent.parent
MODES = ("all", "leave-out", "alone")
PROMPTS = ([0, 5, 6, 7, 8], [0, 9, 10])


def mixed_table(full: OpTable, reference: OpTable, keep: Iterable[str]) -> OpTable:
    """A table of ``full``'s backend holding its ops in ``keep``, ``reference``'s for the other required ops
    (:data:`core.kernel_ops.OP_NAMES`), and none of its other extra ops."""
    keep = set(keep)
    chosen = {n: (full.provider[n], getattr(full, n)) for n in full.names() if n in keep}   # counted as in full
    chosen.update({n: (reference.provider[n], getattr(reference, n)) for n in OP_NAMES if n not in keep})
    inputs = full.indexer_inputs if "indexer_scores" in keep else "compute"   # the kept op's own rule
    return OpTable(full.backend, {}, delegated=chosen, dtypes=full.dtypes, indexer_inputs=inputs)


def _generate(model, config, table, dtype, device, samples: int, new_tokens: int, seed: int):
    """``(generate's output, the table's backend ops that ran)`` of an engine on ``table`` (``None``: the
    reference ops), holding the trainer ``model``'s weights."""
    from rollout.reference_engine import ReferenceEngine, SamplingParams
    from rollout.weight_sync import sync_weights

    engine = ReferenceEngine(config, ops=table, dtype=dtype, device=device, cuda_graphs=False)
    if not sync_weights(model, engine, version=1, engine_dtype=dtype).ok:
        raise RuntimeError("the weight sync into the engine failed")
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=())
    reset_kernels_ran()
    got = engine.generate([list(p) for p in PROMPTS], params, n=samples, seed=seed)
    backend = None if table is None else table.backend
    ran = sorted({k.split(".", 1)[1] for k in kernels_ran() if k.split(".", 1)[0] == backend})
    return got, ran


def attribute(full: OpTable, reference: OpTable, config, dtype, device, *, samples: int = 10,
              new_tokens: int = 10, seed: int = 3, modes: Iterable[str] = MODES,
              ops: Optional[Iterable[str]] = None, on_row=None) -> list:
    """The rows of the module docstring: one dict a variant (``variant``, ``ops_ran``, the
    :func:`rollout.sample_compare.logprob_gap` keys, ``seconds``); ``ops`` limits the leave-out and alone
    variants to those ops; ``on_row(row)`` is called as each is done."""
    from rollout.sample_compare import logprob_gap
    from train.model import build_train_model

    modes, everything = set(modes), set(full.names())
    model = build_train_model(config, seed=0)             # every engine holds its weights
    want, _ = _generate(model, config, None, dtype, device, samples, new_tokens, seed)
    rows = []

    def run(label, keep, against=want):
        t = time.perf_counter()
        got, ran = _generate(model, config, mixed_table(full, reference, keep), dtype, device, samples, new_tokens,
                             seed)
        rows.append(dict(variant=label, ops_ran=ran, **logprob_gap(got, against),
                         seconds=round(time.perf_counter() - t, 2)))
        if on_row:
            on_row(rows[-1])
        return got, ran

    first, served = run("all", everything)
    if "all" in modes:
        run("all again (against all)", everything, against=first)
    wanted = None if ops is None else set(ops)
    picked = [n for n in served if wanted is None or n in wanted]
    if "leave-out" in modes:
        for name in picked:
            run(f"all but {name}", everything - {name})
    if "alone" in modes:
        for name in picked:
            run(f"{name} alone", {name})
    run("none", set())
    return rows


def _print_row(row: dict) -> None:
    at = "" if row["at"] is None else "{}/{}/{}".format(*row["at"])
    print(f"{row['variant']:44s} {row['max']:9.4f} {at:>8s} {row['compared']:4d}/{row['total']:<4d} "
          f"{row['differing']:4d} {row['flipped']:4d} {len(row['ops_ran']):4d} {row['seconds']:7.2f}", flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel-backend", choices=("triton", "tilelang", "cuda"), default="triton")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--model", default="tiny", help="core.config preset, or 'bench' (bench.configs.bench_config)")
    p.add_argument("--samples", type=int, default=10, help="samples of each of the two prompts")
    p.add_argument("--new-tokens", type=int, default=10)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--ops", nargs="+", default=None, help="the leave-out and alone variants' ops (default: all)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    config = model_config(a.model)
    from kernels.reference import backend as reference

    try:
        full = _ops(config, device, a.kernel_backend)
    except InvalidCombination as e:                 # e.g. a GPU backend asked for on the CPU
        p.error(str(e))
    print(f"{a.kernel_backend} against the reference ops: {a.model}, {len(PROMPTS)} prompts x {a.samples} samples, "
          f"{a.new_tokens} new tokens, {a.dtype} on {_machine(device)}")
    print(f"{'variant':44s} {'max nats':>9s} {'at p/s/i':>8s} {'compared':>9s} {'diff':>4s} {'flip':>4s} "
          f"{'ops':>4s} {'s':>7s}")
    rows = attribute(full, reference.ops(), config, dtype, device, samples=a.samples, new_tokens=a.new_tokens,
                     seed=a.seed, modes=a.modes, ops=a.ops, on_row=_print_row)
    from bench.decode_launches import _code

    record = dict(bench="logprob_kernels", date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), machine=_machine(device), code=_code(), kernel_backend=a.kernel_backend,
                  model=a.model, dtype=a.dtype, prompts=[list(q) for q in PROMPTS], samples=a.samples,
                  new_tokens=a.new_tokens, seed=a.seed, rows=rows)
    out = a.out or REPO / "bench" / "results" / (
        f"logprob-kernels-{_short_machine(device)}-{a.kernel_backend}-{a.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
