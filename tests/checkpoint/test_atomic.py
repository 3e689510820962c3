"""core.atomic: single files replaced atomically (temp file beside, fsync, rename, folder fsync)."""

import os

import pytest

from core.atomic import atomic_path, fsync_dir, write_bytes_atomically, write_text_atomically


def test_write_replaces_and_leaves_nothing_beside(tmp_path):
    p = tmp_path / "f.json"
    assert write_text_atomically(p, "one\n") == p
    write_text_atomically(p, "two\n")
    write_bytes_atomically(tmp_path / "b.bin", b"\x00\x01")
    assert p.read_text() == "two\n" and (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["b.bin", "f.json"]


def test_new_file_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        write_text_atomically(tmp_path / "f", "x")
    finally:
        os.umask(umask)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644


def test_an_error_keeps_the_old_content_and_removes_the_temporary(tmp_path):
    p = tmp_path / "f"
    p.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".f.") and tmp.name.endswith(".tmp")
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["f"]


def test_atomic_path_for_writers_that_want_a_path(tmp_path):
    p = tmp_path / "lines.jsonl"
    with atomic_path(p) as tmp:
        with open(tmp, "w") as f:
            f.writelines(f"{i}\n" for i in range(3))
        assert not p.exists()
    assert p.read_text() == "0\n1\n2\n"
    with pytest.raises(FileNotFoundError):  # nothing written: the destination is untouched
        with atomic_path(p):
            pass
    assert p.read_text() == "0\n1\n2\n"


def test_fsync_dir_syncs_the_folder_and_skips_what_it_cannot_open(tmp_path, monkeypatch):
    synced, closed = [], []
    real_fsync, real_close = os.fsync, os.close
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    monkeypatch.setattr(os, "close", lambda fd: closed.append(fd) or real_close(fd))
    fsync_dir(tmp_path)
    assert synced == [tmp_path.stat().st_ino] and len(closed) == 1      # the folder itself, its fd closed
    assert fsync_dir(tmp_path / "missing") is None                      # cannot open: skipped, no error
    assert len(synced) == 1

    def refuse(fd):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "fsync", refuse)                            # a mount that cannot fsync a folder
    assert fsync_dir(tmp_path) is None and len(closed) == 2             # skipped, and the fd still closed
