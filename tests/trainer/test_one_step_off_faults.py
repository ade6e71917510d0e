"""One-step-off when a pool dies: the driver names the dead worker (group, rank, method) like any other, a
failing actor stops the generation running beside it, and no process of either pool, nor the driver's
generating thread, is left."""

import threading
import time
import uuid

import pytest
import ray
from test_one_step_off_e2e import overrides
from test_placement_failure import TAG_VARIABLE, worker_processes_left

from hybridflow.controller import WorkerError
from hybridflow.trainer.commands import train as train_main
from hybridflow.trainer.loop.generate_ahead import GenerateAhead
from hybridflow.trainer.loop.rl_trainer import RLTrainer
from hybridflow.trainer.setup.config import load_config

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_ray")]

ONE_STEP_OFF = ["trainer.async_training.mode=one_step_off", "trainer.placement=group_colocate"]


def rollout_dies_at_step_3(monkeypatch) -> None:
    """Kills the rollout pool's process (SIGKILL, through Ray) just before the batch of step 3 is asked for."""
    generate = GenerateAhead.generate

    def dying(self, step):
        if step == 3:
            ray.kill(self.groups.rollout.hosts[0])
        return generate(self, step)

    monkeypatch.setattr(GenerateAhead, "generate", dying)


def actor_dies_at_step_2(monkeypatch) -> None:
    """Kills the actor pool's process while the rollout generates the batch of step 3."""
    learn = RLTrainer.learn

    def dying(self, batch, step, timeline, metrics):
        if step == 2:
            ray.kill(self.groups.actor_rollout.hosts[0])
        learn(self, batch, step, timeline, metrics)

    monkeypatch.setattr(RLTrainer, "learn", dying)


@pytest.mark.parametrize(
    ("kill", "group", "method"),
    [
        (rollout_dies_at_step_3, "rollout", "generate_sequences"),
        (actor_dies_at_step_2, "actor_rollout", "compute_log_prob"),
    ],
)
def test_a_dead_pool_stops_the_run_naming_it_and_leaves_nothing(
    arithmetic_files, tmp_path, monkeypatch, kill, group, method
):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    kill(monkeypatch)
    config = load_config(overrides(arithmetic_files, tmp_path, *ONE_STEP_OFF, "trainer.total_training_steps=4"))
    with pytest.raises(WorkerError) as raised:
        train_main.run(config)
    error = raised.value
    assert (error.group, error.method, error.rank) == (group, method, 0)
    assert "died" in str(error) or "ActorDiedError" in str(error) or "RayActorError" in str(error)
    assert worker_processes_left(tag) == set()  # both pools' processes are gone
    # and the driver's background generation with them: a thread still inside a Ray call when the session
    # ends makes its next call start a new cluster (Ray's auto-init) whose processes die with that thread,
    # and the next run in this process, finding Ray started, uses it and is ended by Ray 60 s later
    time.sleep(1)
    assert [t.name for t in threading.enumerate() if t.name.startswith("generate-ahead")] == []
    assert not ray.is_initialized()
