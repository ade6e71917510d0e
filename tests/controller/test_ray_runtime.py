"""Starting a local Ray cluster starts our own, even while another cluster on the machine has left its
address for later `ray.init` calls to join (as `ray start` and ray.cluster_utils.Cluster do)."""

import pytest
import ray
from ray.cluster_utils import Cluster

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
