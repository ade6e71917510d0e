"""A worker that raises: the driver sees its exception and traceback, and the Ray it started is gone."""

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
    WorkerError,
    ray_session,
    register,
)
from hybridflow.protocol import DataProto

pytestmark = pytest.mark.usefixtures("no_ray")  # each test starts and ends a Ray of its own


class FailingWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def step(self, data: DataProto) -> DataProto:
        if self.rank == 1:
            check_batch(data.batch["x"])
        total = data.batch["x"].sum()
        dist.all_reduce(total)  # rank 0 waits here for a peer that never comes
        return data


def check_batch(x: torch.Tensor) -> None:
    raise ValueError(f"bad value {int(x.max())} in the batch")


class BrokenInit(Worker):
    def __init__(self):
        super().__init__()
        raise KeyError("missing_setting")


def test_worker_exception_reaches_the_driver_and_ray_is_shut_down():
    with pytest.raises(WorkerError) as caught:
        with ray_session(num_cpus=4):
            group = RayWorkerGroup(RayResourcePool([2]), RoleSpec(FailingWorker), name="failing")
            group.step(DataProto.from_dict({"x": torch.arange(4.0)}))
    error = caught.value
    assert error.rank == 1 and error.method == "step" and error.group == "failing"
    assert isinstance(error.cause, ValueError) and "bad value 3 in the batch" in str(error)
    assert "check_batch" in error.remote_traceback and "test_worker_errors.py" in error.remote_traceback
    assert not ray.is_initialized()


def test_constructor_exception_names_the_init():
    with pytest.raises(WorkerError, match="method '__init__' raised KeyError: 'missing_setting'"):
        with ray_session(num_cpus=4):
            RayWorkerGroup(RayResourcePool([1]), RoleSpec(BrokenInit))
    assert not ray.is_initialized()
