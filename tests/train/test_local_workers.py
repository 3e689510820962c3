"""Local ranks on the CPU start from a preloaded forkserver (orchestration/local_workers.py), and still see their
parent's environment and working directory as they are at each launch, not as they were when the server
started (the server outlives the launch that started it)."""

import os

import pytest

from orchestration.launch import launch_local_ranks


def run_config(world=2):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl="miles", hardware="cpu", ep=world), make_host(third_party=False))


def what_a_rank_sees(key):
    import sys

    return {"value": os.environ.get(key), "cwd": os.getcwd(), "rank": os.environ["RANK"],
            "world": os.environ["WORLD_SIZE"], "preloaded": "megatron.core" in sys.modules,
            "ppid_is_parent": os.getppid() == int(os.environ["DSV4_TEST_PARENT_PID"])}


def test_the_cpu_target_forks_its_ranks_from_a_preloaded_server():
    from core.assembly import assemble
    from orchestration.local_workers import start_method

    target = assemble(run_config()).target
    assert start_method(target, ["train.trainer"]) == "forkserver"
    import multiprocessing.forkserver as fs

    assert fs._forkserver._preload_modules == ["backends.cpu.worker_preload", "train.trainer"]


def test_a_later_launch_sees_the_parents_environment_and_folder_of_its_own_time(tmp_path, monkeypatch):
    run = run_config()
    monkeypatch.setenv("DSV4_TEST_PARENT_PID", str(os.getpid()))
    monkeypatch.setenv("DSV4_TEST_VALUE", "first")
    monkeypatch.setenv("DSV4_TEST_GONE", "here")
    first = launch_local_ranks(run, what_a_rank_sees, ("DSV4_TEST_VALUE",))
    assert first["value"] == "first" and first["rank"] == "0" and first["world"] == "2"
    assert first["preloaded"] and not first["ppid_is_parent"]     # forked from the server, imports done there

    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "later")
    monkeypatch.setenv("DSV4_TEST_VALUE", "second")
    monkeypatch.delenv("DSV4_TEST_GONE")
    second = launch_local_ranks(run, what_a_rank_sees, ("DSV4_TEST_VALUE",))
    assert second["value"] == "second" and second["cwd"] == str(tmp_path / "later")
    assert launch_local_ranks(run, what_a_rank_sees, ("DSV4_TEST_GONE",))["value"] is None


def test_adopt_keeps_what_the_launcher_set(monkeypatch, tmp_path):
    from orchestration.local_workers import adopt

    parent = {"env": {"PATH": os.environ.get("PATH", ""), "KEEP": "parent"}, "cwd": str(tmp_path)}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("STALE", "from the server's start")
    cwd, env = os.getcwd(), dict(os.environ)
    try:
        adopt(parent)
        assert os.environ["RANK"] == "3" and os.environ["TORCHELASTIC_RUN_ID"] == "r"
        assert os.environ["KEEP"] == "parent" and "STALE" not in os.environ and os.getcwd() == str(tmp_path)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)


# -- ports: a start on a port picked free, taken by another process before the start bound it
def _meet(rank, port):
    """Two gloo ranks meet on ``port`` (rank 0 binds it), as the scorer's local ranks do."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture
def held_port():
    """A port this test's own socket listens on (another process's, as far as a start can tell)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _picks(monkeypatch, *first):
    """``core.ports.free_port`` answers ``first`` in order, then free ports; returns the list of ports it gave."""
    import core.ports

    real, queue, given = core.ports.free_port, list(first), []

    def pick():
        given.append(queue.pop(0) if queue else real())
        return given[-1]

    monkeypatch.setattr(core.ports, "free_port", pick)
    return given


def test_ranks_start_again_on_another_port_when_theirs_was_taken(monkeypatch, held_port, caplog):
    from backends.cpu.target import CpuTarget
    from core.ports import on_free_port
    from orchestration.local_workers import start_processes

    given = _picks(monkeypatch, held_port)
    on_free_port(lambda port: start_processes(_meet, (port,), 2, CpuTarget()), "two ranks")
    assert given[0] == held_port and len(given) == 2 and given[1] != held_port
    assert [r.getMessage() for r in caplog.records if "taken" in r.getMessage()] == [
        f"two ranks: port {held_port} was taken by another process before it was bound; starting again on another "
        f"free port (attempt 2 of 3)"]


def test_test_ranks_start_again_on_another_port_when_theirs_was_taken(monkeypatch, held_port):
    """The multi-rank CPU tests' start (tests.cpu_ranks) picks the port itself and picks again when it was taken."""
    from tests.cpu_ranks import PORT, spawn_cpu_ranks

    given = _picks(monkeypatch, held_port)
    spawn_cpu_ranks(_meet, (PORT,), 2)
    assert given[0] == held_port and len(given) == 2 and given[1] != held_port
    with pytest.raises(ValueError, match="put tests.cpu_ranks.PORT once in args"):
        spawn_cpu_ranks(_meet, (given[1],), 2)


def test_only_an_address_in_use_is_retried(monkeypatch, held_port):
    from core.ports import PortsTaken, on_free_port

    calls = []

    def fails(port):
        calls.append(port)
        raise RuntimeError(f"connect to 127.0.0.1:{port} failed: Connection refused")

    with pytest.raises(RuntimeError, match="Connection refused"):
        on_free_port(fails, "a start")
    assert len(calls) == 1                                   # not retried

    import torch.distributed as dist

    _picks(monkeypatch, held_port, held_port, held_port)
    with pytest.raises(PortsTaken, match=f"port {held_port} was taken .* and so were the 2 free port"):
        on_free_port(lambda port: dist.TCPStore("127.0.0.1", port, 1, True), "a store")


def test_local_ranks_meet_on_a_port_their_store_picks_as_it_binds(monkeypatch):
    """launch_local_ranks hands no picked port to the rendezvous: its store binds port 0."""
    import core.ports

    monkeypatch.setattr(core.ports, "free_port", lambda: pytest.fail("launch_local_ranks picked a port to bind later"))
    monkeypatch.setenv("DSV4_TEST_PARENT_PID", str(os.getpid()))
    assert launch_local_ranks(run_config(), what_a_rank_sees, ("DSV4_TEST_PARENT_PID",))["rank"] == "0"
