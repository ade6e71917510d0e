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
from hybridflow.trainer.commands import train as train_main
from hybridflow.trainer.loop.async_queue import ChunkGenerator
from hybridflow.trainer.loop.rl_trainer import RLTrainer
from hybridflow.trainer.setup.config import load_config

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_ray")]


def rollout_dies_at_chunk_3(monkeypatch) -> None:
    """Kills the rollout pool's process (SIGKILL, through Ray) as the third generation call starts."""
    generate_chunk = ChunkGenerator.generate_chunk

    def dying(self, prompts, chunk):
        if chunk == 3:
            ray.kill(self.groups.rollout.hosts[0])
        return generate_chunk(self, prompts, chunk)

    monkeypatch.setattr(ChunkGenerator, "generate_chunk", dying)


def actor_dies_at_step_2(monkeypatch) -> None:
    """Kills the actor pool's process at step 2, while the rollouter generates ahead."""
    learn = RLTrainer.learn

    def dying(self, batch, step, timeline, metrics):
        if step == 2:
            ray.kill(self.groups.actor_rollout.hosts[0])
        learn(self, batch, step, timeline, metrics)

    monkeypatch.setattr(RLTrainer, "learn", dying)


@pytest.mark.parametrize(
    ("kill", "group", "method"),
    [
        (rollout_dies_at_chunk_3, "rollout", {"generate_sequences"}),
        # ray.kill returns before the process is gone: the step's first call (the log-probs) usually finds it dead,
        # but on an idle machine it can still answer, and then the update is the call that fails
        (actor_dies_at_step_2, "actor_rollout", {"compute_log_prob", "update_actor"}),
    ],
)
def test_a_dead_pool_stops_the_run_naming_it_and_leaves_nothing(
    arithmetic_files, tmp_path, monkeypatch, kill, group, method
):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    kill(monkeypatch)
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
