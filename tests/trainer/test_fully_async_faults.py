"""Fully asynchronous training when a pool dies: the driver names the dead worker (group, rank, method), a
failing actor stops the rollouter generating beside it, and no process of either pool, nor the rollouter's
thread, is left."""

import threading
import time
import uuid

import pytest
import ray
from test_fully_async_e2e import FULLY_ASYNC, overrides
from test_placement_failure import TAG_VARIABLE, worker_processes_left

from hybridflow.controller import WorkerError
from hybridflow.trainer import main as train_main
from hybridflow.trainer.config import load_config
from hybridflow.trainer.fully_async import FullyAsyncTrainer

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = pytest.mark.usefixtures("no_ray")


class RolloutDiesAtChunk3(FullyAsyncTrainer):
    """Kills the rollout pool's process (SIGKILL, through Ray) as the third generation call starts."""

    def generate_chunk(self, prompts, chunk):
        if chunk == 3:
            ray.kill(self.groups.rollout.hosts[0])
        return super().generate_chunk(prompts, chunk)


class ActorDiesAtStep2(FullyAsyncTrainer):
    """Kills the actor pool's process at step 2, while the rollouter generates ahead."""

    def learn(self, batch, metrics):
        if self.global_step == 2:
            ray.kill(self.groups.actor_rollout.hosts[0])
        super().learn(batch, metrics)


@pytest.mark.parametrize(
    ("loop", "group", "method"),
    [
        (RolloutDiesAtChunk3, "rollout", {"generate_sequences"}),
        # ray.kill returns before the process is gone: the step's first call (the log-probs) usually finds it dead,
        # but on an idle machine it can still answer, and then the update is the call that fails
        (ActorDiesAtStep2, "actor_rollout", {"compute_log_prob", "update_actor"}),
    ],
)
def test_a_dead_pool_stops_the_run_naming_it_and_leaves_nothing(
    arithmetic_files, tmp_path, monkeypatch, loop, group, method
):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    monkeypatch.setattr(train_main, "FullyAsyncTrainer", loop)
    config = load_config(
        overrides(
            arithmetic_files,
            tmp_path,
            *FULLY_ASYNC,
            "trainer.async_training.max_staleness=2",
            "trainer.total_training_steps=4",
        )
    )
    with pytest.raises(WorkerError) as raised:
        train_main.run(config)
    error = raised.value
    assert (error.group, error.rank) == (group, 0) and error.method in method
    assert "died" in str(error) or "ActorDiedError" in str(error) or "RayActorError" in str(error)
    assert worker_processes_left(tag) == set()  # both pools' processes are gone
    time.sleep(1)
    assert [t.name for t in threading.enumerate() if t.name == "rollouter"] == []
    assert not ray.is_initialized()
