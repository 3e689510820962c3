"""The multi-GPU benchmark's code path, as a CPU smoke run (gloo processes, tiny model): every layout kind
trains, reports a positive throughput and exports the whole model; the table and the JSON agree."""

from __future__ import annotations

import json

import pytest

from bench.parallel import main, parse_layout


def test_layout_parsing_and_refusal():
    assert parse_layout("miles:tp2") == {"impl": "miles", "tp": 2, "cp": 1, "ep": 1, "world": 2, "name": "miles:tp2"}
    assert parse_layout("megatron:ep2")["world"] == 2
    with pytest.raises(ValueError, match="expected impl:tpN, impl:cpN or impl:epN"):
        parse_layout("miles:dp2")


def test_cpu_smoke_run_of_tp_cp_and_ep_layouts(tmp_path, capsys):
    out = tmp_path / "parallel.json"
    main(["--hardware", "cpu", "--model", "tiny", "--seq", "512", "--warmup", "1", "--steps", "1",
          "--layouts", "miles:tp2,megatron:cp2,miles:ep2", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["layout"] for r in rows] == ["miles:tp2", "megatron:cp2", "miles:ep2"]
    for r in rows:
        assert "error" not in r, r.get("traceback")
        assert r["tokens_per_s"] > 0 and r["mfu"] is None     # no MFU on the CPU
        assert r["export"]["bf16"]["buckets"] >= 1 and r["export"]["fp8"]["gb"] > 0
    assert rows[2]["sequences_per_step"] == 2                 # ep ranks train their own sequences
    table = capsys.readouterr().out
    assert "miles:ep2" in table and "FAILED" not in table


def test_a_port_taken_before_the_ranks_bind_it_starts_them_on_another(tmp_path, monkeypatch):
    """The first port the run picks is held by a listener (as a parallel test's store held it in CI): the layout
    still trains, on the next pick, where it recorded EADDRINUSE as its error."""
    import socket

    import core.ports

    picks = []
    real = core.ports.free_port
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(core.ports, "free_port", lambda: picks.append(1) or (taken if len(picks) == 1 else real()))
        out = tmp_path / "parallel.json"
        main(["--hardware", "cpu", "--model", "tiny", "--seq", "256", "--warmup", "0", "--steps", "1",
              "--layouts", "miles:tp2", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert "error" not in row, row.get("traceback")
    assert len(picks) == 2 and row["tokens_per_s"] > 0
