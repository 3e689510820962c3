"""`dsv4 train --orchestrator ray` on a local Ray cluster on the CPU (gloo), through the CLI (issue #22).

The reference is the local orchestrator's run of the same GRPO job (one process): a Ray run places the same
rank entry point and the same rollout engine in actors, so its metrics must be the local run's:

* colocated (engines in their data-parallel leaders' bundles; two trainer ranks here, so the placement by
  megatron's rank order is exercised; ``colocate=true``, so the engine actors release their memory while the
  trainer works): the first step's loss, gradient norm, reward and train-vs-rollout log-prob difference equal
  the local run's to 1e-5, and the run has every step; engine actor 1 is SIGKILLed after step 2's weight sync,
  as it is asked to generate: Ray restarts it, the proxy loads step 2's weights into it once, and what it
  generates scores as the trainer's weights do (the train-vs-rollout log-prob difference of every step stays at
  the fp32 rounding of the first);
* disaggregated (the engine in a bundle of its own), with its engine actor SIGKILLed as step 2's weight update
  starts (Ray restarts it, the proxy loads the current weights into it once) and then the trainer actor
  SIGKILLed mid-step (the group restarts from the last checkpoint): every metrics row equals the uninterrupted
  local run's (nothing lost, no step repeated);
* ``--weight-transport gloo`` with the engines on two nodes, one engine actor killed (the trainer group
  restarts: a direct transport keeps no copy of the weights to re-sync it with);
* ``--rollout-engine sglang``, one fake SGLang server per engine actor (``--rollout-url URL0,URL1``): the
  reference is the local orchestrator's connect-mode run against a fake of its own (same seeds, same pushed
  tensors, same rewards), with both engine actors killed and re-synced;
* the refusals of the combination table and of the command line, before any work, and an unreachable
  --ray-address (one line, no run folder).

The cluster is started once for the test process (4 logical CPUs over two simulated nodes, no dashboard, its
session folder short: Ray's unix sockets live there; ``cluster`` in tests/train/conftest.py), and every run
connects to it with --ray-address. The file runs as one Bazel target with tests/train/test_async_rollout_ray.py
(tests/train/BUILD.bazel's ``ray_files``), not in shards: on the two cores CI has, which the suite keeps busy,
shards bought no wall time, and each paid a cluster, a pytest process and its CLI zygote again, two of them the
local run too.
"""


import pytest
import torch
from click.testing import CliRunner

from ._cli import metrics_rows, train_cli
GRPO = ("--mode", "grpo", "--steps", "3", "--lr", "1e-3", "--save-every", "1", "prompts_per_step=2",
        "group_size=4", "max_new_tokens=6", "export_at_end=false")
FIRST_STEP = ("loss", "grad_norm", "reward_mean", "train_rollout_logprob_abs_diff", "response_tokens")


#: Ray's driver folds log lines that differ only in words with digits (actor 0 / actor 1, two stores' ports)
#: into one "[repeated Nx across cluster]" line, when they arrive within its window: the counts below would
#: depend on timing. Each line printed as it comes.
NO_DEDUP = {"RAY_DEDUP_LOGS": "0"}


def _train(run_dir, *args, env=None, check=True):
    return train_cli(run_dir, *GRPO, *args, env={**NO_DEDUP, **(env or {})}, check=check, timeout=600)


def _same_rows(got, want, keys=FIRST_STEP):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in keys:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (g["step"], key)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local orchestrator's run (one process): the rows every Ray run must reproduce."""
    run = tmp_path_factory.mktemp("local") / "run"
    _train(run)
    return metrics_rows(run)


def test_colocated_takes_the_local_first_step_and_resyncs_an_engine_killed_as_it_is_asked_to_generate(
        tmp_path, cluster, local):
    """Engine actor 1 is SIGKILLed after step 2's weight update, as it is asked to generate (the kill as the update
    starts is the disaggregated test's; in the background, under async rollout, test_async_rollout_ray.py's): it
    is restarted and re-synced once, and generates from step 2's weights (the trainer's log-probs of its samples
    are theirs to fp32 rounding: 2.7e-7 against the local run's 2.4e-7; a re-sync that loaded weights 0.2% off
    failed the run at the next sync's weight check). This was a Ray run of its own, on one trainer rank, for the
    same proxy path (RayEngineProxy._call, _resync): three actor processes and a driver more."""
    proc = _train(tmp_path / "run", "--orchestrator", "ray", "--ray-address", cluster, "--trainer-num-gpus", "2",
                  "colocate=true", env={"DSV4_RAY_ENGINE_KILL_AT": "generate:2@1"})
    assert "rollout engine actor(s), colocated" in proc.stderr
    restarts = [line for line in proc.stderr.splitlines() if "was restarted" in line]
    assert len(restarts) == 1 and "rollout engine actor 1 was restarted; loading weights version" in restarts[0], \
        proc.stderr[-2000:]
    got = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[0]["world_size"] == 2
    _same_rows(got[:1], local[:1])
    bound = max(1e-6, 10 * max(r["train_rollout_logprob_abs_diff"] for r in local))
    diffs = [r["train_rollout_logprob_abs_diff"] for r in got]      # NaN is written as null
    assert all(d is not None and d <= bound for d in diffs), (diffs, bound)
    assert local[0]["engine_memory_gib"] > 0          # what the engine holds while the trainer works
    # colocate=true: the trainer's release_memory reached the engine actors (nothing held while training), the
    # restarted one too
    assert all(r["engine_memory_gib"] == 0 for r in got)


def test_disaggregated_survives_a_killed_engine_and_a_killed_trainer(tmp_path, cluster, local):
    """The engine in a bundle of its own; its actor is SIGKILLed as step 2's weight update starts (Ray
    restarts it and the proxy re-syncs it), then the trainer actor in step 2's training phase (the group
    restarts from step 1's checkpoint, with the engine actor it has). Every row is the uninterrupted local
    run's: nothing lost, no step repeated."""
    proc = _train(tmp_path / "run", "--orchestrator", "ray", "--ray-address", cluster, "--rollout-num-gpus", "1",
                  env={"DSV4_RAY_ENGINE_KILL_AT": "begin_update:2", "DSV4_TRAIN_KILL_AT": "2:train"})
    assert "rollout engine actor(s), disaggregated" in proc.stderr
    assert proc.stderr.count("rollout engine actor 0 was restarted; loading weights version") == 1, proc.stderr[-2000:]
    assert proc.stderr.count("restarting the trainer group from checkpoint step 1") == 1, proc.stderr[-2000:]
    got = metrics_rows(tmp_path / "run")
    assert [r["world_size"] for r in got] == [1] * 3
    _same_rows(got, local)
    assert all(r["engine_memory_gib"] > 0 for r in got)   # not colocated: the engine keeps its memory
    # the actor's engine timed its generate by phase; the same samples as the local run: the same decode steps
    assert all(r["time_rollout_decode"] > 0 for r in got)
    assert [(r["rollout_decode_steps"], r["rollout_decode_rows"]) for r in got] == \
        [(r["rollout_decode_steps"], r["rollout_decode_rows"]) for r in local]


def test_gloo_transport_over_two_engine_nodes_loads_the_published_weights(tmp_path, cluster, local):
    """``--weight-transport gloo``: each data-parallel leader broadcasts its buckets to its engine actor over a
    process group of their own (the code path of nccl), the two engines on two nodes (``--rollout-num-nodes
    2``, the placement group spread strictly). Every step's weight check compares what each engine actor holds
    (sent back through the object store) with what its leader published: equal bit for bit (``weight_check_ok``);
    the first step equals the local run's, as the objects transport's runs do. Engine actor 0 is SIGKILLed as
    step 2 asks it to generate: with no copy of the weights to re-sync it, the trainer group restarts from step
    1's checkpoint, and its new leaders form new groups with the restarted actor and with the surviving one."""
    proc = _train(tmp_path / "run", "--orchestrator", "ray", "--ray-address", cluster, "--trainer-num-gpus", "2",
                  "--rollout-num-gpus", "2", "--rollout-num-nodes", "2", "--weight-transport", "gloo",
                  env={"DSV4_RAY_ENGINE_KILL_AT": "generate:2@0"})
    assert "2 rollout engine actor(s), disaggregated (2 bundle(s) of their own), on 2 node(s)" in proc.stderr
    assert "weight transport gloo: each step's weights reach the engine actors through a torch.distributed " \
           "broadcast, backend gloo" in proc.stderr
    # two leaders' groups, then two again in the restarted trainer group
    assert proc.stderr.count("weight transport gloo: a process group of this trainer rank and 1 engine") == 4
    assert "lost its rollout engine (rollout engine actor" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("restarting the trainer group from checkpoint step 1") == 1
    got = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all(r["weight_check_ok"] is True and r["weight_sync_buckets"] >= 1 for r in got)
    assert got[0]["world_size"] == 2
    _same_rows(got[:1], local[:1])


def test_sglang_servers_as_engine_actors_take_the_local_connect_runs_steps(tmp_path, cluster):
    """``--rollout-engine sglang --rollout-url URL0,URL1`` with two trainer ranks: one engine actor per
    data-parallel rank, each connected to a fake SGLang server of its own (tests/train/_fake_sglang.py, in this
    process; its samples are a function of the prompt and the sample's seed), colocated with ``colocate=true``.
    The reference is the local orchestrator's connect-mode run against a third fake (the path
    tests/train/test_sglang_training.py checks against the trainer's export): the same samples (seeds, rewards,
    tokens) every step, the same first step, the same tensors pushed. Both actors are SIGKILLed as step 2's
    update starts, after step 1 released their servers' memory: each restarted actor reconnects, resumes its
    server and is re-synced once, so each server holds exactly one weight version per step."""
    from core.config import preset

    from ._fake_sglang import FakeSGLang

    env = {"DSV4_SGLANG_SERIALIZER": "torch-b64"}       # the fake's format (the actors run in other processes)
    # bit-equal pushed tensors across layouts: one prompt group per micro-batch on every rank (the default token
    # budget would put one rank's 8 samples, and each of two ranks' 4, in one micro-batch: sums in other orders)
    one_group = "micro_batch_size=4"
    fakes = [FakeSGLang(preset("tiny")) for _ in range(3)]
    with fakes[0] as ref, fakes[1] as one, fakes[2] as two:
        _train(tmp_path / "local", "--rollout-engine", "sglang", "--rollout-url", ref.url, one_group, env=env)
        proc = _train(tmp_path / "ray", "--orchestrator", "ray", "--ray-address", cluster, "--trainer-num-gpus",
                      "2", "--rollout-engine", "sglang", "--rollout-url", f"{one.url},{two.url}", "colocate=true",
                      one_group, env={**env, "DSV4_RAY_ENGINE_KILL_AT": "begin_update:2"})
    assert "--rollout-engine sglang: one server per engine actor, connected to " \
           f"{one.url}, {two.url}" in proc.stderr
    for j in (0, 1):
        assert proc.stderr.count(f"rollout engine actor {j} was restarted; loading weights version") == 1, \
            proc.stderr[-2000:]
    local, got = metrics_rows(tmp_path / "local"), metrics_rows(tmp_path / "ray")
    _same_rows(got[:1], local[:1])
    _same_rows(got, local, keys=("reward_mean", "response_tokens"))
    assert [r["world_size"] for r in got] == [2] * 3

    # the engines' samples: each step the two servers got the local server's seeds between them
    assert [len(s.state["generate"]) for s in (ref, one, two)] == [3, 3, 3]
    for step in range(3):
        seeds = one.state["generate"][step]["seeds"] + two.state["generate"][step]["seeds"]
        assert seeds == ref.state["generate"][step]["seeds"]
    # the weights: one version per step on each server (the re-sync replaced the killed update), each the local
    # run's push of that step: the same names and shapes, the same tensors
    shapes = [v["shapes"] for v in ref.state["versions"]]
    assert len(shapes) == 3 and shapes[0]
    for server in (one, two):
        assert [v["shapes"] for v in server.state["versions"]] == shapes
        assert all(torch.equal(held[n], want[n]) for held, want in zip(server.tensors, ref.tensors) for n in shapes[0])
        calls = server.state["calls"]     # released after each rollout, resumed before the next update
        assert calls.count("/release_memory_occupation") == 3 and calls.count("/resume_memory_occupation") == 2
    assert any(not torch.equal(ref.tensors[2][n], ref.tensors[1][n]) for n in shapes[0])    # step 2 learned


# -- refusals (no cluster, no training) --------------------------------------------------------------------------
def _dsv4(*args):
    from launchers.cli import main

    return CliRunner().invoke(main, ["train", "--hardware", "cpu", *map(str, args)])


def _error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    return lines[0]


@pytest.mark.parametrize("args,says", [
    (("--rollout-num-gpus", "1"), "--rollout-num-gpus places the run's Ray actors, and --orchestrator local starts "
                                  "none. Fix: add --orchestrator ray"),
    (("--ray-address", "127.0.0.1:6379"), "--ray-address only applies with --orchestrator ray. Fix: add"),
    (("--orchestrator", "ray", "--nproc-per-node", "2"), "Fix: use --trainer-num-gpus N"),
    (("--orchestrator", "ray", "--trainer-num-gpus", "2", "--rollout-num-gpus", "1"),
     "each of the run's 2 data-parallel ranks owns one rollout engine on a device of its own. Fix: use "
     "--rollout-num-gpus 2"),
    (("--orchestrator", "ray", "--rollout-num-gpus", "1", "colocate=true"),
     "colocate=true releases each engine's memory for the trainer ranks it shares a device with, and "
     "--rollout-num-gpus 1 gives the engines devices of their own. Fix: drop colocate=true"),
    (("--orchestrator", "ray", "--weight-transport", "nccl"),
     "--weight-transport nccl moves CUDA tensors (got --hardware cpu). Fix: use --weight-transport gloo"),
    (("--orchestrator", "ray", "--weight-transport", "cuda-ipc"),
     "--weight-transport cuda-ipc moves CUDA tensors (got --hardware cpu). Fix: use --weight-transport gloo"),
    (("--hardware", "nvidia", "--orchestrator", "ray", "--rollout-num-gpus", "1", "--weight-transport", "gloo"),
     "--weight-transport gloo broadcasts host tensors, and --hardware nvidia keeps the weights on GPUs. Fix: use "
     "--weight-transport nccl"),
    (("--hardware", "nvidia", "--orchestrator", "ray", "--weight-transport", "nccl"),
     "colocated engines share their trainer rank's GPU (NCCL refuses two ranks on one GPU). Fix: use "
     "--weight-transport cuda-ipc, or give the engines GPUs of their own with --rollout-num-gpus N"),
    (("--hardware", "nvidia", "--orchestrator", "ray", "--rollout-num-gpus", "1", "--weight-transport", "cuda-ipc"),
     "--weight-transport cuda-ipc hands each engine the trainer's GPU memory, and --rollout-num-gpus 1 puts the "
     "engines on GPUs of their own. Fix: use --weight-transport nccl, or drop --rollout-num-gpus"),
    (("--orchestrator", "ray", "--trainer-num-gpus", "2", "--rollout-num-gpus", "2", "--rollout-num-nodes", "3"),
     "--rollout-num-nodes 3 does not divide --rollout-num-gpus 2 (each node holds the same number of engines). "
     "Fix: use --rollout-num-nodes 1 or 2"),
    (("--orchestrator", "ray", "--rollout-num-nodes", "2"),
     "--rollout-num-nodes 2 spreads the engines' own devices over nodes, and without --rollout-num-gpus"),
    (("--rollout-num-nodes", "2",), "--rollout-num-nodes places the run's Ray actors, and --orchestrator local"),
    (("--orchestrator", "ray", "--trainer-num-gpus", "2", "--rollout-engine", "sglang", "--rollout-url",
      "http://127.0.0.1:9"), "--rollout-url lists 1 server, and --orchestrator ray starts 2 rollout engine actors "
                             "(one per data-parallel rank), each connecting to one server of its own. Fix: give 2 "
                             "comma-separated URLs"),
    (("--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9,http://127.0.0.1:10"),
     "--rollout-url lists 2 servers, and --orchestrator local connects its rollout engine to one. Fix: give one URL, "
     "or use --orchestrator ray"),
    (("--orchestrator", "ray", "--rollout-engine", "sglang"),        # launch mode starts a server on a GPU
     "--rollout-engine sglang needs a GPU (got --hardware cpu). Fix: use a GPU --hardware, connect to a running"),
    (("--orchestrator", "ray", "--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9",
      "--weight-transport", "gloo"), "--weight-transport gloo feeds an engine that runs inside its actor, and "
                                     "--rollout-engine sglang is a server the actor forwards each bucket to"),
])
def test_refused_before_any_work(tmp_path, args, says):
    assert says in _error(_dsv4("--run-dir", tmp_path / "run", *args))
    assert not (tmp_path / "run").exists()


def test_a_started_server_per_engine_actor_has_one_gpu():
    """Launch mode under Ray on a GPU target (checked with the trainer's options, which the CLI does before any
    work; this machine has no GPU, so the check is called here directly): an engine actor holds one GPU."""
    from core.config import ConfigError, preset
    from core.plugins import PluginHost
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import BUILTIN_PLUGINS
    from train.config_checks import check_train_options
    from train.trainer import TrainConfig

    host = PluginHost(BUILTIN_PLUGINS, third_party=False)
    run = normalize(Choices(hardware="nvidia", rollout_engine="sglang", model=preset("tiny"), job="train",
                            orchestrator="ray"), host, model_name="tiny")
    check_train_options(run, TrainConfig(), host)
    with pytest.raises(ConfigError, match="'sglang_tp_size' = 2: under --orchestrator ray each engine actor starts "
                                          "its server on the one GPU of its bundle. Fix: sglang_tp_size=1"):
        check_train_options(run, TrainConfig(sglang_tp_size=2), host)
    connected = normalize(Choices(hardware="nvidia", rollout_engine="sglang", model=preset("tiny"), job="train",
                                  orchestrator="ray", rollout_url="http://127.0.0.1:9"), host, model_name="tiny")
    check_train_options(connected, TrainConfig(sglang_tp_size=2), host)     # the server runs elsewhere


def test_placement_plan_spreads_the_engines_over_their_nodes():
    """The placement groups and each actor's (group, bundle, share), against the layouts written out by hand."""
    from orchestration.ray_launch import placement_plan

    gpu = {"CPU": 1.0, "GPU": 1.0}
    colocated = placement_plan(gpu=True, world=4, model_parallel=2, rollout_num_gpus=None, rollout_num_nodes=None)
    assert colocated.groups == (("PACK", (gpu,) * 4),)
    assert colocated.engines == ((0, 0, 0.5), (0, 2, 0.5))           # in the leaders' (ranks 0, 2) bundles
    assert colocated.trainers == tuple((0, r, 0.5) for r in range(4))
    one = placement_plan(gpu=False, world=2, model_parallel=1, rollout_num_gpus=2, rollout_num_nodes=None)
    assert one.groups == (("PACK", ({"CPU": 1.0},) * 4),) and one.engines == ((0, 2, 1.0), (0, 3, 1.0))
    spread = placement_plan(gpu=True, world=2, model_parallel=1, rollout_num_gpus=6, rollout_num_nodes=3)
    assert spread.groups == (("STRICT_SPREAD", ({"CPU": 2.0, "GPU": 2.0},) * 3), ("PACK", (gpu,) * 2))
    assert [b for _, b, _ in spread.engines] == [0, 0, 1, 1, 2, 2] and {g for g, _, _ in spread.engines} == {0}
    assert spread.trainers == ((1, 0, 1.0), (1, 1, 1.0)) and spread.bundles == 5 and spread.cpus == 8


def test_a_packed_bucket_unpacks_to_the_same_bytes():
    """The direct transports' one-buffer packing, for the dtypes a published bucket holds (fp8 and packed nvfp4
    bytes, fp32 scales, integer tables) and the odd shapes (a scalar, an empty tensor, a strided view)."""
    import torch

    from orchestration.ray_transport import pack_bucket, unpack_bucket

    g = torch.Generator().manual_seed(0)
    bucket = [("w", torch.randn(3, 5, generator=g)), ("bf", torch.randn(7, generator=g).to(torch.bfloat16)),
              ("fp8", torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)),
              ("packed", torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8)),
              ("tid2eid", torch.randint(-1, 8, (6, 2), generator=g, dtype=torch.int32)),
              ("scalar", torch.tensor(3, dtype=torch.int64)), ("empty", torch.zeros(0, 3)),
              ("strided", torch.randn(6, 6, generator=g)[:, ::2])]
    meta, buffer = pack_bucket(bucket, "cpu")
    assert meta[0] == buffer.numel() and meta[0] % 16 == 0
    got = unpack_bucket(meta, buffer.clone())          # what a receiver holds: another buffer with those bytes
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (name, want), (_, t) in zip(bucket, got):
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert t.contiguous().reshape(-1).view(torch.uint8).tolist() == \
            want.contiguous().reshape(-1).view(torch.uint8).tolist(), name


def test_a_torchrun_rank_cannot_start_ray_actors(tmp_path, monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    assert "without torchrun / srun" in _error(_dsv4("--run-dir", tmp_path / "run", "--orchestrator", "ray"))


def test_print_config_holds_the_ray_keys_and_reads_back(tmp_path):
    res = _dsv4("--orchestrator", "ray", "--ray-address", "10.0.0.1:6379", "--rollout-num-gpus", "1",
                "--print-config")
    assert res.exit_code == 0, res.output
    for line in ('orchestrator = "ray"', "rollout_num_gpus = 1", 'ray_address = "10.0.0.1:6379"'):
        assert line in res.stdout
    (tmp_path / "run.toml").write_text(res.stdout)
    again = _dsv4("--config", tmp_path / "run.toml", "--print-config")
    assert again.exit_code == 0, again.output
    assert again.stdout == res.stdout


def test_an_unreachable_cluster_is_one_line_and_leaves_no_run_folder(tmp_path):
    from core.ports import free_port

    address = f"127.0.0.1:{free_port()}"        # nothing listens there
    res = _dsv4("--run-dir", tmp_path / "run", "--orchestrator", "ray", "--ray-address", address)
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert lines == [f"error: --ray-address {address}: cannot connect to a Ray cluster there (127.0.0.1:"
                     f"{address.rsplit(':', 1)[1]}: Connection refused). Fix: start one with `ray start --head` and "
                     f"pass its address, or leave --ray-address and RAY_ADDRESS unset to start a local one"], res.stderr
    assert not (tmp_path / "run").exists()


def _group_that_fails(*failures):
    """A trainer-group stand-in: each call raises the next of ``failures``, then returns "done"; records the
    attempts it was called with."""
    calls, left = [], list(failures)

    def run_group(attempt):
        calls.append(attempt)
        if left:
            raise left.pop(0)
        return "done"

    return run_group, calls


def test_a_taken_rendezvous_port_starts_the_group_again_without_a_restart():
    """Rank 0's picked port bound by another process first (the CI race) is not a restart from a checkpoint: the
    group starts again on another port, up to PORT_ATTEMPTS times, then the one-line error names the fix; a died
    group still counts restarts."""
    from core.ports import PORT_ATTEMPTS
    from orchestration.launch import RankFailed
    from orchestration.ray_launch import _GroupDied, _PortTaken, _run_with_restarts

    run_group, calls = _group_that_fails(_PortTaken("rank 0 cannot listen on MASTER_PORT 1234"))
    assert _run_with_restarts(run_group, 0, lambda: None) == "done" and calls == [0, 0]
    run_group, calls = _group_that_fails(*[_PortTaken("taken")] * PORT_ATTEMPTS)
    with pytest.raises(RankFailed, match="Fix: find what binds ports"):
        _run_with_restarts(run_group, 5, lambda: None)
    assert calls == [0] * PORT_ATTEMPTS
    run_group, calls = _group_that_fails(_GroupDied(1, RuntimeError("killed")), _PortTaken("taken"))
    assert _run_with_restarts(run_group, 1, lambda: (3, None)) == "done" and calls == [0, 1, 1]
    run_group, calls = _group_that_fails(_GroupDied(1, RuntimeError("killed")))
    with pytest.raises(RankFailed, match="restarted 0 times"):
        _run_with_restarts(run_group, 0, lambda: None)


def test_rank_zero_names_a_taken_master_port_and_the_launcher_retries_only_that():
    """The rendezvous raises MasterPortTaken when rank 0's port is in use; the Ray launcher turns that rank's
    error (inside Ray's task error, as ray.get raises it) into a retry, and every other error of a rank,
    DistEnvError's other cases included, into the one-line RankFailed."""
    import socket

    from ray.exceptions import RayTaskError

    from orchestration.dist_env import DistEnvError, MasterPortTaken, rendezvous
    from orchestration.launch import RankFailed
    from orchestration.ray_launch import _PortTaken, _rank_error

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(MasterPortTaken, match="taken by another process") as taken:
            rendezvous(0, 2, "127.0.0.1", held.getsockname()[1], timeout_s=5)
    got = _rank_error(0, RayTaskError("run", "traceback", taken.value), port="1234")
    assert isinstance(got, _PortTaken) and "port 1234" in str(got) and "Fix" not in str(got)
    other = _rank_error(1, RayTaskError("run", "traceback", DistEnvError("rank 1 waited 3 s. Fix: x")), port="1")
    assert isinstance(other, RankFailed) and str(other) == "rank 1: rank 1 waited 3 s. Fix: x"
    crash = _rank_error(0, RayTaskError("run", "traceback", RuntimeError("boom")), port="1")
    assert isinstance(crash, RankFailed) and "RuntimeError: boom" in str(crash)
