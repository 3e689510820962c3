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
