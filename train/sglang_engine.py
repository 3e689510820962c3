"""SGLang rollout engine adapter: start an SGLang server and talk to it over HTTP.

What it does (SGLang's native HTTP API):

* start: ``python -m sglang.launch_server --model-path M --host H --port P --tp-size N
  --trust-remote-code [--enable-return-routed-experts] ...`` (:func:`server_command`), then poll
  ``GET /health`` until it answers 200;
* generate: ``POST /generate`` with ``input_ids`` (the prompt repeated ``n`` times),
  ``sampling_params`` (temperature, top_p, max_new_tokens, stop_token_ids, ``no_stop_trim`` so the
  stop token is returned), ``return_logprob`` and ``return_routed_experts``; each answer's
  ``output_ids``, ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples),
  ``meta_info.finish_reason.type`` and ``meta_info.routed_experts`` (base64 of int32, ordered
  token-major as ``[seq_len, n_moe_layers, topk]``) become :class:`train.engines.Sample` s;
* weights from tensors: ``POST /update_weights_from_tensor`` with ``serialized_named_tensors`` (one
  entry per TP rank) and ``flush_cache`` on the last bucket. The serializer is pluggable: by default
  SGLang's ``MultiprocessingSerializer`` (CUDA IPC handles: the trainer must share the GPU host), in
  tests a base64 ``torch.save`` stand-in understood by the fake server;
* weights from disk: write an HF checkpoint (:mod:`core.checkpoint`) and ``POST
  /update_weights_from_disk`` with ``model_path``;
* check: ``POST /get_weights_by_name`` (``name``, ``truncate_size``) for spot checks of a few tensors.

It cannot run on a machine without a GPU. Its tests (tests/train/test_sglang_adapter.py) check the
command line and the request/response handling against a fake HTTP server on 127.0.0.1 - they do NOT
run SGLang.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .engines import RolloutEngineBase, Sample, SamplingParams


class SGLangError(RuntimeError):
    pass


@dataclass(frozen=True)
class SGLangServerConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dtype: Optional[str] = None                  # e.g. "bfloat16"
    mem_fraction_static: Optional[float] = None
    return_routed_experts: bool = True
    quantization: Optional[str] = None           # e.g. "fp8"
    python: str = sys.executable
    extra_args: Tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(cfg: SGLangServerConfig) -> List[str]:
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(cfg.port), "--tp-size", str(cfg.tp_size), "--trust-remote-code"]
    if cfg.dtype:
        cmd += ["--dtype", cfg.dtype]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.quantization:
        cmd += ["--quantization", cfg.quantization]
    if cfg.return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
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
    try:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore
    except ImportError as e:
        raise SGLangError("update_weights_from_tensor needs the sglang package (MultiprocessingSerializer)") from e
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


# ----------------------------------------------------------------- engine
class SGLangEngine(RolloutEngineBase):
    name = "sglang"

    def __init__(self, config, server: SGLangServerConfig, *, launch: bool = True,
                 serializer: Optional[Callable] = None, weight_update: str = "tensor",
                 disk_dir: Optional[str] = None, **_ignored):
        self.config, self.server = config, server
        self.serializer = serializer
        self.weight_update = weight_update
        self.disk_dir = disk_dir
        self.proc: Optional[subprocess.Popen] = None
        self._bucket_count = 0
        self._disk_tensors: Optional[List[Tuple[str, torch.Tensor]]] = None
        self.version: Optional[int] = None
        if launch:
            self.start()

    # -- process -----------------------------------------------------------
    def start(self) -> None:
        self.proc = subprocess.Popen(server_command(self.server))
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.server.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SGLangError(f"SGLang server exited with code {self.proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(self.server.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise SGLangError(f"SGLang server at {self.server.base_url} not healthy after "
                          f"{self.server.startup_timeout_s:.0f}s")

    def shutdown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    # -- HTTP --------------------------------------------------------------
    def _post(self, path: str, payload: Dict, *, json_answer: bool = True):
        req = urllib.request.Request(self.server.base_url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.server.request_timeout_s) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SGLangError(f"POST {path}: {e}") from None
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
    def generation_payload(self, prompt: Sequence[int], params: SamplingParams, n: int) -> Dict:
        return {
            "input_ids": [list(map(int, prompt)) for _ in range(n)],
            "sampling_params": {"temperature": params.temperature, "top_p": params.top_p,
                                "top_k": params.top_k if params.top_k else -1,
                                "max_new_tokens": params.max_new_tokens,
                                "stop_token_ids": list(params.stop_token_ids), "no_stop_trim": True,
                                "skip_special_tokens": False},
            "return_logprob": True,
            "return_routed_experts": self.server.return_routed_experts,
        }

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
        out = []
        for prompt in prompts:
            ans = self._post("/generate", self.generation_payload(prompt, params, n))
            if isinstance(ans, dict):
                ans = [ans]
            if len(ans) != n:
                raise SGLangError(f"/generate: asked for {n} samples, got {len(ans)}")
            out.append([self.parse_answer(prompt, a, params) for a in ans])
        return out

    # -- weights -----------------------------------------------------------
    def begin_update(self, version: int) -> None:
        self._bucket_count = 0
        self._next_version = version
        self._disk_tensors = [] if self.weight_update == "disk" else None

    def load_bucket(self, bucket) -> None:
        if self.weight_update == "disk":
            self._disk_tensors.extend(bucket)
            return
        ser = self.serializer or sglang_serializer()
        payload = {"serialized_named_tensors": [ser(bucket) for _ in range(self.server.tp_size)],
                   "load_format": None, "flush_cache": False}
        self._check_success("/update_weights_from_tensor", self._post("/update_weights_from_tensor", payload))
        self._bucket_count += 1

    def finish_update(self) -> None:
        if self.weight_update == "disk":
            from core.checkpoint import write_checkpoint

            if not self.disk_dir:
                raise SGLangError("weight_update='disk' needs disk_dir")
            path = write_checkpoint(self.disk_dir, self.config, self._disk_tensors, weight_format="bf16",
                                    quantize=True, overwrite=True, progress=False)
            ans = self._post("/update_weights_from_disk", {"model_path": str(path)})
            self._check_success("/update_weights_from_disk", ans)
        else:
            self._post("/flush_cache", {}, json_answer=False)  # answers plain text
        self.version = self._next_version

    def weights_by_name(self, name: str, truncate_size: int = 100) -> List[float]:
        ans = self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        return torch.tensor(ans, dtype=torch.float32).flatten().tolist()


def make_sglang_engine(config, *, server: Optional[SGLangServerConfig] = None, model_path: Optional[str] = None,
                       **kwargs) -> SGLangEngine:
    """Factory named by the ``sglang`` RolloutEngine record."""
    kwargs.pop("dtype", None)     # the server loads the checkpoint's dtype on its own GPUs
    kwargs.pop("device", None)
    if server is None:
        if model_path is None:
            raise SGLangError("the sglang engine needs model_path (an HF checkpoint SGLang can load)")
        server = SGLangServerConfig(model_path=model_path)
    return SGLangEngine(config, server, **kwargs)
