"""`dsv4` on bad inputs (issue #21, items 4 and 5): one line `error: ...` with the fix, exit 1 or 2, no
traceback; outputs never destroy inputs; --overwrite replaces only dsv4's own outputs; concurrent writers
report "wrote" once; stale temporaries are cleaned; a failed start leaves nothing behind.
docs/bad-inputs.md lists each case."""

import os
import subprocess
import sys

import pytest

from tests.cli_process import run_cli as dsv4  # the CLI as a separate process, as a user runs it


def dsv4_here(*args):
    from click.testing import CliRunner

    from launchers.cli import main

    return CliRunner().invoke(main, list(args))


def one_line_error(proc, code=1):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    proc = dsv4("prepare", "--preset", "tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


# -------------------------------------------------------------- item 5: one line
def test_bad_jsonl_is_one_line_with_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    line = one_line_error(dsv4("train", "--mode", "sft", "--data", str(data), "--run-dir", str(tmp_path / "r"),
                               "--steps", "1"))
    assert f"{data}:2" in line
    assert not (tmp_path / "r").exists()            # a failed start leaves no run folder


def test_a_reward_spec_without_its_answer_is_one_line_with_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "reward": {"type": "exact_match"}}\n')
    line = one_line_error(dsv4("train", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--steps", "1"))
    assert f"{data}:1" in line and "'answer'" in line


def test_lr_nan_is_one_line_naming_the_option(tmp_path):
    line = one_line_error(dsv4("train", "--lr", "nan", "--run-dir", str(tmp_path / "r"), "--steps", "1"))
    assert "--lr" in line and "finite" in line
    assert not (tmp_path / "r").exists()


def test_export_of_a_folder_that_is_not_a_run(tiny, tmp_path):
    line = one_line_error(dsv4("export", "--run-dir", str(tiny), "--out", str(tmp_path / "hf")))
    assert "not a training run folder" in line
    assert not (tmp_path / "hf").exists()


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(monkeypatch):
    from launchers import stages

    def boom(*a, **k):
        raise RuntimeError("something internal\nsecond line")

    monkeypatch.setattr(stages, "inspect", boom)
    res = dsv4_here("inspect", "--preset", "tiny")
    assert res.exit_code == 1
    assert "error: unexpected RuntimeError: something internal (rerun with --debug" in res.output
    assert "Traceback" not in res.output
    res = dsv4_here("--debug", "inspect", "--preset", "tiny")
    assert isinstance(res.exception, RuntimeError)    # re-raised: the traceback is shown


@pytest.mark.parametrize("err, words", [
    (OSError(28, "No space left on device", "/data/out/x.distcp"), ("/data/out/x.distcp", "No space left",
                                                                    "free some space")),
    (OSError(30, "Read-only file system", "/ro/out"), ("/ro/out", "read-only")),
])
def test_full_disk_and_read_only_output_are_one_line(monkeypatch, err, words):
    from launchers import stages

    def fail(*a, **k):
        raise RuntimeError("wrapped by a library") from err

    monkeypatch.setattr(stages, "inspect", fail)
    res = dsv4_here("inspect", "--preset", "tiny")
    assert res.exit_code == 1 and "Traceback" not in res.output
    for w in words:
        assert w in res.output, res.output


def test_a_truncated_distcp_is_one_line(tiny, tmp_path):
    native = tmp_path / "native"
    assert dsv4_here("convert", "--hf", str(tiny), "--out", str(native)).exit_code == 0
    data = sorted(native.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    (tmp_path / "t.json").write_text("[[0, 5, 6]]")
    line = one_line_error(dsv4("logprobs", "--checkpoint", str(native), "--tokens", str(tmp_path / "t.json")))
    assert "truncated or damaged" in line


def test_nan_weights_make_logprobs_fail_instead_of_printing_invalid_json(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    d = load_file(str(shard))
    d["hc_head_base"].view(-1)[0] = float("nan")
    save_file(d, str(shard), metadata={"format": "pt"})
    (tmp_path / "t.json").write_text("[[0, 5, 6]]")
    proc = dsv4("logprobs", "--checkpoint", str(bad), "--tokens", str(tmp_path / "t.json"))
    assert "hc_head_base" in one_line_error(proc)
    assert proc.stdout == ""


# ---------------------------------------------------------------- item 4: paths
def test_a_shard_symlinked_outside_the_folder_is_not_followed(tiny, tmp_path):
    import shutil

    from core.checkpoint import open_checkpoint
    from core.path_safety import PathSafetyError

    ck = tmp_path / "ck"
    shutil.copytree(tiny, ck)
    shard = sorted(ck.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(PathSafetyError, match="outside the folder"):
        open_checkpoint(ck)


def test_an_output_that_is_contains_or_sits_inside_an_input_is_refused(tiny, tmp_path):
    before = sorted(p.name for p in tiny.iterdir())
    for out in (tiny, tiny / "native", tiny.parent):
        res = dsv4_here("convert", "--hf", str(tiny), "--out", str(out), "--overwrite")
        assert res.exit_code == 1 and "error: --out" in res.output and "the input" in res.output, res.output
    assert sorted(p.name for p in tiny.iterdir()) == before


def test_overwrite_replaces_only_what_dsv4_wrote(tiny, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("user data")
    res = dsv4_here("convert", "--hf", str(tiny), "--out", str(mine), "--overwrite")
    assert res.exit_code == 1 and "not written by dsv4" in res.output
    assert (mine / "notes.txt").read_text() == "user data"
    out = tmp_path / "native"
    assert "wrote" in dsv4_here("convert", "--hf", str(tiny), "--out", str(out)).output
    assert "already converted" in dsv4_here("convert", "--hf", str(tiny), "--out", str(out)).output
    res = dsv4_here("convert", "--hf", str(tiny), "--out", str(out), "--overwrite")
    assert res.exit_code == 0 and "wrote" in res.output


def test_convert_checks_free_space_first(tiny, tmp_path, monkeypatch):
    import shutil

    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 6, 10 ** 6 - 1000, 1000))
    res = dsv4_here("convert", "--hf", str(tiny), "--out", str(tmp_path / "native"))
    assert res.exit_code == 1 and "not enough free disk space" in res.output, res.output
    assert not (tmp_path / "native").exists()


def test_concurrent_converts_report_wrote_exactly_once(tiny, tmp_path):
    out = tmp_path / "native"
    procs = [subprocess.Popen([sys.executable, "-m", "launchers.cli", "convert", "--hf", str(tiny), "--out",
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    said = [err for _out, err in results]
    assert sum("wrote" in s for s in said) == 1, said
    assert sum("already converted" in s for s in said) == 2, said


def test_stale_temporaries_of_killed_writers_are_removed(tiny, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = [tmp_path / f".native.tmp-{dead}-abcdef12", tmp_path / f"..native.stage-{dead}-0123abcd.tmp-{dead}-99"
             f"aabbcc"]
    live = tmp_path / f".other.tmp-{os.getpid()}-abcdef12"      # a writer that still runs
    for p in stale + [live]:
        p.mkdir()
        (p / "__0_0.distcp").write_bytes(b"x" * 10)
    assert dsv4_here("convert", "--hf", str(tiny), "--out", str(tmp_path / "native")).exit_code == 0
    assert not any(p.exists() for p in stale)
    assert live.exists()


def test_resume_names_the_option_that_differs(tmp_path):
    run = tmp_path / "run"
    base = ["train", "--mode", "sft", "--steps", "1", "--save-every", "1", "--run-dir", str(run)]
    proc = dsv4(*base)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = one_line_error(dsv4(*base[:4], "2", *base[5:], "--resume", "--lr", "0.5"))
    assert "train.lr" in line and "0.5" in line


def test_a_failed_start_does_not_block_a_plain_rerun(tmp_path):
    run = tmp_path / "run"
    run.mkdir()                                     # e.g. made by the user, or left by an older version
    (run / "metrics.jsonl").write_text("")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    proc = dsv4("train", "--mode", "sft", "--steps", "1", "--data", str(data), "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
