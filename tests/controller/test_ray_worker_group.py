"""Real worker groups on a local Ray cluster: torch.distributed inside, dispatch from the driver."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hybridflow.controller import (
    Dispatch,
    Execute,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    Role,
    RoleSpec,
    Worker,
    WorkerError,
    register,
)
from hybridflow.controller.ray_runtime import ALLOCATOR_ENV, tuning_env
from hybridflow.controller.ray_worker_group import on_device
from hybridflow.protocol import DataProto, DataProtoFuture

pytestmark = pytest.mark.usefixtures("local_ray")  # the shared cluster (tests/conftest.py)


@pytest.fixture
def pool():
    """Makes resource pools and gives their CPUs back to the cluster after the test."""
    made = []

    def make(*args, **kwargs) -> RayResourcePool:
        made.append(RayResourcePool(*args, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.release()


class SumWorker(Worker):
    """Each rank sums its chunk; an all-reduce makes the total known to every rank."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def total(self, data: DataProto) -> DataProto:
        local = data.batch["x"].sum() * self.scale
        dist.all_reduce(local)
        n = len(data)
        return DataProto.from_dict(
            {"total": local.expand(n).clone(), "rank": torch.full((n,), self.rank), "x": data.batch["x"]}
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple[int, int, int]:
        return self.rank, self.world_size, os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allocator_env(self) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in ALLOCATOR_ENV}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self, keys: list[str]) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in keys}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_only(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def chunk_metrics(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": data.batch["x"].tolist()}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": fn(data.batch["x"])})


def _square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: the slow tier
def test_all_reduce_driven_by_one_dp_compute_proto_call(world_size, pool):
    group = RayWorkerGroup(pool([world_size]), RoleSpec(SumWorker, kwargs={"scale": 2.0}))
    assert group.whoami()[-1][:2] == (world_size - 1, world_size)
    data = DataProto.from_dict({"x": torch.arange(1.0, 8.0)})  # 7 rows: padding on both sizes
    out = group.total(data)
    # Padding repeats the first rows: 7 rows -> 8, the extra row is x=1.0.
    expected = 2.0 * (sum(range(1, 8)) + 1.0)
    assert out.batch["x"].tolist() == list(range(1, 8))
    assert out.batch["total"].tolist() == [expected] * 7
    per_rank = 8 // world_size
    assert out.batch["rank"].tolist() == [i // per_rank for i in range(7)]


def test_other_dispatch_and_execute_modes_on_real_workers(pool):
    group = RayWorkerGroup(pool([2]), RoleSpec(SumWorker), name="modes")
    assert group.rank_zero_only() == 0
    expected_env = {key: os.environ.get(key, value) for key, value in ALLOCATOR_ENV.items()}
    assert group.allocator_env() == [expected_env, expected_env]  # freed memory is kept for reuse
    metrics = group.chunk_metrics(DataProto.from_dict({"x": torch.arange(4.0)}))
    assert metrics == [{"rank": 0, "rows": [0.0, 1.0]}, {"rank": 1, "rows": [2.0, 3.0]}]
    squared = group.apply(_square, DataProto.from_dict({"x": torch.arange(3.0)}))
    assert squared.batch["x"].tolist() == [0.0, 1.0, 4.0]


def test_a_pool_gives_its_workers_its_environment_on_top_of_the_cluster_s(pool, monkeypatch):
    """The shared cluster gives every worker the allocator settings and the driver's import path; a pool's own
    variables win over the cluster's for its workers, and the rest of the cluster's environment stays (a run's
    tuning reaches its workers on a cluster started without it)."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    env = {"MALLOC_TRIM_THRESHOLD_": "12345", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"}
    group = RayWorkerGroup(pool([2], worker_env=env), RoleSpec(SumWorker), name="env")
    seen = group.environment([*env, "MALLOC_MMAP_THRESHOLD_", "PYTHONPATH"])
    assert [{key: worker[key] for key in env} for worker in seen] == [env, env]
    cluster_value = os.environ.get("MALLOC_MMAP_THRESHOLD_", ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"])
    assert all(worker["MALLOC_MMAP_THRESHOLD_"] == cluster_value and worker["PYTHONPATH"] for worker in seen)


def test_tuning_env_keeps_what_the_driver_set(monkeypatch):
    for key in ALLOCATOR_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "3")
    assert tuning_env(16) == {
        "MALLOC_MMAP_THRESHOLD_": str(1 << 32),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16",
        "LRU_CACHE_CAPACITY": "3",
    }


class MeshWorker(Worker):
    """dp=2 x tp=2: tensor-parallel peers must see the same chunk."""

    def __init__(self):
        super().__init__()
        self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        self.register_dispatch_mesh("train", self.mesh, dp_dim="dp")

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO("train"))
    def forward(self, data: DataProto) -> DataProto:
        rows = data.batch["x"].clone()
        peer_sum = rows.clone()
        dist.all_reduce(peer_sum, group=self.mesh.get_group("tp"))
        n = len(data)
        return DataProto.from_dict({"x": rows, "seen_by": torch.full((n,), self.rank), "tp_sum": peer_sum})

    @register(dispatch_mode=Dispatch.MESH_COMPUTE_PROTO("train"), blocking=False)
    def forward_async(self, data: DataProto) -> DataProto:
        return self.forward(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def coords(self) -> tuple[int, int]:
        return self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("tp")


def test_mesh_aware_dispatch_dp2_tp2(pool):
    group = RayWorkerGroup(pool([4]), RoleSpec(MeshWorker))
    assert group.coords() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    out = group.forward(DataProto.from_dict({"x": torch.arange(6.0)}))
    assert out.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # dp rank 0 (ranks 0, 1) had rows 0-2, dp rank 1 (ranks 2, 3) rows 3-5; ranks 0 and 2 are collected.
    assert out.batch["seen_by"].tolist() == [0, 0, 0, 2, 2, 2]
    # Both tp peers saw the same rows, so the sum over the tp group is twice each row.
    assert out.batch["tp_sum"].tolist() == [2 * v for v in range(6)]
    future = group.forward_async(DataProto.from_dict({"x": torch.arange(4.0)}))
    assert isinstance(future, DataProtoFuture) and len(future.futures) == 2
    assert future.get().batch["seen_by"].tolist() == [0, 0, 2, 2]


class ActorRole(Worker):
    def __init__(self, value: int):
        super().__init__()
        self.weights = torch.full((3,), float(value))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_address(self) -> int:
        return self.weights.data_ptr()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"actor": data.batch["x"] * self.weights[0]})


class RefRole(Worker):
    """Reads the actor's tensor through the process it shares with the actor role."""

    def __init__(self, value: int):
        super().__init__()
        self.weights = torch.full((3,), float(value))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ref": data.batch["x"] * self.weights[0]})


def test_colocated_roles_share_one_process_per_rank(pool):
    groups = RayWorkerGroup.colocated(pool([2]), {"actor": RoleSpec(ActorRole, (3,)), "ref": RoleSpec(RefRole, (5,))})
    actor_pids, ref_pids = groups["actor"].pid(), groups["ref"].pid()
    assert actor_pids == ref_pids and len(set(actor_pids)) == 2
    data = DataProto.from_dict({"x": torch.tensor([1.0, 2.0])})
    assert groups["actor"].score(data).batch["actor"].tolist() == [3.0, 6.0]
    assert groups["ref"].score(data).batch["ref"].tolist() == [5.0, 10.0]
    assert hasattr(groups["actor"], "weight_address") and not hasattr(groups["ref"], "weight_address")


class GatedProducer(Worker):
    """Produces its output only once the gate file exists: a driver that waited would deadlock."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: DataProto, gate: str) -> DataProto:
        deadline = time.time() + 60
        while not os.path.exists(gate):
            if time.time() > deadline:
                raise TimeoutError("the gate never opened")
            time.sleep(0.05)
        return DataProto.from_dict({"y": data.batch["x"] + 100, "producer": torch.full((len(data),), self.rank)})


class Consumer(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def consume(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["y"] * 2, "consumer": torch.full((len(data),), self.rank)})


def test_future_passes_from_one_group_to_another_without_the_driver(tmp_path, pool):
    shared = pool([2], max_colocate_count=2)
    producer = RayWorkerGroup(shared, RoleSpec(GatedProducer))
    consumer = RayWorkerGroup(shared, RoleSpec(Consumer))
    gate = tmp_path / "gate"
    started = time.time()
    produced = producer.produce(DataProto.from_dict({"x": torch.arange(4.0)}), str(gate))
    consumed = consumer.consume(produced)
    assert isinstance(produced, DataProtoFuture) and isinstance(consumed, DataProtoFuture)
    assert time.time() - started < 5  # nothing waited for the gated producer
    gate.touch()
    out = consumed.get()
    assert out.batch["z"].tolist() == [200.0, 202.0, 204.0, 206.0]
    assert out.batch["consumer"].tolist() == [0, 0, 1, 1]


def test_resource_pool_manager_maps_roles_to_shared_pools():
    shared = {"use_gpu": False, "cpus_per_worker": 1.0, "max_colocate_count": 2}
    manager = ResourcePoolManager(
        pool_spec={"global": [2]}, role_to_pool={Role.ActorRollout: "global", Role.Critic: "global"}, **shared
    )
    assert manager.get_pool(Role.ActorRollout) is manager.get_pool(Role.Critic)
    with pytest.raises(KeyError, match="role reward_model has no resource pool"):
        manager.get_pool(Role.RewardModel)
    with pytest.raises(ValueError, match="pool_spec does not define"):
        ResourcePoolManager(pool_spec={"a": [1]}, role_to_pool={Role.Critic: "b"}, **shared)


def test_pool_too_large_for_the_cluster_fails_clearly():
    too_big = RayResourcePool([1], cpus_per_worker=1000, ready_timeout_s=2)
    with pytest.raises(RuntimeError, match="could not place them"):
        RayWorkerGroup(too_big, RoleSpec(SumWorker))


class SlowOrFailing(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)  # blocking when called plainly
    def work(self, data: DataProto, seconds: float, fail_rank: int) -> DataProto:
        time.sleep(seconds)
        if self.rank == fail_rank:
            raise ArithmeticError(f"rank {self.rank} cannot")
        return DataProto.from_dict({"y": data.batch["x"] * 2})


def test_future_of_a_blocking_method_returns_at_once_and_names_a_failing_rank(pool):
    group = RayWorkerGroup(pool([2]), RoleSpec(SlowOrFailing), name="slow")
    data = DataProto.from_dict({"x": torch.arange(4.0)})
    started = time.time()
    pending = group.work.future(data, 2.0, -1)
    assert isinstance(pending, DataProtoFuture) and time.time() - started < 1.5  # did not wait for the 2 s
    assert pending.get().batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert group.work(data, 0.0, -1).batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]  # the plain call still blocks
    with pytest.raises(WorkerError) as raised:
        group.work.future(data, 0.0, 1).get()
    assert raised.value.group == "slow" and raised.value.rank == 1 and raised.value.method == "work"
    assert "ArithmeticError: rank 1 cannot" in str(raised.value)


def test_workers_report_the_spans_of_their_calls(pool):
    group = RayWorkerGroup(pool([2]), RoleSpec(SlowOrFailing), name="slow")
    group.take_spans()  # construction is not a call
    before = time.time()
    group.work(DataProto.from_dict({"x": torch.arange(2.0)}), 0.2, -1)
    per_rank = group.take_spans()
    assert len(per_rank) == 2
    for spans in per_rank:
        ((role, method, start, end),) = spans
        assert role == "slow" and method == "work" and before <= start and end - start >= 0.2
    assert group.take_spans() == [[], []]  # taken once


def test_a_gpu_rank_gets_its_data_proto_arguments_on_its_device_and_the_caller_s_stay():
    """WorkerHost.call moves DataProto arguments to the rank's device and results back to the CPU (on_device);
    meta tensors stand in for a GPU's here."""
    data = DataProto.from_dict({"ids": torch.arange(6).view(3, 2)}, {"uid": ["a", "b", "c"]}, {"step": 4})
    assert on_device(data, torch.device("cpu")) is data  # already there: the same object, nothing copied
    moved = on_device(data, torch.device("meta"))
    assert moved.batch["ids"].device.type == "meta" and moved.batch["ids"].shape == (3, 2)
    assert data.batch["ids"].device.type == "cpu"
    assert list(moved.non_tensor_batch["uid"]) == ["a", "b", "c"] and moved.meta_info == {"step": 4}
    assert on_device("not a DataProto", torch.device("meta")) == "not a DataProto"
