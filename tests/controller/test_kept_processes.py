"""A driver that keeps worker processes: a released pool's processes serve the next pool of its shape as new ones."""

import os
import threading

import pytest
import ray
import torch
import torch.distributed as dist

from hybridflow.controller import (
    Dispatch,
    RayResourcePool,
    RayWorkerGroup,
    RoleSpec,
    Worker,
    kept_placement_groups,
    kept_process_counts,
    register,
)

# the shared cluster, and `keeping` (tests/conftest.py). The workers' module imports no more than they need
# (not conftest's models and roles): each test starts several processes of its own.
pytestmark = pytest.mark.usefixtures("local_ray")


class StateWorker(Worker):
    """Reports what a run could leave behind in its process, and leaves some of it."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state(self) -> dict:
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.world_size,
            "sum": total.item(),
            "left_variable": os.environ.get("LEFT_BY_A_RUN"),
            "first_draw": torch.rand(3).tolist(),  # from torch's default seed, as in a new process
            "dtype": str(torch.get_default_dtype()),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def leave_state(self, thread: bool = False) -> None:
        os.environ["LEFT_BY_A_RUN"] = "1"
        torch.manual_seed(12345)
        torch.rand(7)
        torch.set_default_dtype(torch.float64)
        if thread:  # a run's thread that never ends: its process cannot serve another run
            self.stop = threading.Event()
            threading.Thread(target=self.stop.wait, daemon=True).start()


def run_group(
    size: int, *, leave_thread: bool = False, keep: bool = True, cpus: float = 1.0, env: dict | None = None
) -> list[dict]:
    pool = RayResourcePool([size], cpus_per_worker=cpus, name="kept", worker_env=env)
    group = RayWorkerGroup(pool, RoleSpec(StateWorker), name="state")
    states = group.state()
    group.leave_state(leave_thread)
    pool.release(keep_processes=keep)
    return states


def pids(states: list[dict]) -> list[int]:
    return [s["pid"] for s in states]


def test_a_kept_process_serves_the_next_pool_of_its_shape_as_a_new_process(keeping):
    keeping(4)
    first = run_group(2)
    assert len(kept_placement_groups()) == 1
    second = run_group(2)
    assert pids(second) == pids(first)  # the same processes, rank for rank
    for state in second:
        assert state["world_size"] == 2 and state["sum"] == 3.0  # a new process group, joined by both
        assert state["left_variable"] is None and state["dtype"] == "torch.float32"
    assert [s["first_draw"] for s in second] == [s["first_draw"] for s in first]  # the default seed again
    # the environment is part of the shape: the one the processes get, the cluster's with the pool's on top
    given = ray.get_runtime_context().runtime_env["env_vars"]["LRU_CACHE_CAPACITY"]  # the shared cluster's
    assert pids(run_group(2, env={"LRU_CACHE_CAPACITY": given})) == pids(first)  # what the cluster gives anyway
    other = run_group(2, env={"LRU_CACHE_CAPACITY": str(int(given) + 1)})  # another shape: processes of its own
    assert set(pids(other)).isdisjoint(pids(first))


@pytest.mark.slow  # the fast tier keeps reuse itself; the limits' cases start 4-5 pools each
def test_a_process_with_a_running_thread_or_a_failed_run_is_not_kept(keeping):
    keeping(4)
    before = kept_process_counts()
    first = run_group(1, leave_thread=True)
    assert kept_placement_groups() == []
    counts = kept_process_counts()
    reason = "not kept: threads still running: "
    assert sum(n for k, n in counts.items() if k.startswith(reason)) == 1 + sum(
        n for k, n in before.items() if k.startswith(reason)
    )
    second = run_group(1, keep=False)
    assert set(pids(second)).isdisjoint(pids(first)) and kept_placement_groups() == []
    third = run_group(1)
    assert set(pids(third)).isdisjoint(pids(second))


@pytest.mark.slow  # the fast tier keeps reuse itself; the limits' cases start 4-5 pools each
def test_kept_processes_are_bounded_and_give_their_cpus_to_a_pool_that_needs_them(keeping):
    keeping(2)
    first = run_group(1)
    run_group(1, cpus=2.0)  # 2 kept
    run_group(1, cpus=3.0)  # a third shape: the oldest kept process is ended to stay within 2
    assert len(kept_placement_groups()) == 2
    assert set(pids(run_group(1))).isdisjoint(pids(first))
    free = ray.available_resources().get("CPU", 0.0)
    total = ray.cluster_resources()["CPU"]
    kept_cpus = sum(b.get("CPU", 0.0) for g in kept_placement_groups() for b in g.bundle_specs)
    assert kept_cpus == 4.0 and free <= total - kept_cpus  # the newest two: 3 CPUs and 1
    states = run_group(1, cpus=total, keep=False)  # only fits once every kept process is ended
    assert len(states) == 1 and kept_placement_groups() == []


def test_nothing_is_kept_unless_the_driver_asks(keeping):
    first = run_group(1)
    assert kept_placement_groups() == []
    assert set(pids(run_group(1))).isdisjoint(pids(first))
    with pytest.raises(ValueError, match="max_processes"):
        keeping(-1)


class MeshWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shard_and_gather(self, shape: tuple[int, ...], names: tuple[str, ...]) -> list[float]:
        """A weight split over the "tp" dimension of a mesh of ``shape``, then gathered whole."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        weight = torch.nn.Parameter(distribute_tensor(torch.arange(4.0), mesh["tp"], [Shard(0)]))
        return weight.detach().full_tensor().tolist()


def test_a_kept_process_forgets_the_device_meshes_of_the_run_before(keeping):
    """A mesh of the next run equal to one of the run before (its "tp" dimension: ranks {0, 1} and {2, 3} on 4
    processes, both times) must not find that run's process groups in DTensor's caches: they are gone, and the
    run before created more groups (a third dimension), so their names do not name this run's."""
    keeping(4)
    for shape, names in (((1, 2, 2), ("dp", "pp", "tp")), ((2, 2), ("dp", "tp"))):
        pool = RayResourcePool([4], name="kept")
        group = RayWorkerGroup(pool, RoleSpec(MeshWorker), name="mesh")
        assert group.shard_and_gather(shape, names) == [[0.0, 1.0, 2.0, 3.0]] * 4
        pool.release(keep_processes=True)
