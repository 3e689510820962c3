"""Benchmark of a GRPO step of ``dsv4 train`` itself (issue #32): where a step's time goes, phase by phase, for each
way the weights reach the rollout engine.

``python -m bench.grpo --model flash-shaped --hardware nvidia --prompts 8 --group 8 --new-tokens 128``

Each ``--weight-sync`` mode (default ``copy,shared``) is one run of the real command line, as a user starts it::

    python -m launchers.dsv4 train --mode grpo --hardware H --impl I --model M --steps S weight_sync=MODE ...

and the rows are read from its ``RUN_DIR/metrics.jsonl`` after ``--warmup`` steps: the mean of each phase
(``time_update_weights``, ``time_rollout``, ``time_logprobs``, ``time_train``) and of ``time_step``, the
rollout's generated tokens per second, the seconds from the command's start to the end of its first step
(``first_step_s``), the bytes the sync copied (``weight_sync_bytes``) and read in place (``weight_sync_shared_bytes``), the train/rollout log-prob
difference. The weight sync's hardware limit is printed beside it: the bytes it copies at the device's memory
bandwidth (read and write: 2 x bytes / bandwidth; H200: 4.8e12 B/s). On a GPU two shares of the hardware's
pace: the rollout's share of the weight-read roofline (``max_new_tokens`` decode steps, each reading the
weights a batch of ``prompts x group`` rows touches (:func:`decode_weight_bytes`), at the bandwidth, over the
rollout phase's time; prefill, sampling and the KV cache's reads are inside that time and not in the bound,
so the share is a lower bound of the decode step's; ``generate_roofline_share``: over the engine's ``generate``
call alone, ``time_rollout_wait``, the phase less its rewards, group tensors and hand-over;
``decode_roofline_share``: the engine's decode steps alone (``time_rollout_decode``, device time from the engine's
:class:`rollout.phase_clock.PhaseClock`, without the prefill, the slots' set-up and the rewards), each bound by
the weights its mean rows a step touch; ``decode_roofline_share_with_kv``, issue #32's own measure: the bound
also holds the cache bytes those steps read, ``rollout_decode_kv_bytes`` of metrics.jsonl, the engine's count)
and the train phase's MFU from dense FLOPs only (6 x active parameters x the step's trained tokens, ``tokens`` of
metrics.jsonl, over ``time_train`` and the H200's 989 TFLOP/s; the attention's FLOPs are not counted, so it is a
lower bound). The built-in task's prompts (``data``
unset); ``--model`` as in :mod:`bench.train_cli` (the embedded tiny checkpoint, a preset written by ``dsv4
prepare`` first, or a checkpoint folder); ``--sft-steps N`` first trains it N SFT steps on the task (the
record's ``sft``) and runs the GRPO rows from that export. bf16 and triton kernels on nvidia, fp32 and the reference kernels on
the CPU; no checkpoint, no export. A JSON object (date, machine, torch version, settings, rows) goes to
``--out`` and a rich table to the terminal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench.flops import H200_BF16_DENSE_TFLOPS, active_params
from bench.train_cli import ROOT, _error_line, machine, resolve_model, subprocess_env

H200_HBM_BYTES_PER_S = 4.8e12
PHASES = ("time_update_weights", "time_rollout", "time_logprobs", "time_train")


def grpo_command(mode: str, *, impl: str, model: str, run_dir: Path, steps: int, hardware: str, prompts: int,
                 group: int, new_tokens: int, options=()) -> list:
    """The ``dsv4 train --mode grpo`` command line of one weight-sync mode."""
    return [*train_command("grpo", impl=impl, model=model, run_dir=run_dir, steps=steps, hardware=hardware),
            f"weight_sync={mode}", f"prompts_per_step={prompts}", f"group_size={group}",
            f"max_new_tokens={new_tokens}", f"save_every={1 << 30}", "save_at_end=false", "export_at_end=false",
            *options]


def train_command(mode: str, *, impl: str, model: str, run_dir: Path, steps: int, hardware: str) -> list:
    """``dsv4 train --mode MODE`` as the benches run it (bf16 triton kernels on nvidia, the reference ones on the
    CPU), up to its ``-q`` settings."""
    return [sys.executable, "-m", "launchers.dsv4", "train", "--mode", mode, "--hardware", hardware,
            "--impl", impl, "--kernel-backend", "triton" if hardware == "nvidia" else "none", "--model", model,
            "--steps", str(steps), "--run-dir", str(run_dir), "-q"]


def sft_command(*, impl: str, model: str, run_dir: Path, steps: int, hardware: str) -> list:
    """``--sft-steps``: the ``dsv4 train --mode sft`` command line that trains ``model`` on the built-in task's
    responses and exports the result (``RUN_DIR/hf``), the model the GRPO rows then start from."""
    return [*train_command("sft", impl=impl, model=model, run_dir=run_dir, steps=steps, hardware=hardware),
            f"save_every={1 << 30}", "save_at_end=false", "export_at_end=true"]


def sft_first(*, folder: Path, env: dict, **kw) -> dict:
    """Run :func:`sft_command` in ``folder`` (run/, dsv4.log): ``{command, wall_s, loss_first, loss_last,
    export}``, or ``{command, error}``. Why: a model fresh from ``dsv4 prepare`` predicts nearly uniformly
    (entropy near log V), the worst case for the train/rollout log-prob difference; a few SFT steps on the task
    give the distributions a trained model has, so the difference is measured where RL runs."""
    from reporting.metrics import read_metrics

    out = run_logged(sft_command(run_dir=folder / "run", **kw), folder=folder, env=env, key="command")
    if "error" in out:
        return out
    losses = [float(r["loss"]) for r in read_metrics(folder / "run") if "loss" in r]
    return dict(out, loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                export=str(folder / "run" / "hf"))


def summarize(rows: list, warmup: int) -> dict:
    """Mean phase times (ms), bytes and log-prob difference of the rows after the warm-up steps, and each step's
    own times (``per_step``)."""
    timed = [r for r in rows if int(r["step"]) > warmup]
    if not timed:
        raise RuntimeError(f"metrics.jsonl holds {len(rows)} steps: none after the {warmup} warm-up steps")

    def mean(key):
        return sum(float(r.get(key) or 0.0) for r in timed) / len(timed)

    out = {"timed_steps": len(timed), "step_ms": 1e3 * mean("time_step")}
    # every step's own times, the warm-up's too: a mean hides one slow step (a compile inside the timed steps)
    out["per_step"] = [{"step": int(r["step"]), "step_ms": 1e3 * float(r.get("time_step") or 0.0),
                        "rollout_ms": 1e3 * float(r.get("time_rollout") or 0.0),
                        "generate_ms": 1e3 * float(r.get("time_rollout_wait") or 0.0),
                        "decode_ms": _ms(r.get("time_rollout_decode")),
                        "train_ms": 1e3 * float(r.get("time_train") or 0.0),
                        "micro_batches": r.get("micro_batches"), "triton_compiles": r.get("triton_compiles")}
                       for r in rows]
    out.update({f"{k[len('time_'):]}_ms": 1e3 * mean(k) for k in PHASES})
    # the engine's generate call alone (metrics' time_rollout_wait): the rollout phase less the rewards, the
    # groups' tensors and the hand-over to the trainer ranks
    out["generate_ms"] = 1e3 * mean("time_rollout_wait")
    # inside it, the engine's phases (the built-in cached engine's, device time on a GPU): the decode steps alone
    if all(r.get("time_rollout_decode") is not None for r in timed):
        out.update(setup_ms=1e3 * mean("time_rollout_setup"), prefill_ms=1e3 * mean("time_rollout_prefill"),
                   decode_ms=1e3 * mean("time_rollout_decode"), decode_steps=mean("rollout_decode_steps"),
                   decode_rows=mean("rollout_decode_rows"))
        if all(r.get("rollout_decode_kv_bytes") is not None for r in timed):
            out["decode_kv_bytes"] = mean("rollout_decode_kv_bytes")
    out.update(sync_bytes=int(mean("weight_sync_bytes")), shared_bytes=int(mean("weight_sync_shared_bytes")),
               logprob_abs_diff=mean("train_rollout_logprob_abs_diff"), reward_mean=mean("reward_mean"),
               rollout_entropy=mean("rollout_entropy"))
    rollout_s = mean("time_rollout")
    out["rollout_tokens_per_s"] = mean("response_tokens") / rollout_s if rollout_s > 0 else None
    out["train_tokens"] = mean("tokens")
    peaks = [float(r["train_peak_memory_gib"]) for r in timed if r.get("train_peak_memory_gib") is not None]
    retries = [int(r["cuda_alloc_retries"]) for r in rows if r.get("cuda_alloc_retries") is not None]
    if peaks:                      # a GPU run: the trainer's peak, and the allocator's retries over the whole run
        out.update(train_peak_gib=max(peaks), alloc_retries=max(retries) if retries else None)
    return out


def _ms(seconds) -> Optional[float]:
    return None if seconds is None else 1e3 * float(seconds)


def decode_weight_bytes(config, batch: int, dtype_bytes: int = 2) -> float:
    """Bytes of weights one decode step of ``batch`` rows reads at least (``core.memory.rank_tensors``, one rank):
    every tensor of the trunk once, the routed experts' at the expected share a batch touches,
    ``1 - (1 - k/E)^batch`` (``k`` of ``E`` picked per row), the embedding and hash tables' rows of the batch;
    the MTP block is not run. fp32-kept tensors count 4 bytes, the others ``dtype_bytes``."""
    from core.memory import rank_tensors

    k, E = config.n_activated_experts, config.n_routed_experts
    touched = 1.0 - (1.0 - k / E) ** batch
    total = 0.0
    for name, (n, kind, _trainable, routed) in rank_tensors(config).items():
        if name.startswith("mtp."):
            continue
        size = 8 if kind == "int64" else (4 if kind == "fp32" else dtype_bytes)
        if name.endswith("word_embeddings.weight") or name.endswith("tid2eid"):    # one row per vocabulary id
            n = min(n, batch * (n // config.vocab_size))
        total += n * size * (touched if routed else 1.0)
    return total


def hardware_shares(row: dict, config, *, batch: int, new_tokens: int) -> dict:
    """The rollout's share of the weight-read roofline and the train phase's dense-FLOP MFU (module docstring)."""
    bound_s = new_tokens * decode_weight_bytes(config, batch) / H200_HBM_BYTES_PER_S
    rollout_s, train_s = row["rollout_ms"] / 1e3, row["train_ms"] / 1e3
    flops = 6 * active_params(config) * row["train_tokens"]
    generate_s = row.get("generate_ms", 0.0) / 1e3
    decode = {}
    if row.get("decode_ms") and row.get("decode_steps"):
        # the decode steps the engine ran, each reading the weights of its mean rows a step (issue #32's measure)
        rows_a_step = max(1, round(row["decode_rows"] / row["decode_steps"]))
        decode_bound_s = row["decode_steps"] * decode_weight_bytes(config, rows_a_step) / H200_HBM_BYTES_PER_S
        decode = dict(decode_roofline_ms=1e3 * decode_bound_s,
                      decode_step_ms=row["decode_ms"] / row["decode_steps"],
                      decode_roofline_share=decode_bound_s / (row["decode_ms"] / 1e3))
        if row.get("decode_kv_bytes") is not None:     # and the cache rows they read: the issue's own measure
            with_kv_s = decode_bound_s + row["decode_kv_bytes"] / H200_HBM_BYTES_PER_S
            decode.update(decode_roofline_ms_with_kv=1e3 * with_kv_s,
                          decode_roofline_share_with_kv=with_kv_s / (row["decode_ms"] / 1e3))
    return dict(rollout_roofline_ms=1e3 * bound_s,
                rollout_roofline_share=bound_s / rollout_s if rollout_s > 0 else None,
                generate_roofline_share=bound_s / generate_s if generate_s > 0 else None,
                **decode,
                train_dense_flops=flops,
                train_mfu_dense=flops / train_s / (H200_BF16_DENSE_TFLOPS * 1e12) if train_s > 0 else None)


def first_step_seconds(rows: list, started: float) -> Optional[float]:
    """Seconds from the command's start (epoch ``started``) to the end of its first step (the row's
    ``wall_time``): start-up, model build and load, the first step's compiles."""
    first = min(rows, key=lambda r: int(r["step"]), default=None)
    return float(first["wall_time"]) - started if first and first.get("wall_time") else None


def run_logged(cmd: list, *, folder: Path, env: dict, key: str) -> dict:
    """Run ``dsv4 train`` command ``cmd`` in a fresh ``folder`` (dsv4 train refuses a run folder that holds a run),
    its output in ``folder/dsv4.log``: ``{key: the command line, wall_s}``, plus ``error`` and ``log_tail`` when it
    failed."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    out = {key: shlex.join(["python"] + cmd[1:])}
    print(f"$ {out[key]}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out["wall_s"] = time.perf_counter() - t0
    (folder / "dsv4.log").write_text(proc.stdout)
    if proc.returncode != 0:
        out.update(error=_error_line(proc.stdout), log_tail=proc.stdout[-3000:])
    return out


def run_mode(mode: str, *, folder: Path, env: dict, warmup: int, hardware: str, config=None, **kw) -> dict:
    """One ``dsv4 train --mode grpo`` run in ``folder`` (run/, dsv4.log) and its summary row."""
    from reporting.metrics import read_metrics

    started = time.time()
    row = {"weight_sync": mode, **run_logged(grpo_command(mode, run_dir=folder / "run", hardware=hardware, **kw),
                                             folder=folder, env=env, key="train_command")}
    if "error" in row:
        return row
    metrics = read_metrics(folder / "run")
    row.update(summarize(metrics, warmup), first_step_s=first_step_seconds(metrics, started))
    if hardware == "nvidia":
        row["sync_limit_ms"] = 1e3 * 2 * row["sync_bytes"] / H200_HBM_BYTES_PER_S
        row.update(hardware_shares(row, config, batch=kw["prompts"] * kw["group"], new_tokens=kw["new_tokens"]))
    return row


def print_table(rows: list, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("weight sync", "step ms", "sync ms", "rollout ms", "generate ms", "rollout tok/s", "roofline",
                "generate roofline", "decode step ms", "decode roofline", "with KV", "logprobs ms",
                "train ms", "train MFU", "copied MB", "shared MB", "|lp diff|", "entropy", "first step s"):
        table.add_column(col, justify="left" if col == "weight sync" else "right")
    failed = []
    for r in rows:
        if "error" in r:              # the message under the table: in a cell it wrapped into a column of words
            failed.append(r)
            table.add_row(r["weight_sync"], "[red]failed[/red]", *[""] * 17)
            continue
        tok_s, first = r.get("rollout_tokens_per_s"), r.get("first_step_s")
        share, mfu = r.get("rollout_roofline_share"), r.get("train_mfu_dense")
        gen_share, step_ms, dec_share, kv_share = (r.get(k) for k in (
            "generate_roofline_share", "decode_step_ms", "decode_roofline_share", "decode_roofline_share_with_kv"))
        table.add_row(r["weight_sync"], f"{r['step_ms']:.1f}", f"{r['update_weights_ms']:.2f}",
                      f"{r['rollout_ms']:.1f}", f"{r.get('generate_ms', 0.0):.1f}",
                      "-" if tok_s is None else f"{tok_s:,.0f}", "-" if share is None else f"{share:.1%}",
                      "-" if gen_share is None else f"{gen_share:.1%}", "-" if step_ms is None else f"{step_ms:.3f}",
                      "-" if dec_share is None else f"{dec_share:.1%}", "-" if kv_share is None else f"{kv_share:.1%}",
                      f"{r['logprobs_ms']:.1f}",
                      f"{r['train_ms']:.1f}",
                      "-" if mfu is None else f"{mfu:.1%}", f"{r['sync_bytes'] / 1e6:.3f}",
                      f"{r['shared_bytes'] / 1e6:.1f}", f"{r['logprob_abs_diff']:.2e}", f"{r['rollout_entropy']:.2f}",
                      "-" if first is None else f"{first:.1f}")
    console = Console(width=200)
    console.print(table)
    for r in failed:
        console.print(f"[red]{r['weight_sync']}: {r['error']}[/red]", soft_wrap=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--impl", default="miles", choices=("miles", "megatron"))
    p.add_argument("--hardware", default="nvidia" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weight-sync", default="copy,shared", help="modes to run, comma-separated (auto, shared, copy)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more training options")
    p.add_argument("--sft-steps", type=int, default=0, metavar="N",
                   help="first SFT the model N steps on the built-in task (dsv4 train --mode sft, exported), then "
                        "run the GRPO rows from it: the log-prob difference of a model that is not near-uniform")
    p.add_argument("--folder", default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/grpo-<hardware>-<model>.json)")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    env = subprocess_env()
    model, config = resolve_model(a.model, env)
    folder = Path(a.folder) if a.folder else Path(tempfile_dir())
    rows = []
    settings = dict(model=a.model, impl=a.impl, hardware=a.hardware, steps=a.steps, warmup=a.warmup,
                    prompts_per_step=a.prompts, group_size=a.group, max_new_tokens=a.new_tokens, options=a.set,
                    sft_steps=a.sft_steps)
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"grpo-{a.hardware}-{a.model}.json"
    sft = None
    if a.sft_steps > 0:
        sft = sft_first(folder=folder / "sft", env=env, impl=a.impl, model=model, steps=a.sft_steps,
                        hardware=a.hardware)
        if "error" in sft:
            print(f"dsv4 train --mode sft failed: {sft['error']}", file=sys.stderr)
            return 1
        model = sft["export"]
    for mode in [m.strip() for m in a.weight_sync.split(",") if m.strip()]:
        rows.append(run_mode(mode, folder=folder / mode, env=env, warmup=a.warmup, hardware=a.hardware,
                             config=config, impl=a.impl, model=model, steps=a.steps, prompts=a.prompts, group=a.group,
                             new_tokens=a.new_tokens, options=a.set))
        record = {"bench": "grpo", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine(a.hardware), "torch": torch.__version__, "command": shlex.join(sys.argv),
                  "settings": settings, "sft": sft, "rows": rows}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
    print_table(rows, f"dsv4 train --mode grpo, {a.model} ({a.impl}), {machine(a.hardware)}")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="dsv4-bench-grpo-")


if __name__ == "__main__":
    sys.exit(main())
