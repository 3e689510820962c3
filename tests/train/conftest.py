"""Fixtures of the training tests."""

import os
import shutil
import tempfile

import pytest
import torch


@pytest.fixture(autouse=True)
def _two_threads():
    """At most two intra-op threads per test (the CI machine has two cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped elsewhere")


# Ray settings of the tests' cluster: what it would start for nothing. The pytest process joins the cluster as a
# driver (ray.init, as a test that creates an actor itself needs), and a raylet by default
# starts a worker per logical CPU for its first driver (4 interpreters importing Ray, for a job that never runs a
# task: every run of the tests is a job of its own, and its actors carry a runtime_env, so they get workers of
# their own), then keeps them idling; and it starts object-spilling and restore workers (2 more per node),
# although the tests' objects (the tiny model's weights) never fill the object store: with both off, an idle
# cluster took 7.6 s of CPU over 37 s instead of 12.1 s, and 0.04 of a core idle instead of 0.14.
SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "automatic_object_spilling_enabled": False}


@pytest.fixture(scope="session")
def cluster():
    """A local Ray cluster for the test process: two simulated nodes of 2 logical CPUs each
    (``ray.cluster_utils``: one raylet per node on this machine, so ``--rollout-num-nodes 2`` places for real),
    no dashboard, a small object store per node, a short session folder under /tmp (Ray's socket paths have a
    length limit): its GCS address, for ``--ray-address``. Session-scoped: the Ray cluster files run in one
    pytest process (tests/train/BUILD.bazel's ``ray_files``), and each run is a job of its own on it (its actors and
    placement groups go with its driver), so they share one cluster's start (about 7 s of CPU) instead of one
    each; the pytest process stays connected as a driver (:data:`SYSTEM_CONFIG`)."""
    import ray
    from ray.cluster_utils import Cluster

    folder = tempfile.mkdtemp(prefix="dsv4ray", dir="/tmp")
    # The head also records its address in Ray's default folder (/tmp/ray/ray_current_cluster), which only a
    # node started there creates: on a fresh machine where no Ray ran yet the write fails (seen in CI).
    from ray._common.utils import get_default_ray_temp_dir

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    node = dict(num_cpus=2, object_store_memory=256 << 20)
    head = dict(node, include_dashboard=False, temp_dir=folder, _system_config=SYSTEM_CONFIG)
    nodes = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes.add_node(**node)
        ray.init(address=nodes.address, configure_logging=False, log_to_driver=False)
        nodes.wait_for_nodes()
        yield nodes.address
    finally:
        ray.shutdown()
        nodes.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
