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
    # tests/runner.py's (registered here too for plain pytest runs, which do not load the runner)
    config.addinivalue_line("markers", "shard(k): run this test in shard k (mod the target's shard_count)")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module: two simulated nodes of 2 logical CPUs each (``ray.cluster_utils``:
    one raylet per node on this machine, so ``--rollout-num-nodes 2`` places for real), no dashboard, a small
    object store per node, a short session folder under /tmp (Ray's socket paths have a length limit): its
    GCS address, for ``--ray-address``."""
    import ray
    from ray.cluster_utils import Cluster

    folder = tempfile.mkdtemp(prefix="dsv4ray", dir="/tmp")
    # The head also records its address in Ray's default folder (/tmp/ray/ray_current_cluster), which only a
    # node started there creates: on a fresh machine where no Ray ran yet the write fails (seen in CI).
    from ray._common.utils import get_default_ray_temp_dir

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    node = dict(num_cpus=2, object_store_memory=256 << 20)
    nodes = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False, temp_dir=folder))
    try:
        nodes.add_node(**node)
        ray.init(address=nodes.address, configure_logging=False, log_to_driver=False)
        nodes.wait_for_nodes()
        yield nodes.address
    finally:
        ray.shutdown()
        nodes.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
