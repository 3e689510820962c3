"""A fake SGLang server for the CPU tests: SGLang's native HTTP API as rollout/sglang_engine.py speaks it.

It does NOT run a model. ``/generate`` answers deterministic samples derived from each sample's
``sampling_seed`` (token ids, log-probabilities, a finish reason and routed experts for every position),
and the weight endpoints record what they receive, so a test can check what the trainer sent:

* ``GET /health`` (503 until ``health_delay_s`` has passed), ``GET /get_server_info`` (``tp_size``, the
  command line, the worker's pid);
* ``POST /generate``: ``input_ids`` (a list) with one ``sampling_params`` per input;
* ``POST /update_weights_from_tensor``: ``serialized_named_tensors`` in the base64 ``torch.save`` stand-in
  format (:func:`rollout.sglang_engine.torch_b64_serialize`; SGLang's own serializer needs the sglang
  package), one entry per TP rank; ``POST /flush_cache`` closes a weight version;
* ``POST /update_weights_from_disk``: reads the HF checkpoint at ``model_path`` (a weight version);
* ``POST /get_weights_by_name``.

In a test process: ``with FakeSGLang(config) as fake: fake.url, fake.state``. As a process (what the launch
tests start as ``python -m sglang.launch_server``, :func:`install_fake_launcher`): :func:`main` takes
launch_server's arguments (``--model-path`` must be an HF checkpoint, read with
:func:`core.checkpoint.open_checkpoint`; ``--fake-health-delay S``, ``--fake-fail PATH MESSAGE``), starts a
sleeping worker process in its process group (as SGLang's scheduler processes are), and writes its state as
JSON to ``$FAKE_SGLANG_STATE`` after every request. The module is also a plugin (:func:`dsv4_rollout_engines`)
for the trainer's launch mode on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional

from core.hookspecs import hookimpl
from core.records import RolloutEngine

STATE_ENV = "FAKE_SGLANG_STATE"
REPO = Path(__file__).resolve().parents[2]


def install_fake_launcher(tmp_path, monkeypatch) -> Path:
    """Make ``python -m sglang.launch_server`` in child processes run :func:`main`: a ``sglang`` package whose
    ``launch_server`` module calls it, first on the children's ``PYTHONPATH`` (this process's imports are
    unchanged). Returns the file the started server writes its state to."""
    pkg = tmp_path / "fake_pkgs" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom tests.train._fake_sglang import main\nmain()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake_pkgs"), str(REPO)] + sys.path))
    state = tmp_path / "server_state.json"
    monkeypatch.setenv(STATE_ENV, str(state))
    return state


@hookimpl
def dsv4_rollout_engines():
    """The built-in ``sglang`` record (same factory: the real adapter) declared runnable on the CPU: ``gpu=False``
    and no availability probe, because the server it starts there is the fake of :func:`install_fake_launcher`.
    A plugin host built with this module in place of ``rollout.plugin`` lets a CPU test run the trainer's
    launch mode (``--rollout-engine sglang`` without ``--rollout-url``)."""
    return [RolloutEngine(name="sglang", description="the SGLang adapter for a fake server on the CPU (tests)",
                          factory="rollout.sglang_engine:make_sglang_engine", gpu=False, server=True,
                          routed_experts=True, weight_update=("tensor", "disk"),
                          publish_formats=("bf16", "fp8", "nvfp4"))]


def fake_sample(prompt: List[int], sp: Dict[str, Any], config) -> Dict[str, Any]:
    """One ``/generate`` answer, a function of the prompt and the sample's ``sampling_seed`` only."""
    import torch

    from rollout.sglang_engine import encode_routed_experts

    seed = int(sp.get("sampling_seed") or 0)
    max_new = int(sp["max_new_tokens"])
    stop = list(sp.get("stop_token_ids") or [])
    if seed % 2 == 0 and stop:                        # stops early with a stop token (kept: no_stop_trim)
        out = [2 + (seed // 7 ** k) % 256 for k in range(seed % max_new)] + [stop[0]]
        finish = {"type": "stop", "matched": stop[0]}
    else:                                             # runs to max_new_tokens
        out = [2 + (seed // 7 ** k) % 256 for k in range(max_new)]
        finish = {"type": "length", "length": max_new}
    rows = len(prompt) + len(out) - 1
    n_layers, k, n_experts = config.n_layers, config.n_activated_experts, config.n_routed_experts
    t = torch.arange(rows).view(-1, 1, 1)
    layer = torch.arange(n_layers).view(1, -1, 1)
    j = torch.arange(k).view(1, 1, -1)
    routed = (t * 7 + layer * 3 + seed % 5 + j) % n_experts          # k distinct experts per row and layer
    return {"text": "", "output_ids": out, "meta_info": {
        "output_token_logprobs": [[-0.25 - 0.01 * i, tok, None] for i, tok in enumerate(out)],
        "finish_reason": finish, "routed_experts": encode_routed_experts(routed)}}


class FakeSGLang:
    """A fake server on 127.0.0.1 (``port`` 0: a free one) for ``config`` (a ModelConfig)."""

    def __init__(self, config, *, tp_size: int = 1, port: int = 0, host: str = "127.0.0.1",
                 health_delay_s: float = 0.0, state_file: Optional[str] = None, info: Optional[Dict] = None):
        self.config, self.tp_size, self.state_file = config, tp_size, state_file
        self.ready_at = time.monotonic() + health_delay_s
        self.lock = threading.Lock()
        self.state: Dict[str, Any] = {"health_calls": 0, "generate": [], "versions": [], "info": dict(info or {}),
                                      "tp_entries": [], "calls": [], "released": False}
        self.pending: Dict[str, Any] = {}
        self.fail: Dict[str, str] = {}                # path -> the message of a refused request
        self.tensors: List[Dict[str, Any]] = []       # each version's tensors (in-process tests compare values)
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread: Optional[threading.Thread] = None

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> "FakeSGLang":
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _dump(self) -> None:
        if self.state_file:
            tmp = self.state_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.state, f)
            os.replace(tmp, self.state_file)

    # -- requests --------------------------------------------------------------
    def _version(self, tensors: Dict[str, Any], how: str) -> None:
        self.state["versions"].append({"how": how, "shapes": {n: list(t.shape) for n, t in tensors.items()}})
        self.tensors.append(tensors)

    def post(self, path: str, req: Dict[str, Any]):
        from rollout.sglang_engine import torch_b64_deserialize

        if path in self.fail:
            if path == "/generate":
                return 500, {"error": {"message": self.fail[path]}}
            return 200, {"success": False, "message": self.fail[path]}
        self.state["calls"].append(path)
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            # SGLang's memory-saver endpoints: the weights and KV cache are gone until resumed
            self.state["released"] = path == "/release_memory_occupation"
            return 200, {"success": True, "message": "ok"}
        if self.state["released"] and path in ("/generate", "/update_weights_from_tensor", "/update_weights_from_disk"):
            return 400, {"error": {"message": f"{path} while the memory is released (resume_memory_occupation first)"}}
        if path == "/generate":
            ids, sps = req["input_ids"], req["sampling_params"]
            if not isinstance(sps, list) or len(sps) != len(ids):
                return 400, {"error": "one sampling_params per input"}
            out = [fake_sample(p, sp, self.config) for p, sp in zip(ids, sps)]
            self.state["generate"].append({"inputs": len(ids), "seeds": [sp.get("sampling_seed") for sp in sps],
                                           "output_lengths": [len(a["output_ids"]) for a in out],
                                           "return_routed_experts": req.get("return_routed_experts")})
            return 200, out
        if path == "/update_weights_from_tensor":
            entries = req["serialized_named_tensors"]
            self.state["tp_entries"].append(len(entries))
            if len(entries) != self.tp_size:
                return 200, {"success": False, "message": f"{len(entries)} entries for tp_size {self.tp_size}"}
            self.pending.update(dict(torch_b64_deserialize(entries[0])))
            return 200, {"success": True, "message": "Succeeded to update parameter online."}
        if path == "/flush_cache":
            if self.pending:
                self._version(self.pending, "tensors")
                self.pending = {}
            return 200, "Cache flushed."
        if path == "/update_weights_from_disk":
            from core.checkpoint import open_checkpoint

            try:
                reader = open_checkpoint(req["model_path"])
                tensors = dict(reader.iter_tensors(dequantize=True))
            except Exception as exc:  # noqa: BLE001 - the answer carries the reason, as SGLang's does
                return 200, {"success": False, "message": f"cannot load {req['model_path']}: {exc}"}
            self._version(tensors, "disk:" + req["model_path"])
            return 200, {"success": True, "message": "Succeeded to update model weights."}
        if path == "/get_weights_by_name":
            t = (self.tensors[-1] if self.tensors else {}).get(req["name"])
            if t is None:
                return 200, None
            return 200, t.flatten()[: int(req.get("truncate_size", 100))].float().tolist()
        return 404, {"error": f"unknown path {path}"}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj) -> None:
                body = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(obj, str) else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                with fake.lock:
                    if self.path == "/health":
                        fake.state["health_calls"] += 1
                        fake._dump()
                        ok = time.monotonic() >= fake.ready_at
                        return self._send(200 if ok else 503, {} if ok else {"error": "starting"})
                    if self.path == "/get_server_info":
                        return self._send(200, {"tp_size": fake.tp_size, **fake.state["info"]})
                return self._send(404, {"error": "unknown"})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    code, obj = fake.post(self.path, req)
                    fake._dump()
                self._send(code, obj)

        return Handler


def main(argv=None) -> None:
    """``python -m sglang.launch_server ARGS`` as the launch tests run it (module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--fake-health-delay", type=float, default=0.0)
    p.add_argument("--fake-fail", nargs=2, action="append", default=[], metavar=("PATH", "MESSAGE"),
                   help="refuse requests to PATH with MESSAGE")
    args, _rest = p.parse_known_args(argv)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # a scheduler stand-in
    info = {"argv": list(sys.argv[1:] if argv is None else argv), "model_path": args.model_path,
            "worker_pid": worker.pid, "pid": os.getpid()}
    state_file = os.environ.get(STATE_ENV)
    if state_file:   # the processes to check for, written before torch's import (seconds on a loaded machine)
        Path(state_file).write_text(json.dumps({"info": info}))
    from core.checkpoint import open_checkpoint

    try:
        config = open_checkpoint(args.model_path).config
    except Exception as exc:  # noqa: BLE001
        print(f"fake sglang: cannot load --model-path {args.model_path}: {exc}", file=sys.stderr)
        worker.kill()
        sys.exit(3)
    fake = FakeSGLang(config, tp_size=args.tp_size, port=args.port, host=args.host,
                      health_delay_s=args.fake_health_delay, state_file=state_file, info=info)
    fake.state["info"] = info
    fake.fail.update(dict(args.fake_fail))
    fake._dump()
    print(f"fake sglang: serving {args.model_path} on {fake.url}", flush=True)
    fake.httpd.serve_forever()


if __name__ == "__main__":
    main()


def spare_port() -> int:
    """A port nothing listens on, for a test that gives the server its port (``sglang_port=P``) and checks the
    command line for it: the engine's own rule for a picked port (``core.ports.server_port``: below the kernel's
    ephemeral range, where every bind to port 0 and every connection's source port lands, and above Ray's worker
    ports), so between this check and the server's bind, seconds later, no other process of the machine takes it
    (a port from ``free_port`` was once taken by a Ray worker's gRPC server in that window, in CI)."""
    from core.ports import server_port

    return server_port()


def process_gone(pid: int, within_s: float = 10.0) -> bool:
    """True once process ``pid`` has exited (within ``within_s`` seconds): a started server was stopped. A zombie
    has exited (it holds no port, no memory): an orphan waits for the machine's init to reap it, which can take
    a second or more in a container."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass                           # no /proc (not Linux), or gone since (reaped between open and read: ESRCH)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
