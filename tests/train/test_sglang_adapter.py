"""SGLang adapter WITHOUT SGLang: these tests check the server command line and the HTTP
request/response handling against a fake server on 127.0.0.1. They do not run SGLang (it needs a
GPU and the sglang package); nothing here says the adapter works against a real server."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from core.config import preset
from train.engines import SamplingParams
from train.sglang_engine import (SGLangEngine, SGLangError, SGLangServerConfig, encode_routed_experts,
                                 server_command, torch_b64_deserialize, torch_b64_serialize)

CFG = preset("tiny")   # 4 trunk layers, layers 0-1 hash-routed, top-2


class FakeSGLang(BaseHTTPRequestHandler):
    state = {}

    def log_message(self, *a):
        pass

    def _send(self, obj, code=200, raw=None):
        body = raw.encode() if raw is not None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({}) if self.path == "/health" else self._send({"error": "no"}, 404)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        st = self.state
        st.setdefault("requests", []).append((self.path, req))
        if self.path == "/generate":
            out = []
            for k, ids in enumerate(req["input_ids"]):
                n_out = 2 + k % 2
                out_ids = [10 + k, 11][:1] + [1] if n_out == 2 else [10 + k, 12, 13]
                routed = torch.arange((len(ids) + len(out_ids) - 1) * 4 * 2).view(-1, 4, 2) % 8
                out.append({"text": "", "output_ids": out_ids, "meta_info": {
                    "output_token_logprobs": [[-0.5 - j, t, None] for j, t in enumerate(out_ids)],
                    "finish_reason": {"type": "stop" if out_ids[-1] == 1 else "length"},
                    "routed_experts": encode_routed_experts(routed)}})
            self._send(out)
        elif self.path == "/update_weights_from_tensor":
            for s in req["serialized_named_tensors"][:1]:
                st.setdefault("weights", {}).update(dict(torch_b64_deserialize(s)))
            self._send({"success": True, "message": "ok"})
        elif self.path == "/update_weights_from_disk":
            st["disk"] = req["model_path"]
            self._send({"success": not st.get("fail_disk"), "message": "bad path" if st.get("fail_disk") else "ok"})
        elif self.path == "/flush_cache":
            self._send(None, raw="Cache flushed.")
        elif self.path == "/get_weights_by_name":
            self._send([[0.5, 0.25]])
        else:
            self._send({"error": "unknown"}, 404)


@pytest.fixture()
def server():
    FakeSGLang.state = {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd.server_address[1], FakeSGLang.state
    httpd.shutdown()
    httpd.server_close()


def _engine(port, **kw):
    cfg = SGLangServerConfig(model_path="/m", port=port, tp_size=2, startup_timeout_s=5, request_timeout_s=5)
    e = SGLangEngine(CFG, cfg, launch=False, serializer=torch_b64_serialize, **kw)
    e.wait_ready()
    return e


def test_server_command_line():
    cmd = server_command(SGLangServerConfig(model_path="/ckpt", port=31000, tp_size=8, dtype="bfloat16",
                                            mem_fraction_static=0.7, extra_args=("--foo",), python="py"))
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "127.0.0.1",
                   "--port", "31000", "--tp-size", "8", "--trust-remote-code", "--dtype", "bfloat16",
                   "--mem-fraction-static", "0.7", "--enable-return-routed-experts", "--foo"]
    assert "--enable-return-routed-experts" not in server_command(
        SGLangServerConfig(model_path="/c", return_routed_experts=False))


def test_generate_request_and_response_parsing(server):
    port, st = server
    e = _engine(port)
    groups = e.generate([[0, 5, 6]], SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3), n=2, seed=0)
    path, req = st["requests"][-1]
    assert path == "/generate"
    assert req["input_ids"] == [[0, 5, 6], [0, 5, 6]]
    assert req["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 3,
                                      "stop_token_ids": [1],
                                      "no_stop_trim": True, "skip_special_tokens": False}
    assert req["return_logprob"] is True and req["return_routed_experts"] is True
    a, b = groups[0]
    assert a.response_ids == [10, 1] and a.finish_reason == "stop"
    assert b.response_ids == [11, 12, 13] and b.finish_reason == "length"
    assert torch.allclose(b.logprobs, torch.tensor([-0.5, -1.5, -2.5]))
    assert a.routed_experts.shape == (3 + 2 - 1, 4, 2)
    assert (a.routed_experts[:, :2] == -1).all()          # hash layers blanked: never replayed
    assert (a.routed_experts[:, 2:] >= 0).all()


def test_weight_update_from_tensors_and_flush(server):
    port, st = server
    e = _engine(port)
    e.begin_update(7)
    e.load_bucket([("embed.weight", torch.ones(2, 2))])
    e.load_bucket([("head.weight", torch.zeros(3))])
    e.finish_update()
    assert e.version == 7
    paths = [p for p, _ in st["requests"]]
    assert paths == ["/update_weights_from_tensor", "/update_weights_from_tensor", "/flush_cache"]
    assert len(st["requests"][0][1]["serialized_named_tensors"]) == 2    # one per TP rank
    assert torch.equal(st["weights"]["embed.weight"], torch.ones(2, 2))
    assert e.weights_by_name("embed.weight") == [0.5, 0.25]


def test_weight_update_from_disk_reports_server_failure(server, tmp_path):
    from core.export import export_buckets
    from train.model import build_train_model

    port, st = server
    e = _engine(port, weight_update="disk", disk_dir=str(tmp_path / "w"))
    m = build_train_model(CFG)
    e.begin_update(1)
    for b in export_buckets(m.native_tensors(), CFG, max_bucket_bytes=1 << 30):
        e.load_bucket(b)
    st["fail_disk"] = True
    with pytest.raises(SGLangError, match="bad path"):
        e.finish_update()
    assert st["disk"] == str(tmp_path / "w")
    assert (tmp_path / "w" / "config.json").is_file()


def test_unreachable_server_is_a_clear_error():
    e = SGLangEngine(CFG, SGLangServerConfig(model_path="/m", port=1, request_timeout_s=2), launch=False)
    with pytest.raises(SGLangError, match="/generate"):
        e.generate([[0]], SamplingParams(), n=1, seed=0)
