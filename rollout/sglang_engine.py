"""SGLang rollout engine: start an SGLang server or connect to one, and talk to it over HTTP.

Two modes (``dsv4 train --rollout-engine sglang``; docs/training.md, "Rollout engines"):

* **launch** (no ``--rollout-url``; a GPU ``--hardware``): the trainer writes the run's starting weights as
  an HF checkpoint in the run's publish format (``RUN_DIR/sglang_init``, the factory's ``model_path``),
  and the engine starts ``python -m sglang.launch_server --model-path RUN_DIR/sglang_init --host 127.0.0.1
  --port P --tp-size N --trust-remote-code --skip-tokenizer-init --enable-return-routed-experts ...``
  (:func:`server_command`) in its own process group, its output in ``RUN_DIR/sglang_server.log``. It polls
  ``GET /health`` until the server answers 200 (a progress line every 30 s, at most
  ``sglang_startup_timeout_s``) and stops the whole group when the run ends, fails, or the start fails. The
  group's leader is a small watchdog (:mod:`rollout.sglang_guard`) that starts the server and stops the group
  when the engine's process dies without stopping it (SIGKILL, OOM): a killed owner takes its server down.
  ``P`` is ``sglang_port``, or with ``sglang_port=0`` (the default) a free port the engine picks; a picked port
  that another process takes before the server binds it is replaced and the server started again
  (:meth:`SGLangEngine.start`).
* **connect** (``--rollout-url http://HOST:PORT``): the server runs elsewhere, so any ``--hardware`` may
  use it. At start the engine asks ``GET /health`` once (an unreachable URL is a one-line error naming the
  URL and the fix) and, when the server reports it (``GET /get_server_info``), checks its ``tp_size``
  against ``sglang_tp_size``. It never stops that server.

Then, either way (SGLang's native HTTP API):

* generate: one ``POST /generate`` per call, with ``input_ids`` (each prompt ``n`` times) and one
  ``sampling_params`` per sample (temperature, top_p, top_k, max_new_tokens, stop_token_ids,
  ``no_stop_trim`` so the stop token is returned, and ``sampling_seed`` =
  :func:`rollout.reference_engine.sample_seed` of the call's seed, the prompt's index in the step and the sample's
  index), ``return_logprob`` and ``return_routed_experts``. Each answer's ``output_ids``,
  ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples), ``meta_info.finish_reason``
  and ``meta_info.routed_experts`` (base64 of int32, token-major ``[seq_len, n_layers, topk]``) become a
  :class:`rollout.reference_engine.Sample`; hash layers' entries are blanked (never replayed).
* weights, ``sglang_weight_sync=tensors`` (default): ``POST /update_weights_from_tensor`` per bucket with
  ``serialized_named_tensors`` (one entry per server TP rank), then ``POST /flush_cache``. The serializer
  is SGLang's ``MultiprocessingSerializer`` (CUDA IPC handles / shared memory: the server must run on the
  trainer's machine, and the sglang package must be installed there); tests substitute a base64
  ``torch.save`` stand-in that their fake server reads.
* weights, ``sglang_weight_sync=disk``: the buckets are decoded and written as an HF checkpoint
  (``RUN_DIR/sglang_weights``, replaced each step; :mod:`core.checkpoint`) and ``POST
  /update_weights_from_disk`` with ``model_path`` asks the server to reload from it (a remote server must
  see that folder).
* spot checks: ``POST /get_weights_by_name`` (``name``, ``truncate_size``).

SGLang cannot run on the project's machines (no GPU there, no sglang package). The tests
(tests/train/test_sglang_adapter.py, tests/train/test_sglang_training.py, tests/train/test_sglang_launch.py)
run this module against fake HTTP servers on 127.0.0.1, launch mode included (a fake ``sglang.launch_server``
first on the server's ``PYTHONPATH``) - the request and answer formats above are SGLang's as documented and
read from its source, not checked against a real server.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from core.errors import UserInputError

from .reference_engine import RolloutEngineBase, Sample, SamplingParams, sample_seed

log = logging.getLogger("dsv4")

INIT_DIR = "sglang_init"            # launch mode: the run's starting weights (written by the trainer)
WEIGHTS_DIR = "sglang_weights"      # sglang_weight_sync=disk: the weights of the current step
SERVER_LOG = "sglang_server.log"    # launch mode: the server's output
WEIGHT_SYNC = {"tensors": "tensor", "disk": "disk"}    # the setting -> the record's weight_update names
SERIALIZER_ENV = "DSV4_SGLANG_SERIALIZER"    # tests: "torch-b64" selects the fake server's format
GUARD = str(Path(__file__).with_name("sglang_guard.py"))   # launch mode: the server's watchdog (run by path)
START_COMMAND = ("python -m sglang.launch_server --model-path HF_CHECKPOINT --port PORT --trust-remote-code "
                 "--skip-tokenizer-init --enable-return-routed-experts")


class SGLangError(RuntimeError):
    pass


class SGLangSetupError(SGLangError, UserInputError):
    """The engine cannot start with what it was given (an unreachable URL, a missing package); one line with
    the fix."""


@dataclass(frozen=True)
class SGLangServerConfig:
    model_path: Optional[str] = None             # launch mode: the HF checkpoint the server loads
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dtype: Optional[str] = None                  # e.g. "bfloat16"
    mem_fraction_static: Optional[float] = None
    return_routed_experts: bool = True
    skip_tokenizer_init: bool = True             # dsv4 sends token ids; its byte tokenizer is not an HF one
    quantization: Optional[str] = None           # e.g. "fp8"
    python: str = sys.executable
    extra_args: Tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    url: Optional[str] = None                    # connect mode: the server's address (host / port unused)
    enable_memory_saver: bool = False            # colocated: the server can release its weights and KV cache
    port_picked: bool = False                    # launch mode: ``port`` was picked free (sglang_port 0), not given

    def with_port(self, port: int) -> "SGLangServerConfig":
        return dataclasses.replace(self, port=port)

    @property
    def base_url(self) -> str:
        return self.url or f"http://{self.host}:{self.port}"


def server_command(cfg: SGLangServerConfig) -> List[str]:
    if not cfg.model_path:
        raise SGLangError("starting an SGLang server needs model_path (an HF checkpoint it can load)")
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(cfg.port), "--tp-size", str(cfg.tp_size), "--trust-remote-code"]
    if cfg.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    if cfg.dtype:
        cmd += ["--dtype", cfg.dtype]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.quantization:
        cmd += ["--quantization", cfg.quantization]
    if cfg.return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    if cfg.enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    return cmd + list(cfg.extra_args)


# ------------------------------------------------------------ serializers
def torch_b64_serialize(named: List[Tuple[str, torch.Tensor]]) -> str:
    """Stand-in serializer (tests / a CPU fake server): base64 of ``torch.save([(name, tensor), ...])``."""
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def torch_b64_deserialize(s: str) -> List[Tuple[str, torch.Tensor]]:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


def sglang_serializer() -> Callable[[List[Tuple[str, torch.Tensor]]], str]:
    """SGLang's own serializer; ``DSV4_SGLANG_SERIALIZER=torch-b64`` names the stand-in instead (what the fake
    server of the tests reads: the Ray engine actors run in processes a test cannot patch, and inherit
    ``DSV4_*``)."""
    chosen = os.environ.get(SERIALIZER_ENV)
    if chosen:
        if chosen != "torch-b64":
            raise SGLangSetupError(f"{SERIALIZER_ENV}={chosen}: the only stand-in serializer is torch-b64. Fix: "
                                   f"unset {SERIALIZER_ENV} to use SGLang's own")
        return torch_b64_serialize
    try:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore
    except ImportError:
        raise SGLangSetupError(
            "sglang_weight_sync=tensors sends tensors with SGLang's MultiprocessingSerializer (CUDA IPC: the "
            "server shares this machine), and the sglang package is not installed here. Fix: install sglang, "
            f"or use sglang_weight_sync=disk (the server must be able to read RUN_DIR/{WEIGHTS_DIR})") from None
    return lambda named: MultiprocessingSerializer.serialize(named, output_str=True)


def decode_routed_experts(b64: str, n_layers: int, topk: int) -> torch.Tensor:
    raw = base64.b64decode(b64)
    t = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.long)
    per = n_layers * topk
    if t.numel() % per:
        raise SGLangError(f"routed_experts has {t.numel()} entries, not a multiple of n_layers*topk = {per}")
    return t.view(-1, n_layers, topk)


def encode_routed_experts(t: torch.Tensor) -> str:
    return base64.b64encode(t.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def _reason(exc: BaseException) -> str:
    """The one-line reason of a failed request (``Connection refused``, ``timed out``, ...)."""
    reason = getattr(exc, "reason", None) or exc
    text = getattr(reason, "strerror", None) or str(reason)
    return " ".join(str(text).split()) or type(exc).__name__


def _exit_status(proc: subprocess.Popen) -> Optional[int]:
    """The exit code of ``proc`` once it has exited, else None - without reaping it (``WNOWAIT``)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    return None if info is None else info.si_status


#: Launch mode on a picked port: how many ports a start tries. A port is picked free (``core.ports.server_port``)
#: and bound by the server seconds later, after its imports; another process that binds a port of its own in
#: between (a Ray worker's gRPC server) can take it. Three picks in a row taken is not a race any more.
PORT_ATTEMPTS = 3


class _PortTaken(SGLangError):
    """Launch mode: the server's port is held by another process (the server could not bind it)."""


def _listened_on(host: str, port: int) -> bool:
    """Whether a process listens on ``host:port`` (binding it fails; ``SO_REUSEADDR``: a closed connection's
    TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _says_address_in_use(log_file: Optional[Path], tail_bytes: int = 8192) -> bool:
    """Whether the end of the server's output says its bind failed (``[Errno 98] Address already in use``, as
    Python's socket error and uvicorn word it): the port was taken, even if it is free again by now."""
    if log_file is None:
        return False
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            return b"address already in use" in f.read().lower()
    except OSError:
        return False


def guarded_command(cmd: Sequence[str]) -> List[str]:
    """``cmd`` run under :mod:`rollout.sglang_guard` for this process: the server stops when this process dies.
    The guard asks for Linux's parent-death signal only when called from the main thread (the signal follows
    the thread that forks, and the main thread lives as long as the process); from any other thread it relies
    on polling its parent alone."""
    import threading

    pdeathsig = threading.current_thread() is threading.main_thread()
    return [sys.executable, "-I", GUARD, str(os.getpid()), "1" if pdeathsig else "0", "--", *cmd]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)   # the guard is its group's leader (start_new_session), the server in it
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------- engine
class SGLangEngine(RolloutEngineBase):
    name = "sglang"

    def __init__(self, config, server: SGLangServerConfig, *, launch: bool = True,
                 serializer: Optional[Callable] = None, weight_update: str = "tensor",
                 disk_dir: Optional[str] = None, disk_format: str = "bf16", log_file: Optional[str] = None,
                 progress_every_s: float = 30.0, **_ignored):
        if weight_update not in WEIGHT_SYNC.values():
            raise SGLangError(f"weight_update must be one of {sorted(WEIGHT_SYNC.values())}, got {weight_update!r}")
        self.config, self.server = config, server
        self.serializer = serializer
        self.weight_update = weight_update
        self.disk_dir, self.disk_format = disk_dir, disk_format
        self.log_file, self.progress_every_s = log_file, progress_every_s
        self.proc: Optional[subprocess.Popen] = None
        self._log_handle = None
        self._bucket_count = 0
        self._disk_tensors: Optional[Dict[str, torch.Tensor]] = None
        self.version: Optional[int] = None
        self._released = False
        if launch:
            self.start()

    # -- process -----------------------------------------------------------
    def start(self) -> None:
        """Launch mode: start the server in its own process group and wait for it; a failed start stops it.

        The group's leader is :mod:`rollout.sglang_guard` (:func:`guarded_command`), which starts the server and
        stops the group when this process dies without calling :meth:`shutdown` (a SIGKILLed Ray engine actor):
        a server in a session of its own would otherwise outlive its owner.

        A port the engine picked (``sglang_port`` 0) that another process took before the server bound it (the
        server exited and something else listens there, or what answers there does not speak HTTP) is replaced
        by a newly picked one and the server started again, :data:`PORT_ATTEMPTS` times at most; a port the user
        gave is one error naming it."""
        from core.ports import server_port

        for attempt in range(1, PORT_ATTEMPTS + 1):
            cmd = server_command(self.server)
            log.info(f"sglang: starting {shlex.join(cmd)}" + (f" (output: {self.log_file})" if self.log_file else ""))
            if self.log_file:
                self._log_handle = open(self.log_file, "ab")
            out = self._log_handle
            try:
                self.proc = subprocess.Popen(guarded_command(cmd), stdout=out,
                                             stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
                self.wait_ready()
                return
            except _PortTaken as taken:
                self.shutdown()
                if not self.server.port_picked:
                    raise SGLangError(f"{taken}. Fix: free port {self.server.port}, or set sglang_port to another "
                                      f"port (0: a free one)") from None
                if attempt == PORT_ATTEMPTS:
                    raise SGLangError(f"{taken}, and so were the {PORT_ATTEMPTS - 1} free ports picked before it"
                                      ) from None
                port = server_port()
                log.warning(f"sglang: {taken}; starting it again on port {port}")
                self.server = self.server.with_port(port)
            except BaseException:
                self.shutdown()
                raise

    def wait_ready(self) -> None:
        """Poll ``GET /health`` until the server answers 200 (a progress line every ``progress_every_s``).
        Launch mode: a server that exits while another process listens on its port, or an answer there that is
        not HTTP (the server's own port held by something else), is :class:`_PortTaken`."""
        url = self.server.base_url
        t0 = time.monotonic()
        deadline, next_note = t0 + self.server.startup_timeout_s, t0 + self.progress_every_s
        where = f"; its output: {self.log_file}" if self.log_file else ""
        while time.monotonic() < deadline:
            code = _exit_status(self.proc) if self.proc is not None else None
            if code is not None:
                if _listened_on(self.server.host, self.server.port):
                    raise _PortTaken(f"the SGLang server exited with code {code} during start-up, and another "
                                     f"process listens on its port {self.server.port}{where}")
                if _says_address_in_use(self.log_file):       # held when it bound, released since
                    raise _PortTaken(f"the SGLang server exited with code {code} during start-up: its port "
                                     f"{self.server.port} was in use when it bound it{where}")
                raise SGLangError(f"the SGLang server exited with code {code} during start-up{where}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        log.info(f"sglang: server at {url} ready after {time.monotonic() - t0:.0f} s")
                        return
            except (urllib.error.URLError, OSError):     # not listening yet, or closed without an answer
                pass
            except http.client.HTTPException as exc:     # an answer that is not HTTP (BadStatusLine): not SGLang
                if self.proc is None:
                    raise SGLangSetupError(f"--rollout-url {url}: what answers GET /health there does not speak "
                                           f"HTTP ({_reason(exc)[:80]}). Fix: give the URL of an SGLang server"
                                           ) from None
                raise _PortTaken(f"another process holds the SGLang server's port {self.server.port} (its answer "
                                 f"to GET /health is not HTTP: {_reason(exc)[:80]})") from None
            if time.monotonic() >= next_note:
                log.info(f"sglang: waiting for {url}/health ({time.monotonic() - t0:.0f} s of "
                         f"{self.server.startup_timeout_s:.0f} s)")
                next_note += self.progress_every_s
            time.sleep(0.5)
        raise SGLangError(f"the SGLang server at {url} did not answer /health within "
                          f"{self.server.startup_timeout_s:.0f} s (sglang_startup_timeout_s){where}")

    def connect(self) -> None:
        """Connect mode: the server at the URL must answer ``GET /health``; a server that answers but is not
        ready yet (e.g. 503) is waited for like a started one. Its TP size is checked when it reports one."""
        url = self.server.base_url
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                ready = r.status == 200
        except urllib.error.HTTPError:
            ready = False
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise SGLangSetupError(
                f"--rollout-url {url}: no SGLang server answers GET /health ({_reason(exc)}). Fix: start one there "
                f"({START_COMMAND}) and wait until it answers, or leave --rollout-url out to let dsv4 start one "
                f"(a GPU --hardware)") from None
        if not ready:
            self.wait_ready()
        self._check_tp_size()
        log.info(f"sglang: connected to {url}")

    def _check_tp_size(self) -> None:
        try:
            with urllib.request.urlopen(self.server.base_url + "/get_server_info", timeout=10) as r:
                info = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            return                      # the server does not report its arguments: nothing to compare
        tp = info.get("tp_size") if isinstance(info, dict) else None
        if tp is not None and int(tp) != self.server.tp_size:
            raise SGLangSetupError(f"--rollout-url {self.server.base_url}: the server runs --tp-size {tp}, and "
                                   f"sglang_tp_size is {self.server.tp_size} (one serialized copy of each weight "
                                   f"bucket per server TP rank). Fix: sglang_tp_size={tp}")

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop a server this engine started: SIGTERM to its process group, SIGKILL to what is left of the
        group after ``grace_s`` or once the group's leader (the guard, which exits with the server) has exited
        (SGLang's worker processes). The leader is reaped last, so its group id cannot have been reused. A
        connected server is left running."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.returncode is None:
                _signal_group(proc, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while _exit_status(proc) is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                _signal_group(proc, signal.SIGKILL)
            proc.wait()
            log.info(f"sglang: stopped the server at {self.server.base_url}")
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    # -- HTTP --------------------------------------------------------------
    def _post(self, path: str, payload: Dict, *, json_answer: bool = True):
        req = urllib.request.Request(self.server.base_url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.server.request_timeout_s) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"POST {self.server.base_url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise SGLangError(f"POST {self.server.base_url}{path}: {_reason(e)}") from None
        if not json_answer:
            return body.decode("utf-8", errors="replace")
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise SGLangError(f"POST {path}: answer is not JSON: {body[:200]!r}") from None

    @staticmethod
    def _check_success(path: str, ans) -> None:
        if isinstance(ans, dict) and ans.get("success") is False:
            raise SGLangError(f"POST {path} failed: {ans.get('message', ans)}")

    # -- generation --------------------------------------------------------
    def generation_payload(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int, *,
                           seed: int, first_prompt: int = 0) -> Dict:
        """One request for every prompt x ``n`` samples, each sample with its own ``sampling_seed``."""
        common = {"temperature": params.temperature, "top_p": params.top_p,
                  "top_k": params.top_k if params.top_k else -1, "max_new_tokens": params.max_new_tokens,
                  "stop_token_ids": list(params.stop_token_ids), "no_stop_trim": True, "skip_special_tokens": False}
        input_ids, sampling = [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                input_ids.append(list(map(int, prompt)))
                sampling.append({**common, "sampling_seed": sample_seed(seed, first_prompt + i, j)})
        return {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                "return_routed_experts": self.server.return_routed_experts}

    def parse_answer(self, prompt: Sequence[int], ans: Dict, params: SamplingParams) -> Sample:
        meta = ans.get("meta_info") or {}
        out_ids = [int(i) for i in ans.get("output_ids") or []]
        lp_triples = meta.get("output_token_logprobs") or []
        if len(lp_triples) != len(out_ids):
            raise SGLangError(f"/generate: {len(out_ids)} output ids but {len(lp_triples)} logprobs")
        for (lp, tid, *_), oid in zip(lp_triples, out_ids):
            if int(tid) != oid:
                raise SGLangError(f"/generate: logprob entry for token {tid} does not match output id {oid}")
        logprobs = torch.tensor([float(x[0]) for x in lp_triples], dtype=torch.float32)
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        finish = "stop" if kind in ("stop", "eos") or (out_ids and out_ids[-1] in params.stop_token_ids) else "length"
        routed = None
        if self.server.return_routed_experts and meta.get("routed_experts") is not None:
            routed = decode_routed_experts(meta["routed_experts"], self.config.n_layers,
                                           self.config.n_activated_experts)
            want = len(prompt) + len(out_ids) - 1
            if routed.shape[0] < want:
                pad = torch.full((want - routed.shape[0],) + tuple(routed.shape[1:]), -1, dtype=torch.long)
                routed = torch.cat([routed, pad])
            routed = routed[:want].clone()
            # hash layers are never replayed: blank them whatever the server reports
            for layer in range(self.config.n_layers):
                if self.config.is_hash_layer(layer):
                    routed[:, layer] = -1
        return Sample(list(map(int, prompt)), out_ids, logprobs, finish, routed)

    def generate(self, prompts, params: SamplingParams, *, n: int, seed: int,
                 first_prompt: int = 0) -> List[List[Sample]]:
        if not prompts:
            return []
        ans = self._post("/generate", self.generation_payload(prompts, params, n, seed=seed,
                                                              first_prompt=first_prompt))
        if isinstance(ans, dict):
            ans = [ans]
        if len(ans) != n * len(prompts):
            raise SGLangError(f"/generate: asked for {len(prompts)} prompts x {n} samples, got {len(ans)} answers")
        return [[self.parse_answer(prompt, a, params) for a in ans[i * n:(i + 1) * n]]
                for i, prompt in enumerate(prompts)]

    # -- colocated mode ----------------------------------------------------
    # SGLang's memory-occupation endpoints: release frees the server's weights and KV cache while the trainer
    # uses the GPUs; the next update resumes them first and then sends every tensor (the trainer always does).
    def release_memory(self) -> None:
        if not self._released:
            self._check_success("/release_memory_occupation", self._post("/release_memory_occupation", {}))
            self._released = True

    def resume_memory(self) -> None:
        if self._released:
            self._check_success("/resume_memory_occupation", self._post("/resume_memory_occupation", {}))
            self._released = False

    def assume_released(self) -> None:
        """The server's memory was released by an earlier engine on it (a restarted Ray engine actor connecting to
        the server its last process released): resume it at the next update."""
        self._released = True

    # -- weights -----------------------------------------------------------
    def begin_update(self, version: int) -> None:
        self.resume_memory()
        self._bucket_count = 0
        self._next_version = version
        self._disk_tensors = {} if self.weight_update == "disk" else None

    def load_bucket(self, bucket) -> None:
        if self.weight_update == "disk":
            from .reference_engine import decode_published

            self._disk_tensors.update(decode_published(bucket, torch.float32))
            return
        if self.serializer is None:
            self.serializer = sglang_serializer()
        ser = self.serializer
        payload = {"serialized_named_tensors": [ser(bucket) for _ in range(self.server.tp_size)],
                   "load_format": None, "flush_cache": False}
        self._check_success("/update_weights_from_tensor", self._post("/update_weights_from_tensor", payload))
        self._bucket_count += 1

    def finish_update(self) -> None:
        if self.weight_update == "disk":
            from core.checkpoint import write_checkpoint

            if not self.disk_dir:
                raise SGLangError("weight_update='disk' needs disk_dir")
            path = write_checkpoint(self.disk_dir, self.config, self._disk_tensors, weight_format=self.disk_format,
                                    quantize=True, overwrite=True, progress=False)
            self._disk_tensors = None
            ans = self._post("/update_weights_from_disk", {"model_path": str(path)})
            self._check_success("/update_weights_from_disk", ans)
        else:
            self._post("/flush_cache", {}, json_answer=False)  # answers plain text
        self.version = self._next_version

    def weights_by_name(self, name: str, truncate_size: int = 100) -> List[float]:
        ans = self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        return torch.tensor(ans, dtype=torch.float32).flatten().tolist()


# The engine's settings when its factory is given no trainer settings; the trainer's TrainConfig takes its
# defaults from here (train.trainer), so the two never disagree.
DEFAULT_SETTINGS = {
    "sglang_weight_sync": "tensors",
    "sglang_tp_size": 1,
    "sglang_port": 0,
    "sglang_server_args": "",
    "sglang_startup_timeout_s": 900.0,
    "colocate": False,
}


def _setting(settings, name: str):
    """A ``sglang_*`` field of the trainer's settings (a TrainConfig), else its default (:data:`DEFAULT_SETTINGS`)."""
    if settings is not None and hasattr(settings, name):
        return getattr(settings, name)
    return DEFAULT_SETTINGS[name]


def make_sglang_engine(config, *, url: Optional[str] = None, model_path: Optional[str] = None,
                       settings=None, run_dir=None, publish_format: str = "bf16",
                       server: Optional[SGLangServerConfig] = None, serializer: Optional[Callable] = None,
                       port: Optional[int] = None, **kwargs) -> SGLangEngine:
    """Factory named by the ``sglang`` RolloutEngine record: connect to ``url`` (``--rollout-url``), or start a
    server on ``model_path`` (the trainer's export of the starting weights). ``settings``: the trainer's
    TrainConfig (``sglang_weight_sync``, ``sglang_port``, ``sglang_tp_size``, ``sglang_startup_timeout_s``,
    ``sglang_server_args``); ``run_dir``: where the server log and the disk-sync weights go;
    ``publish_format``: the format of the weights the trainer sends; ``port``: a started server's port (else
    ``sglang_port``, 0 = a free one); the Ray launcher also gives each engine actor its own ``log_file`` and
    ``disk_dir`` (orchestration.ray_engines)."""
    from core.ports import server_port

    from .weight_sync import checkpoint_format

    kwargs.pop("dtype", None)     # the server loads the checkpoint's dtype on its own GPUs
    kwargs.pop("device", None)
    kwargs.pop("ops", None)       # ... and runs its own kernels
    sync = _setting(settings, "sglang_weight_sync")
    if sync not in WEIGHT_SYNC:
        raise SGLangSetupError(f"sglang_weight_sync must be one of {', '.join(WEIGHT_SYNC)} (got {sync!r})")
    run = Path(run_dir) if run_dir is not None else None
    if sync == "disk":
        if run is None:
            raise SGLangError("sglang_weight_sync=disk needs the run folder (run_dir)")
        kwargs.setdefault("disk_dir", str(run / WEIGHTS_DIR))
        kwargs.setdefault("disk_format", checkpoint_format(publish_format, purpose="sglang_weight_sync=disk"))
    timeout = float(_setting(settings, "sglang_startup_timeout_s"))
    tp = int(_setting(settings, "sglang_tp_size"))
    if url is not None:
        server = server or SGLangServerConfig(url=url, tp_size=tp, startup_timeout_s=timeout)
        engine = SGLangEngine(config, server, launch=False, serializer=serializer, weight_update=WEIGHT_SYNC[sync],
                              **kwargs)
        engine.connect()
    else:
        if server is None:
            if model_path is None:
                raise SGLangError("starting an SGLang server needs model_path (an HF checkpoint it can load)")
            given = port or int(_setting(settings, "sglang_port"))
            server = SGLangServerConfig(model_path=str(model_path), port=given or server_port(), tp_size=tp,
                                        startup_timeout_s=timeout, port_picked=not given,
                                        extra_args=tuple(shlex.split(_setting(settings, "sglang_server_args"))),
                                        enable_memory_saver=bool(_setting(settings, "colocate")))
        if run is not None:
            kwargs.setdefault("log_file", str(run / SERVER_LOG))
        engine = SGLangEngine(config, server, launch=False, serializer=serializer, weight_update=WEIGHT_SYNC[sync],
                              **kwargs)
    if engine.weight_update == "tensor" and engine.serializer is None:
        engine.serializer = sglang_serializer()   # before a server starts: a missing package is one line
    if url is None:
        engine.start()
    return engine
