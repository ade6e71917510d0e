"""Starting a local Ray cluster starts our own, even while another cluster on the machine has left its
address for later `ray.init` calls to join (as `ray start` and ray.cluster_utils.Cluster do); releasing a pool
after its cluster stopped starts none."""

import pytest
import ray
from ray.cluster_utils import Cluster

from hybridflow.controller import RayResourcePool
from hybridflow.controller.ray_runtime import start_ray

pytestmark = pytest.mark.usefixtures("no_ray")


def test_a_local_start_never_joins_another_cluster_on_the_machine():
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        ray.shutdown()  # the helper connected this process to it; what it leaves is its address file
        assert start_ray(num_cpus=1) is True
        try:
            ours = ray.get_runtime_context().gcs_address
            assert ours != other.address and ray.cluster_resources().get("CPU") == 1.0
        finally:
            ray.shutdown()
    finally:
        other.shutdown()


def test_a_pool_released_after_its_cluster_stopped_starts_no_other(keeping):
    keeping(8)  # with keeping on, as in the test suite: the release must not ask Ray for the pool's shape either
    assert start_ray(num_cpus=1) is True
    pool = RayResourcePool([1], name="orphan")
    assert len(pool.placement_groups()) == 1
    ray.shutdown()
    pool.release()
    assert not ray.is_initialized()
