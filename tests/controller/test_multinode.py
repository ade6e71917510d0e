"""A worker group spread over two Ray nodes (Ray's own multi-node simulation) is one torch.distributed group."""

import pytest
import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster

from hybridflow.controller import Dispatch, RayResourcePool, RayWorkerGroup, RoleSpec, Worker, register, start_ray

pytestmark = pytest.mark.usefixtures("no_ray")  # joins a simulated cluster of its own


class NodeReporter(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> tuple[str, int, int, float]:
        value = torch.tensor(float(self.rank + 1))
        dist.all_reduce(value)
        return ray.get_runtime_context().get_node_id(), self.rank, self.local_rank, value.item()


@pytest.fixture
def two_node_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    assert start_ray(address=cluster.address)  # joins the existing cluster instead of starting one
    cluster.wait_for_nodes()
    assert len(ray.nodes()) == 3
    yield [n.node_id for n in nodes]
    ray.shutdown()
    cluster.shutdown()


def test_group_over_two_nodes_forms_one_process_group(two_node_cluster):
    group = RayWorkerGroup(RayResourcePool([2, 2]), RoleSpec(NodeReporter))
    reports = group.all_reduce_rank()
    nodes = [r[0] for r in reports]
    assert [r[1] for r in reports] == [0, 1, 2, 3]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert set(nodes) == set(two_node_cluster)
    assert [r[2] for r in reports] == [0, 1, 0, 1]  # local rank within each node
    assert [r[3] for r in reports] == [10.0] * 4  # 1 + 2 + 3 + 4 over both nodes
