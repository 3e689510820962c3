"""`dsv4 prepare --hf-repo` against a local server that speaks the Hub's download API (no internet here).

The server (:class:`FakeHub`) answers what huggingface_hub's ``snapshot_download`` asks, as read in its
source: ``GET /api/models/{repo}/revision/{rev}`` (``sha``, ``siblings``), ``GET /api/models/{repo}/tree/{rev}``
(the recursive file listing), and ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``,
``ETag`` and ``Content-Length`` (``Range`` honoured); an unknown repository or revision answers 404 with
the Hub's ``X-Error-Code``. It serves a tiny checkpoint written by the repository's own fixture, in
several shards, plus files a checkpoint does not need.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from core.checkpoint import prepare_checkpoint
from tests.cli_process import run_module
from core.config import preset

REPO = "test-org/tiny-v4"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token_123"
EXTRA = {"README.md": b"# tiny\n", "inference/model.py": b"print('not needed')\n",
         "inference/other.safetensors": b"not needed"}


class FakeHub:
    """A threaded HTTP server with the Hub's download endpoints for one repository at one commit."""

    def __init__(self, files: dict):
        self.files = dict(files)
        self.requests = []           # (method, path, authorization header)
        self.fail_get = set()        # files whose GET answers 500
        self.hold_get = {}           # file -> threading.Event the GET waits for
        self.serve_instead = {}      # file -> bytes served in its place (same length)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        for ev in self.hold_get.values():
            ev.set()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == "GET" and p.endswith(f"/resolve/{COMMIT}/{name}"))

    # -- responses -------------------------------------------------------------------------------------------
    def _send(self, h, code, body=b"", headers=None, head=False):
        h.send_response(code)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _json(self, h, obj, head):
        self._send(h, 200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _not_found(self, h, code_name, head):
        self._send(h, 404, b'{"error": "not found"}', {"X-Error-Code": code_name, "X-Error-Message": code_name}, head)

    def _handle(self, h, *, head):
        path = h.path.split("?", 1)[0]
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
            if repo != REPO:
                return self._not_found(h, "RepoNotFound", head)
            if rev not in ("main", COMMIT):
                return self._not_found(h, "RevisionNotFound", head)
            if kind == "revision":
                return self._json(h, {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": f} for f in self.files]}, head)
            if kind == "tree":
                return self._json(h, [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                      for f, b in self.files.items()], head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo != REPO:
                return self._not_found(h, "RepoNotFound", head)
            if rev not in ("main", COMMIT):
                return self._not_found(h, "RevisionNotFound", head)
            if name not in self.files:
                return self._not_found(h, "EntryNotFound", head)
            body = self.serve_instead.get(name, self.files[name])
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(self.files[name]).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            if not head:
                if name in self.fail_get:
                    return self._send(h, 500, b"internal error", {"X-Repo-Commit": COMMIT})
                if name in self.hold_get:
                    self.hold_get[name].wait(60)
                rng = h.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
                    return self._send(h, 206, body[start:], headers)
            return self._send(h, 200, body, headers, head)
        return self._send(h, 404, b"no such route", head=head)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The repository's files: a tiny checkpoint in 4 shards (the repo's fixture) and files not needed."""
    ckpt = prepare_checkpoint(tmp_path_factory.mktemp("src") / "tiny", preset("tiny"), dtype="bf16", seed=5,
                              max_shard_bytes=4_000_000)
    files = {p.name: p.read_bytes() for p in sorted(ckpt.iterdir()) if p.is_file()}
    assert sum(n.endswith(".safetensors") for n in files) >= 3
    return ckpt, files


@pytest.fixture
def hub(source):
    server = FakeHub({**source[1], **EXTRA})
    yield server
    server.close()


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DSV4_CACHE": str(tmp_path / "cache"), "HF_TOKEN": TOKEN})
    env.update(extra)
    return env


def _dsv4(tmp_path, *args, env=None, wait=True):
    args = ["prepare", *map(str, args)]
    if not wait:
        return subprocess.Popen([sys.executable, "-m", "launchers.cli", *args], env=env or _env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return run_module("launchers.cli", args, env=env or _env(tmp_path), timeout=300)


def _same_as_source(out: Path, files: dict) -> None:
    got = {p.name for p in out.iterdir()} - {".dsv4-complete.json", "dsv4_hf_source.json"}
    assert got == set(files), got ^ set(files)
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name


def _leftovers(parent: Path):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and p.name != ".dsv4-locks")


def test_prepare_downloads_verifies_and_a_rerun_is_a_no_op(tmp_path, hub, source):
    ckpt, files = source
    out = tmp_path / "out"
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, env=_env(tmp_path, HF_ENDPOINT=hub.url))
    assert proc.returncode == 0, proc.stderr
    assert f"downloaded {REPO} (revision main) at {out}" in "".join(proc.stderr.split("\n"))
    _same_as_source(out, files)                                             # only what a checkpoint needs
    src = json.loads((out / "dsv4_hf_source.json").read_text())
    assert src["repo"] == REPO and src["revision"] == "main" and src["commit"] == COMMIT and src["endpoint"] == hub.url
    sentinel = json.loads((out / ".dsv4-complete.json").read_text())
    assert sentinel["stage"] == "prepare" and sentinel["inputs"] == {"hf_repo": REPO, "revision": "main"}
    assert _leftovers(tmp_path) == []                                       # the download folder is gone
    assert {a for _, _, a in hub.requests} == {f"Bearer {TOKEN}"}           # HF_TOKEN, through huggingface_hub
    assert not any("inference/" in p or p.endswith("README.md") for _, p, _ in hub.requests if "/resolve/" in p)
    # the prepared folder is a checkpoint dsv4 reads
    from core.checkpoint import open_checkpoint

    assert open_checkpoint(out).config == open_checkpoint(ckpt).config

    n = len(hub.requests)
    again = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url)
    assert again.returncode == 0, again.stderr
    assert "already prepared:" in again.stderr and len(hub.requests) == n  # no network call at all


def test_default_out_revision_and_endpoint_option(tmp_path, hub, source):
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--hf-revision", COMMIT, "--hf-endpoint", hub.url)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "cache" / "hf" / f"test-org--tiny-v4--{COMMIT}"
    _same_as_source(out, source[1])
    assert not any(p.startswith("/api/models/") and "/revision/" in p for _, p, _ in hub.requests)  # a commit: not resolved


def test_unknown_repository_or_revision_is_one_line_and_leaves_nothing(tmp_path, hub):
    out = tmp_path / "out"
    for args, what in ((("--hf-repo", "test-org/missing"), "RepositoryNotFoundError"),
                       (("--hf-repo", REPO, "--hf-revision", "v9"), "RevisionNotFoundError")):
        proc = _dsv4(tmp_path, *args, "--out", out, "--hf-endpoint", hub.url)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith("error: --hf-repo") and what in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()
    bad = _dsv4(tmp_path, "--hf-repo", "not a repo", "--out", out)
    assert bad.returncode == 1 and "expected ORG/NAME" in bad.stderr
    mixed = _dsv4(tmp_path, "--hf-repo", REPO, "--preset", "tiny", "--out", out)
    assert mixed.returncode == 2 and "--preset do not apply" in mixed.stderr


def test_a_failed_download_resumes_and_fetches_only_what_is_missing(tmp_path, hub, source):
    files = source[1]
    shard = sorted(n for n in files if n.endswith(".safetensors"))[1]
    out = tmp_path / "out"
    hub.fail_get.add(shard)
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url)
    assert proc.returncode == 1 and proc.stderr.startswith("error: --hf-repo") and "500" in proc.stderr, proc.stderr
    assert not out.exists()
    hub.fail_get.clear()
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url)
    assert proc.returncode == 0, proc.stderr
    _same_as_source(out, files)
    assert _leftovers(tmp_path) == []
    for name in files:  # the files the first run completed were not fetched again
        assert hub.gets(name) == (2 if name == shard else 1), name


def test_a_killed_download_does_not_block_a_rerun(tmp_path, hub, source):
    files = source[1]
    shard = sorted(n for n in files if n.endswith(".safetensors"))[0]
    out = tmp_path / "out"
    hub.hold_get[shard] = threading.Event()
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url, wait=False)
    deadline = time.time() + 120
    while hub.gets(shard) == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert hub.gets(shard) == 1, proc.communicate()[1] if proc.poll() is not None else "no GET"
    os.kill(proc.pid, signal.SIGKILL)                 # mid-download, holding the stage's lock
    proc.wait(30)
    hub.hold_get.pop(shard).set()
    assert not out.exists()
    again = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url)
    assert again.returncode == 0, again.stderr
    _same_as_source(out, files)
    assert _leftovers(tmp_path) == []


def test_files_that_fail_verification_are_removed_so_a_rerun_starts_clean(tmp_path, hub, source):
    files = source[1]
    shard = sorted(n for n in files if n.endswith(".safetensors"))[-1]
    out = tmp_path / "out"
    data = files[shard]
    hub.serve_instead[shard] = data[:8] + b"\xff" * 8 + data[16:]  # same length, a garbled header
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url)
    assert proc.returncode == 1, proc.stderr
    assert "not a valid official-format checkpoint" in proc.stderr and shard in proc.stderr
    assert not out.exists() and _leftovers(tmp_path) == []
    hub.serve_instead.clear()
    proc = _dsv4(tmp_path, "--hf-repo", REPO, "--out", out, "--hf-endpoint", hub.url)
    assert proc.returncode == 0, proc.stderr
    _same_as_source(out, files)
