"""The `dsv4 train` benchmark (bench.train_cli) as a CPU smoke run: it starts the real command line (one rank;
two ranks under torch.distributed.run, gloo) on the tiny model, and its JSON holds each layout's throughput,
step time and scaling against the one-rank row; a layout the command refuses is a row with the command's error,
added to the earlier result by --append; the reference row (transformers' step) is counted as the layouts are."""

from __future__ import annotations

import json

import pytest
import torch

from bench.train_cli import _error_line, build_parser, main, parse_layout, resolve_model, subprocess_env, write_sft_data


def test_layout_parsing_and_refusal():
    assert parse_layout("miles:1") == {"name": "miles:1", "impl": "miles", "dp": 1, "tp": 1, "cp": 1, "ep": 1,
                                       "world": 1}
    assert parse_layout("miles:ep2")["dp"] == 2 and parse_layout("miles:ep2")["world"] == 2  # ep inside dp
    assert parse_layout("megatron:cp2")["world"] == 2
    assert parse_layout("miles:dp2+tp2")["world"] == 4
    with pytest.raises(ValueError, match="expected SPEC 1, or dpN"):
        parse_layout("miles:pp2")
    with pytest.raises(ValueError, match="ep 4 must divide dp 2"):
        parse_layout("miles:dp2+ep4")
    with pytest.raises(ValueError, match="IMPL one of miles, megatron"):
        parse_layout("transformers:1")


TORCHRUN_TAIL = """[rank1]: Traceback (most recent call last):
[rank1]:   File "launchers/dsv4.py", line 9, in <module>
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
E1207 07:56:10 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
launchers.dsv4 FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4242)
============================================================
"""


def test_a_failed_layout_reports_the_line_that_says_why():
    """A layout's ``error`` is the line a person needs: the CLI's ``error:`` line, else the rank's exception, not
    torchrun's closing rule of ``=`` signs (a CI log once showed only that) nor its ChildFailedError."""
    assert _error_line("step 1\nerror: --ep 2 needs 2 ranks. Fix: run under torchrun\n") == \
        "error: --ep 2 needs 2 ranks. Fix: run under torchrun"
    assert _error_line(TORCHRUN_TAIL) == ("[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                                          "Connection closed by peer")
    killed = TORCHRUN_TAIL.replace("[rank1]: RuntimeError", "[rank1]: note").replace("exitcode  : 1", "exitcode  : -9")
    assert _error_line(killed) == "exitcode  : -9 (pid: 4242)"
    assert _error_line("====\n\n") == "no output"


def test_sft_data_is_exactly_the_requested_tokens(tmp_path):
    from train import data as D

    path = write_sft_data(tmp_path / "data.jsonl", 100, "tiny", 1024, n=5)
    tok = D.tokenizer_for("tiny", 1024)
    examples = D.load_jsonl(path, "sft")
    assert len(examples) == 5 and len({e.response for e in examples}) == 5
    for e in examples:
        assert len(D.encode_prompt(tok, e.prompt)) + len(D.encode_response(tok, e.response)) == 100
    with pytest.raises(ValueError, match="at least 4 tokens"):
        write_sft_data(tmp_path / "short.jsonl", 3, "tiny", 1024)


def test_a_preset_without_a_checkpoint_is_prepared_first(tmp_path, monkeypatch):
    from launchers import stages

    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(stages, "DEFAULT_MODEL", "none")      # as if tiny were a preset dsv4 train refuses
    model, config = resolve_model("tiny", subprocess_env())
    assert model == str(tmp_path / "cache" / "tiny-bf16-seed0") and config.vocab_size == 1024
    assert (tmp_path / "cache" / "tiny-bf16-seed0" / "config.json").is_file()


def test_cpu_smoke_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "cache"))
    out, work = tmp_path / "train-cli.json", tmp_path / "work"
    args = ["--hardware", "cpu", "--model", "tiny", "--seq", "64", "--steps", "2", "--warmup", "1", "--batch", "1",
            "--out", str(out), "--work-dir", str(work)]
    # one layout of each launch: one process, and two ranks under torch.distributed.run (miles:ep2: data parallel 2
    # with the experts split; a plain miles:dp2 row ran the same launch again, test_dp2_command_line checks its
    # command, and tests/train/test_layouts.py trains data parallel 2 against one rank)
    rc = main(args + ["--layouts", "miles:1,miles:ep2"])
    res = json.loads(out.read_text())
    assert rc == 0, [(r["layout"], r.get("error"), r.get("log_tail")) for r in res["rows"] if "error" in r]
    assert res["machine"].startswith("CPU") and res["torch"] == torch.__version__ and res["date"]
    assert res["command"].startswith("python -m bench.train_cli ") and "miles:1,miles:ep2" in res["command"]
    assert res["settings"]["seq"] == 64 and res["settings"]["model"] == "tiny"
    assert "needs CUDA" in res["reference"]["skipped"]
    rows = res["rows"]
    assert [r["layout"] for r in rows] == ["miles:1", "miles:ep2"]
    for r in rows:
        assert "error" not in r, r.get("log_tail")
        assert r["world_size"] == r["gpus"] and r["timed_steps"] == 1 and r["warmup_steps"] == 1
        assert r["tokens_per_step"] == 64 * r["sequences_per_step"]   # one 64-token sequence per data rank
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["gpus"])
        assert r["mfu"] is None and r["peak_mem_gib"] is None and r["flops_per_step"] > 0   # no MFU on the CPU
        assert "-m launchers.dsv4 train --mode sft" in r["train_command"]
        assert ("torch.distributed.run --standalone --nproc-per-node 2" in r["train_command"]) == (r["gpus"] == 2)
        run = work / r["layout"].replace(":", "-") / "run"
        assert not (run / "checkpoints").exists()                     # deleted once the metrics are read
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["peak_memory_gib"] for m in metrics] == [None, None]  # the trainer's row: None on the CPU
    assert rows[0]["scaling_efficiency"] is None
    assert "--ep 2" in rows[1]["train_command"] and rows[1]["sequences_per_step"] == 2
    assert rows[1]["scaling_baseline"] == "miles:1"
    assert rows[1]["scaling_efficiency"] == pytest.approx(rows[1]["tokens_per_s_per_gpu"] / rows[0]["tokens_per_s_per_gpu"])
    table = capsys.readouterr().out
    assert "miles:ep2" in table and "FAILED" not in table

    # a layout dsv4 train refuses: a row with its error, the earlier rows kept
    assert main(args + ["--layouts", "megatron:tp2", "--append"]) == 1
    res = json.loads(out.read_text())
    assert [r["layout"] for r in res["rows"]] == ["miles:1", "miles:ep2", "megatron:tp2"]
    assert "tensor-parallel size must be 1" in res["rows"][-1]["error"] and len(res["commands"]) == 2
    with pytest.raises(SystemExit, match="other settings"):
        main(args[:5] + ["128"] + args[6:] + ["--layouts", "miles:1", "--append"])


def test_dp2_command_line(tmp_path):
    """miles:dp2's row runs this command (the launch and the row are test_cpu_smoke_run's miles:ep2's): two ranks
    under torch.distributed.run, one sequence each, no expert parallelism."""
    from bench.train_cli import train_command

    cmd = train_command(parse_layout("miles:dp2"), model="tiny", data=tmp_path / "d.jsonl", run_dir=tmp_path / "run",
                        steps=2, hardware="cpu")
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    assert cmd[7:12] == ["launchers.dsv4", "train", "--mode", "sft", "--hardware"]
    assert "batch_size=2" in cmd and not {"--ep", "--tp", "--cp", "--qkv-format"} & set(cmd)
    assert cmd[cmd.index("--impl") + 1] == "miles" and cmd[cmd.index("--steps") + 1] == "2"


def test_profile_batch_and_options(tmp_path, monkeypatch, capsys):
    """--profile adds untimed profiled steps and their budget; --batch N trains N sequences per step in
    micro-batches of --micro-batch M; --set passes a training option."""
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "cache"))
    out, work = tmp_path / "train-cli.json", tmp_path / "work"
    assert main(["--hardware", "cpu", "--model", "tiny", "--seq", "64", "--steps", "2", "--warmup", "1",
                 "--layouts", "miles:1", "--profile", "1", "--batch", "2", "--micro-batch", "1", "--set", "recompute=full",
                 "--out", str(out), "--work-dir", str(work)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert "--steps 3" in row["train_command"] and "profile_steps=1" in row["train_command"]
    assert "batch_size=2 " in row["train_command"] and "micro_batch_size=1" in row["train_command"]
    assert " recompute=full" in row["train_command"]
    assert row["timed_steps"] == 1                  # step 2 only: step 3 ran under the profiler, untimed
    assert row["sequences_per_step"] == 2 and row["tokens_per_step"] == 128
    metrics = [json.loads(line) for line in (work / "miles-1" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["micro_batches"] for m in metrics] == [2, 2, 2]
    budget = row["budget"]
    assert budget["steps"] == [3, 3] and budget["device"] == "cpu"
    assert {r["category"] for r in budget["rows"]} >= {"moe expert GEMMs", "optimizer: adam"}
    assert "step budget of miles:1" in capsys.readouterr().out


def test_the_default_step_is_eight_sequences_in_micro_batches_of_two(tmp_path, capsys):
    """Without --batch a layout trains eight sequences per data-parallel rank in micro-batches of two (a real
    run's step shares its fixed costs; --batch 1 is the one-sequence step); --micro-batch must divide --batch."""
    from bench.train_cli import train_command

    ep2 = parse_layout("miles:ep2")
    cmd = train_command(ep2, model="tiny", data=tmp_path / "d.jsonl", run_dir=tmp_path / "run", steps=2,
                        hardware="cpu", batch=8, micro_batch=2)
    assert "batch_size=16" in cmd and "micro_batch_size=2" in cmd
    one = train_command(ep2, model="tiny", data=tmp_path / "d.jsonl", run_dir=tmp_path / "run", steps=2,
                        hardware="cpu", batch=1, micro_batch=2)
    assert "batch_size=2" in one and not any(a.startswith("micro_batch_size=") for a in one)
    with pytest.raises(SystemExit):
        main(["--hardware", "cpu", "--model", "tiny", "--batch", "6", "--micro-batch", "4", "--layouts", "miles:1"])
    assert "--micro-batch 4 must be at least 1 and divide --batch 6" in capsys.readouterr().err
    defaults = build_parser().parse_args([])
    assert defaults.batch == 8 and defaults.micro_batch == 2


def test_the_reference_row_is_transformers_step_counted_as_the_layouts_are(monkeypatch):
    """train_cli's reference row takes its step time from bench.reference_step (which needs CUDA, so a fake
    stands in here) and counts FLOPs and MFU with the layouts' formula; a failing step is the row's error."""
    from bench import reference_step
    from bench.flops import H200_BF16_DENSE_TFLOPS, active_params, step_flops
    from bench.train_cli import reference_row
    from core.config import preset

    calls = []

    def fake(c, seq, warmup, timed):
        calls.append((seq, warmup, timed))
        return dict(step_ms=250.0, peak_mem_gb=3.5, timed_steps=timed, loss_first=7.0, loss_last=6.5, note="fake")

    config = preset("tiny")
    monkeypatch.setattr(reference_step, "time_step", fake)
    row = reference_row(config, 64, 2, 3)
    assert calls == [(64, 2, 3)] and row["steps"] == 5 and row["warmup_steps"] == 2
    flops = step_flops(config, 64, 1, active_params(config))["total"]
    assert row["flops_per_step"] == flops and row["tokens_per_s"] == pytest.approx(64 / 0.25)
    assert row["mfu"] == pytest.approx(flops / 0.25 / (H200_BF16_DENSE_TFLOPS * 1e12))
    assert row["peak_mem_gib"] == 3.5 and row["loss_last"] == 6.5 and "error" not in row

    def broken(*args):
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(reference_step, "time_step", broken)
    row = reference_row(config, 64, 2, 3)
    assert row["error"] == "RuntimeError: no CUDA here" and "tokens_per_s" not in row
