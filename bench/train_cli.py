"""Benchmark of ``dsv4 train`` itself (issue #17, item 7): tokens/s per GPU, step time, MFU, peak memory and
scaling efficiency of the product's training command, one parallel layout after the other.

``python -m bench.train_cli --model flash-shaped --seq 4096 --layouts miles:1,miles:dp2,miles:ep2,miles:tp2``

Each layout is one run of the real command line, started as a user starts it (no harness around the trainer):

* one rank: ``python -m launchers.dsv4 train --mode sft ...``;
* N ranks: ``python -m torch.distributed.run --standalone --nproc-per-node N -m launchers.dsv4 train ...``, with
  ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1`` (no NVLink multicast).

Layouts are ``IMPL:SPEC``, SPEC ``1`` or ``dpN`` / ``tpN`` / ``cpN`` / ``epN`` joined with ``+``: ``miles:1``,
``miles:dp2`` (data parallel), ``miles:ep2`` (experts split over the data-parallel ranks), ``miles:tp2``,
``miles:cp2`` (THD), ``megatron:cp2``. Ranks = dp x tp x cp, and dp defaults to ep (``dsv4 train``'s rule:
expert parallelism runs inside data parallelism). Whether a layout is allowed is for the command to say: a
refused or failed run is a row with its error, and the other layouts still run.

Model (``--model``): ``tiny``, the embedded checkpoint, which ``dsv4 train`` writes itself; another preset,
which ``dsv4 train`` refuses without a checkpoint, so ``dsv4 prepare --preset NAME --out
DSV4_CACHE/NAME-bf16-seed0`` writes one first (a safe stage: a rerun skips it); or a checkpoint folder.
Data: SFT pairs written to the layout's folder (``data.jsonl``, beside its run folder: ``dsv4 train`` refuses
data inside ``--run-dir``). Each pair is exactly ``--seq`` tokens under the checkpoint's byte tokenizer
(``[bos] + prompt bytes + response bytes + [eos]``; a quarter of it is prompt). Every data-parallel rank
trains ``--batch`` sequences per step (``batch_size=dp x batch``): tp and cp layouts split each sequence over
their ranks. ``--batch N`` (default 8): N sequences per data-parallel rank per step, in micro-batches of
``--micro-batch M`` (default 2: ``micro_batch_size=M``, gradients accumulated), so the optimizer's and the
step's fixed costs are shared by N forward/backward passes, as in a real run's global batch (hundreds of
sequences); ``--batch 1`` is the one-sequence step, dominated by those fixed costs. Two sequences of 4,096
tokens were the flash-shaped preset's largest micro-batch that one H200 held when measured
(docs/kernels-and-benchmarks.md#dsv4-train-per-layout). ``--set KEY=VALUE`` passes more training options
(e.g. ``recompute=full`` for long sequences). Settings: bf16 and triton kernels on nvidia, fp32 and the
reference kernels on the CPU;
eager (``--compile`` passes ``dsv4 train --compile``); ``export_at_end=false``, and no checkpoint
(``save_at_end=false``, ``save_every`` past the run): the final checkpoint of the flash-shaped preset (model
plus fp32 optimizer state) is about 80 GB, more than a one-GPU machine's disk may hold.

Step budget (``--profile N``): ``dsv4 train`` runs N more steps after the timed ones under ``torch.profiler``
(``profile_steps=N``, :mod:`reporting.profiling`); the row's ``budget`` is ``RUN_DIR/profile/budget.json``: GPU time
per category (forward, backward, optimizer), kernels and host synchronisations per step, host gaps. The profiled
steps are not timed.

Measured from ``RUN_DIR/metrics.jsonl`` (rank 0's rows): ``dsv4 train --steps STEPS`` runs STEPS steps, and the
first ``--warmup`` of them are left out. Step time is the mean ``time_step``. tokens/s is the sum of ``tokens``
(all ranks) over the sum of ``time_step``; per GPU, that divided by ``world_size``. MFU is
``bench.flops.step_flops`` of the step's sequences / step time / (GPUs x ``H200_BF16_DENSE_TFLOPS``);
None on the CPU. Peak memory is the rows' ``peak_memory_gib`` (rank 0's CUDA allocator peak; None on the
CPU). Scaling efficiency of a multi-rank layout is its tokens/s per GPU / the 1-GPU row's (the same
implementation's when there is one); 1.0 is linear scaling.

Reference: on nvidia, after the layouts and unless ``--no-reference``, ``bench.reference_step.time_step`` times
transformers' eager DeepseekV4 step (random bf16 weights, fused AdamW) on one GPU, for the same model config
and sequence length, ``--warmup`` steps then the rest of ``--steps``. On the CPU it is skipped (that step needs
CUDA), and the JSON says so. The bench prints a rich table, and writes a JSON object (date, machine, torch
version, command line, settings, rows, reference) to ``--out`` after every layout. ``--append`` adds to, or
replaces rows of, an earlier ``--out`` with the same settings, so a long list of layouts can run as several
commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from bench.configs import config_summary
from bench.flops import H200_BF16_DENSE_TFLOPS, active_params, step_flops

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LAYOUTS = "miles:1,miles:dp2,miles:ep2,miles:tp2,miles:cp2,megatron:cp2"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IMPLS = ("miles", "megatron")
DATA_EXAMPLES = 64
PROMPT_SHARE = 4          # a quarter of every sequence is prompt
WORDS = ("the model trains on long sequences of text while every rank holds its share of the experts and "
         "the optimizer state and the loss falls step after step").split()


def parse_layout(text: str) -> dict:
    """``miles:1`` / ``miles:dp2`` / ``megatron:cp2`` / ``miles:dp2+ep2`` -> ``{name, impl, dp, tp, cp, ep, world}``."""
    impl, sep, spec = text.strip().partition(":")
    if not sep or impl not in IMPLS:
        raise ValueError(f"layout {text!r}: expected IMPL:SPEC with IMPL one of {', '.join(IMPLS)} (e.g. miles:dp2)")
    sizes = {"dp": 0, "tp": 1, "cp": 1, "ep": 1}
    if spec != "1":
        for part in spec.split("+"):
            kind, n = part[:2], part[2:]
            if kind not in sizes or not n.isdigit() or int(n) < 1:
                raise ValueError(f"layout {text!r}: expected SPEC 1, or dpN, tpN, cpN, epN joined with +")
            sizes[kind] = int(n)
    dp = sizes["dp"] or sizes["ep"]
    if dp % sizes["ep"]:
        raise ValueError(f"layout {text!r}: ep {sizes['ep']} must divide dp {dp} (expert parallelism runs inside "
                         f"data parallelism)")
    return {"name": text.strip(), "impl": impl, "dp": dp, "tp": sizes["tp"], "cp": sizes["cp"], "ep": sizes["ep"],
            "world": dp * sizes["tp"] * sizes["cp"]}


def subprocess_env() -> dict:
    """This process's environment, its import path (so the commands import this checkout), no NVLink multicast."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(ROOT)] + [p for p in sys.path if p]))
    env.update(NO_MULTICAST)
    return env


def resolve_model(model: str, env: dict) -> tuple[str, object]:
    """``(the value of dsv4 train --model, its ModelConfig)``; a preset other than the embedded one is first
    written with ``dsv4 prepare`` into the cache (``DSV4_CACHE``)."""
    from launchers import stages

    source = stages.model_config(model)        # a checkpoint folder or a preset; anything else is refused
    if source.checkpoint is not None:
        return str(Path(source.checkpoint).resolve()), source.config
    if model == stages.DEFAULT_MODEL:          # dsv4 train materializes the embedded checkpoint itself
        return model, source.config
    out = stages.cache_dir() / f"{model}-bf16-seed0"
    cmd = [sys.executable, "-m", "launchers.dsv4", "prepare", "--preset", model, "--out", str(out)]
    print(f"$ {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return str(out), stages.checkpoint_config(out)


def _text(rng: random.Random, n: int) -> str:
    """``n`` ASCII characters of words (one byte token each)."""
    out = ""
    while len(out) < n:
        out += rng.choice(WORDS) + " "
    return out[:n]


def write_sft_data(path: Path, seq: int, model: str, vocab_size: int, n: int = DATA_EXAMPLES, seed: int = 0) -> Path:
    """``n`` SFT pairs of exactly ``seq`` tokens each under the run's tokenizer (``train.data``)."""
    from train import data as D

    if seq < 4:
        raise ValueError(f"--seq {seq}: a sequence needs at least 4 tokens (bos, prompt, response, eos)")
    tok = D.tokenizer_for(model, vocab_size)
    rng = random.Random(seed)
    prompt_len = max(1, (seq - 2) // PROMPT_SHARE)
    lines = []
    for _ in range(n):
        prompt, response = _text(rng, prompt_len), _text(rng, seq - 2 - prompt_len)
        got = len(D.encode_prompt(tok, prompt)) + len(D.encode_response(tok, response))
        if got != seq:
            raise ValueError(f"the tokenizer of {model} maps the synthetic text to {got} tokens, not {seq}")
        lines.append(json.dumps({"prompt": prompt, "response": response}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def train_command(layout: dict, *, model: str, data: Path, run_dir: Path, steps: int, hardware: str,
                  compile_blocks: bool = False, profile: int = 0, batch: int = 1, micro_batch: int = 1,
                  options=()) -> list:
    """The ``dsv4 train`` command line of one layout (torch.distributed.run for more than one rank)."""
    args = ["-m", "launchers.dsv4", "train", "--mode", "sft", "--hardware", hardware, "--impl", layout["impl"],
            "--kernel-backend", "triton" if hardware == "nvidia" else "none", "--model", model,
            "--data", str(data), "--steps", str(steps), "--run-dir", str(run_dir), "-q"]
    for kind in ("tp", "cp", "ep"):
        if layout[kind] > 1:
            args += [f"--{kind}", str(layout[kind])]
    if layout["cp"] > 1 and layout["impl"] == "miles":
        args += ["--qkv-format", "thd"]            # context parallelism runs on packed (THD) streams
    if compile_blocks:
        args.append("--compile")
    args += [f"batch_size={layout['dp'] * batch}", f"save_every={1 << 30}", "save_at_end=false",
             "export_at_end=false", *([f"micro_batch_size={micro_batch}"] if batch > 1 else []), *options]
    if profile:                                   # the last `profile` steps run under torch.profiler
        args[args.index("--steps") + 1] = str(steps + profile)
        args.append(f"profile_steps={profile}")
    if layout["world"] == 1:
        return [sys.executable] + args
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(layout["world"])] + args


def summarize(rows: list, warmup: int, last: Optional[int] = None) -> dict:
    """Step time, tokens/s and peak memory of the metrics rows after the warm-up steps (and up to step ``last``:
    profiled steps after it are not timed)."""
    timed = [r for r in rows if int(r["step"]) > warmup and (last is None or int(r["step"]) <= last)]
    if not timed:
        raise RuntimeError(f"metrics.jsonl holds {len(rows)} steps: none after the {warmup} warm-up steps")
    seconds = sum(float(r["time_step"]) for r in timed)
    tokens = sum(int(r["tokens"]) for r in timed)
    world = int(timed[-1]["world_size"])
    peaks = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    return {"timed_steps": len(timed), "world_size": world, "tokens_per_step": tokens // len(timed),
            "step_ms": 1e3 * seconds / len(timed), "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_gpu": tokens / seconds / world,
            "time_train_ms": 1e3 * sum(float(r["time_train"]) for r in timed) / len(timed),
            "peak_mem_gib": max(peaks) if peaks else None,
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


_RANK = r"^(\[(default)?rank\d+\]:\s*)?"              # torchrun's prefix of a rank's lines
_CLI_ERROR_LINE = re.compile(_RANK + r"error:")
_EXCEPTION_LINE = re.compile(_RANK + r"[\w.]*(Error|Exception|Interrupt)\b")


def _error_line(log: str) -> str:
    """The line of a failed run's log that says why: the CLI's last ``error:`` line, else the last exception
    (not torchrun's ``ChildFailedError``, which only says a rank failed), else torchrun's ``exitcode`` line (a
    rank killed by a signal raises nothing), else the last line with a word in it (torchrun ends on a rule of
    ``=`` signs)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for wanted in (_CLI_ERROR_LINE.match,
                   lambda ln: _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln,
                   lambda ln: ln.startswith("exitcode"),
                   lambda ln: any(c.isalnum() for c in ln)):
        hits = [ln for ln in lines if wanted(ln)]
        if hits:
            return hits[-1]
    return "no output"


def run_layout(layout: dict, *, folder: Path, model: str, config, seq: int, steps: int, warmup: int,
               hardware: str, env: dict, compile_blocks: bool = False, profile: int = 0, batch: int = 1,
               micro_batch: int = 1, options=()) -> dict:
    """Run ``dsv4 train`` for one layout in ``folder`` (data.jsonl, run/, dsv4.log) and read its metrics."""
    from reporting.metrics import read_metrics

    row = {"layout": layout["name"], "impl": layout["impl"], "dp": layout["dp"], "tp": layout["tp"],
           "cp": layout["cp"], "ep": layout["ep"], "gpus": layout["world"], "seq": seq,
           "sequences_per_step": layout["dp"] * batch, "steps": steps, "warmup_steps": warmup}
    if hardware == "nvidia" and layout["world"] > torch.cuda.device_count():
        row["error"] = f"{layout['name']} needs {layout['world']} GPUs; {torch.cuda.device_count()} visible"
        return row
    if folder.exists():
        shutil.rmtree(folder)                   # dsv4 train refuses a run folder that holds a run
    folder.mkdir(parents=True)
    data = write_sft_data(folder / "data.jsonl", seq, model, config.vocab_size)
    run_dir = folder / "run"
    cmd = train_command(layout, model=model, data=data, run_dir=run_dir, steps=steps, hardware=hardware,
                        compile_blocks=compile_blocks, profile=profile, batch=batch, micro_batch=micro_batch,
                        options=options)
    row["train_command"] = shlex.join(["python"] + cmd[1:])     # as a user types it (the interpreter: sys.executable)
    row["run_dir"] = str(run_dir)
    print(f"$ {row['train_command']}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    row["wall_s"] = time.perf_counter() - t0   # start, load, steps, final checkpoint
    row["returncode"] = proc.returncode
    (folder / "dsv4.log").write_text(proc.stdout)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if proc.returncode != 0:
        row["error"] = _error_line(proc.stdout)
        row["log_tail"] = proc.stdout[-3000:]
        return row
    row.update(summarize(read_metrics(run_dir), warmup, last=steps))
    if profile:
        from reporting.profiling import read_budget

        row["budget"] = read_budget(run_dir)
    fl = step_flops(config, seq, layout["dp"] * batch, active_params(config))["total"]
    row["flops_per_step"] = fl
    step_s = row["step_ms"] / 1e3
    row["mfu"] = fl / step_s / (layout["world"] * H200_BF16_DENSE_TFLOPS * 1e12) if hardware == "nvidia" else None
    return row


def reference_row(config, seq: int, warmup: int, timed: int) -> dict:
    """The reference row: transformers' eager step on one GPU (:func:`bench.reference_step.time_step`), with
    the same FLOPs count as the layouts' rows; a failure is the row's error."""
    from bench.reference_step import time_step

    row = {"layout": "transformers (reference)", "impl": "transformers", "gpus": 1, "seq": seq,
           "sequences_per_step": 1, "steps": warmup + timed, "warmup_steps": warmup,
           "source": "bench.reference_step.time_step: eager attention, random bf16 weights, fused AdamW"}
    try:
        r = time_step(config, seq, warmup, timed)
    except Exception as e:  # record it and keep the layouts' results
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    step_s = r["step_ms"] / 1e3
    fl = step_flops(config, seq, 1, active_params(config))["total"]
    row.update(step_ms=r["step_ms"], tokens_per_s=seq / step_s, tokens_per_s_per_gpu=seq / step_s,
               mfu=fl / step_s / (H200_BF16_DENSE_TFLOPS * 1e12), flops_per_step=fl, peak_mem_gib=r["peak_mem_gb"],
               timed_steps=r["timed_steps"], loss_first=r["loss_first"], loss_last=r["loss_last"], note=r["note"])
    return row


def add_comparisons(rows: list, reference: Optional[dict]) -> None:
    """Scaling efficiency of every multi-rank row against a 1-GPU row (the same implementation's if there is
    one), and tokens/s per GPU against the reference step's."""
    ones = [r for r in rows if r["gpus"] == 1 and r.get("tokens_per_s")]
    ref = reference.get("tokens_per_s") if reference else None
    for r in rows:
        r["scaling_efficiency"] = r["scaling_baseline"] = None
        base = next((o for o in ones if o["impl"] == r["impl"]), ones[0] if ones else None)
        if r["gpus"] > 1 and base is not None and r.get("tokens_per_s"):
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            r["scaling_baseline"] = base["layout"]
        r["per_gpu_vs_reference"] = r["tokens_per_s_per_gpu"] / ref if ref and r.get("tokens_per_s") else None


def machine(hardware: str) -> str:
    if hardware == "nvidia" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def print_table(rows: list, reference: Optional[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def num(v, fmt):
        return "-" if v is None else fmt.format(v)

    table = Table(title=title)
    for col in ("layout", "GPUs", "tokens/s", "tokens/s/GPU", "step ms", "MFU", "peak GiB", "scaling",
                "per GPU vs transformers"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows + ([reference] if reference else []):
        if r.get("tokens_per_s"):
            table.add_row(r["layout"], str(r["gpus"]), f"{r['tokens_per_s']:,.0f}",
                          f"{r['tokens_per_s_per_gpu']:,.0f}",
                          f"{r['step_ms']:,.1f}", num(r.get("mfu"), "{:.2%}"), num(r.get("peak_mem_gib"), "{:.1f}"),
                          num(r.get("scaling_efficiency"), "{:.2f}"), num(r.get("per_gpu_vs_reference"), "{:.2f}x"))
        else:
            table.add_row(r["layout"], str(r["gpus"]), "FAILED" if r.get("error") else "skipped", *["-"] * 6)
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(table)
    for r in rows + ([reference] if reference else []):
        if not r.get("tokens_per_s"):
            console.print(f"{r['layout']}: {r.get('error') or r.get('skipped') or ''}", markup=False)


def _out_path(out: str) -> Path:
    """``--out`` relative to the directory the command ran from (``bazel run`` too)."""
    return Path(os.environ.get("BUILD_WORKING_DIRECTORY", ".")) / out


def _previous(out: Path, settings: dict) -> dict:
    """The earlier result ``--append`` adds to (checked to have the same settings)."""
    if not out.is_file():
        return {}
    old = json.loads(out.read_text())
    diff = [f"{k}: {old.get('settings', {}).get(k)!r} there, {v!r} here" for k, v in settings.items()
            if old.get("settings", {}).get(k) != v]
    if diff:
        raise SystemExit(f"error: --append: {out} was measured with other settings ({'; '.join(diff)}); "
                         f"use another --out")
    return old


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (its defaults are what a user runs)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                    help="comma list of IMPL:SPEC, SPEC 1 or dpN/tpN/cpN/epN joined with + (e.g. miles:1,miles:ep2)")
    ap.add_argument("--model", default="flash-shaped", help="a preset (tiny, flash-shaped, ...) or a checkpoint folder")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="dsv4 train --steps: steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of the averages")
    ap.add_argument("--hardware", choices=("nvidia", "cpu"), default="nvidia",
                    help="cpu: gloo ranks, reference kernels, fp32 (a smoke run; no MFU, no reference step)")
    ap.add_argument("--compile", action="store_true", help="pass dsv4 train --compile (torch.compile'd blocks)")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers' reference step")
    ap.add_argument("--batch", type=int, default=8, metavar="N",
                    help="sequences per data-parallel rank per step (gradients accumulated over its micro-batches)")
    ap.add_argument("--micro-batch", type=int, default=2, metavar="M",
                    help="sequences per micro-batch (dsv4 train micro_batch_size); must divide --batch")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dsv4 train option for every layout (e.g. recompute=full); repeatable")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, N more steps under torch.profiler (dsv4 train profile_steps=N): "
                         "each row gets the step's budget (GPU time per category, kernels and host syncs per step)")
    ap.add_argument("--work-dir", default=None,
                    help="folder of the runs: LAYOUT/data.jsonl, LAYOUT/run/ (checkpoints deleted), LAYOUT/dsv4.log, "
                         "each LAYOUT folder replaced when run again; default: a temporary folder, removed at the end")
    ap.add_argument("--out", default=None,
                    help="JSON file (default: bench/results/train-cli-HARDWARE-MODEL-seqSEQ.json)")
    ap.add_argument("--append", action="store_true",
                    help="add to --out's rows (same settings), replacing those of the layouts run again")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    if args.batch < 1:
        ap.error(f"--batch {args.batch}: at least one sequence per step")
    args.micro_batch = min(args.micro_batch, args.batch)
    if args.micro_batch < 1 or args.batch % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} must be at least 1 and divide --batch {args.batch}")
    if any("=" not in o for o in args.set):
        ap.error("--set takes KEY=VALUE (a dsv4 train option)")
    if args.steps <= args.warmup or args.warmup < 0:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the timed steps are the rest")
    try:
        layouts = [parse_layout(s) for s in args.layouts.split(",") if s.strip()]
    except ValueError as e:
        ap.error(str(e))
    env = subprocess_env()
    gpu = args.hardware == "nvidia"
    try:
        model, config = resolve_model(args.model, env)
    except (ValueError, subprocess.CalledProcessError) as e:    # an unknown --model, a failed dsv4 prepare
        ap.error(str(e))
    name = Path(args.model).name if Path(args.model).is_dir() else args.model
    out = _out_path(args.out or f"bench/results/train-cli-{args.hardware}-{name}-seq{args.seq}.json")
    settings = {"model": args.model, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
                "profile": args.profile, "batch": args.batch, "micro_batch": args.micro_batch,
                "options": args.set,
                "hardware": args.hardware, "compile": args.compile, "kernel_backend": "triton" if gpu else "none",
                "dtype": "bf16" if gpu else "fp32", "machine": machine(args.hardware)}
    old = _previous(out, settings) if args.append else {}
    command = "python -m bench.train_cli " + shlex.join(argv)
    result = {"benchmark": "bench.train_cli (dsv4 train, SFT)", "date": None, "machine": settings["machine"],
              "torch": torch.__version__, "python": platform.python_version(), "command": command,
              "commands": old.get("commands", []) + [command], "settings": settings,
              "config": {**config_summary(config, args.seq, 1), "dtype": settings["dtype"],
                         "batch": f"{args.batch} sequence(s) per data-parallel rank, micro-batches of "
                                  f"{args.micro_batch}"}, "active_params": active_params(config),
              "peak_tflops_per_gpu": H200_BF16_DENSE_TFLOPS if gpu else None,
              "rows": [r for r in old.get("rows", []) if r["layout"] not in {l["name"] for l in layouts}],
              "reference": old.get("reference")}
    work = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="dsv4-bench-train-"))

    def save():
        add_comparisons(result["rows"], result["reference"])
        result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")   # after every layout: nothing lost on a crash

    try:
        for layout in layouts:
            slug = layout["name"].replace(":", "-").replace("+", "-")
            try:
                row = run_layout(layout, folder=work / slug, model=model, config=config, seq=args.seq,
                                 steps=args.steps, warmup=args.warmup, hardware=args.hardware, env=env,
                                 compile_blocks=args.compile, profile=args.profile, batch=args.batch,
                                 micro_batch=args.micro_batch, options=args.set)
            except Exception as e:  # record it and keep the others
                row = {"layout": layout["name"], "impl": layout["impl"], "gpus": layout["world"],
                       "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            row["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "traceback")}), flush=True)
            save()
        if not gpu:
            result["reference"] = {"layout": "transformers (reference)", "gpus": 1,
                                   "skipped": "bench.reference_step's transformers step needs CUDA (CPU run)"}
        elif not args.no_reference:
            result["reference"] = reference_row(config, args.seq, args.warmup, args.steps - args.warmup)
        save()
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(result["rows"], result["reference"],
                f"dsv4 train (SFT), {args.model}, {args.seq} tokens per sequence, {result['machine']}")
    for r in result["rows"]:
        if r.get("budget"):
            from reporting.profiling import format_budget

            print(f"\nstep budget of {r['layout']} ({r['budget']['profiled_steps']} profiled steps):")
            print("\n".join(format_budget(r["budget"], top=40)))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
