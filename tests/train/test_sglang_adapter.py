"""SGLang adapter WITHOUT SGLang: the server command line, the HTTP request/response handling, connecting
to a URL and starting (and stopping) a server process, all against the fake server of
tests/train/_fake_sglang.py on 127.0.0.1. They do not run SGLang (it needs a GPU and the sglang package);
nothing here says the adapter works against a real server. The trainer's use of it:
tests/train/test_sglang_training.py."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from core.config import preset
from core.errors import UserInputError
from core.ports import free_port
from tests.train._fake_sglang import FakeSGLang, install_fake_launcher, process_gone, spare_port
from rollout.reference_engine import SamplingParams, sample_seed
from rollout.sglang_engine import (SGLangEngine, SGLangError, SGLangServerConfig, SGLangSetupError,
                                 make_sglang_engine, server_command, torch_b64_serialize)
from train.trainer import TrainConfig

CFG = preset("tiny")   # 4 trunk layers, layers 0-1 hash-routed, top-2 of 8 experts


def _engine(url, tp_size=2, **kw):
    cfg = SGLangServerConfig(url=url, tp_size=tp_size, startup_timeout_s=5, request_timeout_s=5)
    e = SGLangEngine(CFG, cfg, launch=False, serializer=torch_b64_serialize, **kw)
    e.connect()
    return e


def test_server_command_line():
    cmd = server_command(SGLangServerConfig(model_path="/ckpt", port=31000, tp_size=8, dtype="bfloat16",
                                            mem_fraction_static=0.7, extra_args=("--foo",), python="py"))
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "127.0.0.1",
                   "--port", "31000", "--tp-size", "8", "--trust-remote-code", "--skip-tokenizer-init",
                   "--dtype", "bfloat16", "--mem-fraction-static", "0.7", "--enable-return-routed-experts", "--foo"]
    assert "--enable-return-routed-experts" not in server_command(
        SGLangServerConfig(model_path="/c", return_routed_experts=False))
    with pytest.raises(SGLangError, match="model_path"):
        server_command(SGLangServerConfig(url="http://h:1"))


def test_generate_sends_one_request_with_a_seed_per_sample_and_parses_the_answers():
    with FakeSGLang(CFG, tp_size=2) as fake:
        e = _engine(fake.url)
        params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3)
        groups = e.generate([[0, 5, 6], [0, 7]], params, n=2, seed=11, first_prompt=4)
        req = fake.state["generate"][-1]
    assert len(fake.state["generate"]) == 1 and req["inputs"] == 4          # 2 prompts x 2 samples, one request
    seeds = [sample_seed(11, 4 + i, j) for i in range(2) for j in range(2)]
    assert req["seeds"] == seeds and req["return_routed_experts"] is True
    assert [len(g) for g in groups] == [2, 2]
    for i, (prompt, group) in enumerate(zip([[0, 5, 6], [0, 7]], groups)):
        for j, s in enumerate(group):
            seed = seeds[2 * i + j]
            assert s.prompt_ids == prompt
            assert s.finish_reason == ("stop" if seed % 2 == 0 else "length")
            assert (s.response_ids[-1] == 1) == (seed % 2 == 0)
            assert torch.allclose(s.logprobs, torch.tensor([-0.25 - 0.01 * k for k in range(len(s.response_ids))]))
            assert s.routed_experts.shape == (len(prompt) + len(s.response_ids) - 1, 4, 2)
            assert (s.routed_experts[:, :2] == -1).all()       # hash layers blanked: never replayed
            assert (s.routed_experts[:, 2:] >= 0).all() and (s.routed_experts < 8).all()
    # the sampling parameters SGLang receives
    payload = e.generation_payload([[0, 5]], params, 1, seed=3)
    assert payload["input_ids"] == [[0, 5]]
    assert payload["sampling_params"] == [{"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 3,
                                           "stop_token_ids": [1], "no_stop_trim": True,
                                           "skip_special_tokens": False, "sampling_seed": sample_seed(3, 0, 0)}]
    assert payload["return_logprob"] is True


def test_weight_update_from_tensors_one_entry_per_tp_rank_then_flush():
    with FakeSGLang(CFG, tp_size=2) as fake:
        e = _engine(fake.url)
        e.begin_update(7)
        e.load_bucket([("embed.weight", torch.ones(2, 2))])
        e.load_bucket([("head.weight", torch.zeros(3))])
        e.finish_update()
        assert e.version == 7
        assert fake.state["tp_entries"] == [2, 2]
        assert fake.state["versions"] == [{"how": "tensors", "shapes": {"embed.weight": [2, 2], "head.weight": [3]}}]
        assert torch.equal(fake.tensors[0]["embed.weight"], torch.ones(2, 2))
        assert e.weights_by_name("embed.weight") == [1.0, 1.0, 1.0, 1.0]


def test_weight_update_from_disk_writes_a_checkpoint_the_server_reloads(tmp_path):
    from core.export import export_buckets
    from converters.publish import publish_bucket
    from train.model import build_train_model

    m = build_train_model(CFG)
    with FakeSGLang(CFG, tp_size=2) as fake:
        e = _engine(fake.url, weight_update="disk", disk_dir=str(tmp_path / "w"), disk_format="fp8")
        e.begin_update(1)
        sent = {}
        for b in export_buckets(m.native_tensors(), CFG, max_bucket_bytes=1 << 20):
            sent.update({n: t.shape for n, t in b})
            e.load_bucket(publish_bucket(b, "fp8"))
        e.finish_update()
        version = fake.state["versions"][-1]
        assert version["how"] == f"disk:{tmp_path / 'w'}"
        assert version["shapes"] == {n: list(s) for n, s in sent.items()}
        assert (tmp_path / "w" / "config.json").is_file()
        # a server that refuses the update: its message is the error
        fake.fail["/update_weights_from_disk"] = "bad path"
        e.begin_update(2)
        for b in export_buckets(m.native_tensors(), CFG, max_bucket_bytes=1 << 30):
            e.load_bucket(b)
        with pytest.raises(SGLangError, match="update_weights_from_disk failed: bad path"):
            e.finish_update()


def test_connect_checks_health_once_and_an_unreachable_url_is_one_line():
    port = free_port()   # nothing listens there
    e = SGLangEngine(CFG, SGLangServerConfig(url=f"http://127.0.0.1:{port}"), launch=False)
    with pytest.raises(SGLangSetupError) as err:
        e.connect()
    msg = str(err.value)
    assert "\n" not in msg and f"--rollout-url http://127.0.0.1:{port}" in msg and "Fix:" in msg
    assert "python -m sglang.launch_server" in msg
    with pytest.raises(SGLangError, match="/generate"):
        e.generate([[0]], SamplingParams(), n=1, seed=0)


def test_connect_waits_for_a_server_that_is_still_starting_and_checks_its_tp_size():
    with FakeSGLang(CFG, tp_size=1, health_delay_s=1.0) as fake:
        t0 = time.monotonic()
        _engine(fake.url, tp_size=1)
        assert time.monotonic() - t0 >= 0.9 and fake.state["health_calls"] >= 2
        with pytest.raises(SGLangSetupError, match="runs --tp-size 1, and sglang_tp_size is 2.*sglang_tp_size=1"):
            _engine(fake.url, tp_size=2)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="the sglang package is installed here")
def test_tensor_sync_without_the_sglang_package_is_one_line_naming_the_fix(tmp_path):
    with FakeSGLang(CFG) as fake:
        with pytest.raises(SGLangSetupError, match="sglang package is not installed.*sglang_weight_sync=disk"):
            make_sglang_engine(CFG, url=fake.url, settings=TrainConfig(), run_dir=tmp_path)
        # disk sync needs no serializer
        e = make_sglang_engine(CFG, url=fake.url, settings=TrainConfig(sglang_weight_sync="disk"), run_dir=tmp_path)
        assert e.weight_update == "disk" and e.disk_dir == str(tmp_path / "sglang_weights")
        with pytest.raises(UserInputError, match="published format nvfp4.*Fix: choose a --quant"):
            make_sglang_engine(CFG, url=fake.url, settings=TrainConfig(sglang_weight_sync="disk"), run_dir=tmp_path,
                               publish_format="nvfp4")


# -- launch mode: `python -m sglang.launch_server` resolves to the fake (a package on the child's PYTHONPATH) --
@pytest.fixture()
def fake_launcher(tmp_path, monkeypatch):
    return install_fake_launcher(tmp_path, monkeypatch)


def _checkpoint(tmp_path) -> Path:
    from train.export import export_model
    from train.model import build_train_model

    return export_model(build_train_model(CFG), tmp_path / "init")


def test_launch_starts_the_server_on_the_checkpoint_waits_for_health_and_stops_its_process_group(
        tmp_path, fake_launcher, caplog):
    import json
    import logging

    init = _checkpoint(tmp_path)
    settings = TrainConfig(sglang_weight_sync="disk", sglang_server_args="--fake-health-delay 1.5 --foo 'a b'",
                           sglang_startup_timeout_s=60)
    with caplog.at_level(logging.INFO, logger="dsv4"):
        e = make_sglang_engine(CFG, model_path=init, settings=settings, run_dir=tmp_path, progress_every_s=0.5)
    try:
        info = json.loads(fake_launcher.read_text())["info"]
        argv = info["argv"]
        assert argv[:2] == ["--model-path", str(init)] and argv[argv.index("--port") + 1] == str(e.server.port)
        assert argv[argv.index("--tp-size") + 1] == "1"
        for flag in ("--trust-remote-code", "--skip-tokenizer-init", "--enable-return-routed-experts"):
            assert flag in argv
        assert argv[-4:] == ["--fake-health-delay", "1.5", "--foo", "a b"]       # sglang_server_args, shlex-split
        assert any("sglang: waiting for" in r.message for r in caplog.records)     # progress while it starts
        assert any("ready after" in r.message for r in caplog.records)
        assert "fake sglang: serving" in (tmp_path / "sglang_server.log").read_text()
        groups = e.generate([[0, 5]], SamplingParams(max_new_tokens=2), n=2, seed=1)
        assert [len(g) for g in groups] == [2]
    finally:
        e.shutdown()
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"])     # the server and its worker are stopped
    e.shutdown()                                                 # twice is fine


def test_a_server_that_exits_or_never_answers_is_an_error_and_is_stopped(tmp_path, fake_launcher):
    import json

    settings = TrainConfig(sglang_weight_sync="disk")
    with pytest.raises(SGLangError, match=r"exited with code 3 during start-up; its output: .*sglang_server.log"):
        make_sglang_engine(CFG, model_path=tmp_path / "missing", settings=settings, run_dir=tmp_path)
    assert "cannot load --model-path" in (tmp_path / "sglang_server.log").read_text()

    init = _checkpoint(tmp_path)
    settings = TrainConfig(sglang_weight_sync="disk", sglang_server_args="--fake-health-delay 600",
                           sglang_startup_timeout_s=2)
    with pytest.raises(SGLangError, match="did not answer /health within 2 s"):
        make_sglang_engine(CFG, model_path=init, settings=settings, run_dir=tmp_path)
    info = json.loads(fake_launcher.read_text())["info"]
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"])


class _PortHolder:
    """Another process's listener on a port of 127.0.0.1 (here a thread): ``answer`` bytes to every connection
    (``b"\\x00..."``: what an HTTP client gets from a gRPC server, a Ray worker's), or None: closed unanswered."""

    def __init__(self, answer):
        import socket
        import threading

        self.answer = answer
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.answer is not None:
                    conn.recv(4096)
                    conn.sendall(self.answer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()


GRPC_SETTINGS_FRAME = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"


def test_a_picked_port_another_process_took_is_replaced_by_a_new_one(tmp_path, fake_launcher, monkeypatch, caplog):
    """``sglang_port=0``: the engine picks a free port, and the server binds it seconds later; a process that took
    it in between (here one that answers in binary, as a Ray worker's gRPC server did in CI) makes the engine
    pick another port and start the server again there, with the same command otherwise."""
    import json
    import logging

    import core.ports

    init = _checkpoint(tmp_path)
    real = core.ports.server_port
    with _PortHolder(GRPC_SETTINGS_FRAME) as taken:
        picks = iter([taken.port])
        monkeypatch.setattr(core.ports, "server_port", lambda: next(picks, None) or real())
        with caplog.at_level(logging.INFO, logger="dsv4"):
            e = make_sglang_engine(CFG, model_path=init, settings=TrainConfig(sglang_weight_sync="disk"),
                                   run_dir=tmp_path)
        try:
            assert e.server.port_picked and e.server.port != taken.port
            starts = [r.message for r in caplog.records if r.message.startswith("sglang: starting ")]
            assert [m.split(" --port ")[1].split()[0] for m in starts] == [str(taken.port), str(e.server.port)]
            assert any(f"another process holds the SGLang server's port {taken.port} (its answer to GET /health is "
                       f"not HTTP" in r.message and f"starting it again on port {e.server.port}" in r.message
                       for r in caplog.records if r.levelno == logging.WARNING)
            info = json.loads(fake_launcher.read_text())["info"]
            assert info["argv"][info["argv"].index("--port") + 1] == str(e.server.port)
            assert [len(g) for g in e.generate([[0, 5]], SamplingParams(max_new_tokens=2), n=2, seed=1)] == [2]
        finally:
            e.shutdown()
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"])


def test_a_picked_server_port_is_outside_the_ephemeral_range():
    """``core.ports.server_port``: below the range the kernel draws connections' source ports from (the poller's
    own ``GET /health`` to a port nothing listens on yet could take an ephemeral one) and above Ray's worker
    ports; nothing listens there."""
    import socket

    from core.ports import SERVER_PORTS_FROM, _ephemeral_start, server_port

    for _ in range(5):
        port = server_port()
        assert SERVER_PORTS_FROM <= port < _ephemeral_start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_server_that_could_not_bind_its_port_is_a_taken_port_even_once_the_port_is_free(tmp_path, monkeypatch):
    """The server exited during start-up and nothing listens on its port any more, but its output says the bind
    failed (a connection held the port for a moment): that is a taken port (a picked one is replaced), not a
    failed server."""
    import rollout.sglang_engine as se

    log_file = tmp_path / "sglang_server.log"
    log_file.write_text("Traceback ...\nOSError: [Errno 98] Address already in use\n")
    e = SGLangEngine(CFG, SGLangServerConfig(model_path="/m", port=spare_port(), startup_timeout_s=5), launch=False)
    e.proc, e.log_file = object(), log_file
    monkeypatch.setattr(se, "_exit_status", lambda proc: 1)
    with pytest.raises(se._PortTaken, match="was in use when it bound it"):
        e.wait_ready()
    log_file.write_text("Traceback ...\nValueError: bad model\n")
    with pytest.raises(SGLangError, match="exited with code 1 during start-up; its output") as err:
        e.wait_ready()
    assert not isinstance(err.value, se._PortTaken)


def test_a_given_port_another_process_holds_is_one_error_naming_it(tmp_path, fake_launcher):
    """``sglang_port=P`` is the user's: a server that cannot bind it (it exits, and another process listens
    there; here one that closes every connection unanswered) is an error naming the port and the fix, not a
    start on another port."""
    import json

    init = _checkpoint(tmp_path)
    with _PortHolder(None) as taken:
        settings = TrainConfig(sglang_weight_sync="disk", sglang_port=taken.port)
        with pytest.raises(SGLangError, match=f"exited with code 1 during start-up, and another process listens on "
                                              f"its port {taken.port}; its output: .*sglang_server.log. Fix: free "
                                              f"port {taken.port}, or set sglang_port to another port"):
            make_sglang_engine(CFG, model_path=init, settings=settings, run_dir=tmp_path)
    assert "Address already in use" in (tmp_path / "sglang_server.log").read_text()
    info = json.loads(fake_launcher.read_text())["info"]
    assert process_gone(info["pid"]) and process_gone(info["worker_pid"])
