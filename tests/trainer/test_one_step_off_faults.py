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
from hybridflow.trainer import main as train_main
from hybridflow.trainer.config import load_config
from hybridflow.trainer.one_step_off import OneStepOffTrainer

# checks that nothing started Ray, or runs that start and end their own cluster: the shared one (tests/conftest.py)
# is shut down first
pytestmark = pytest.mark.usefixtures("no_ray")

ONE_STEP_OFF = ["trainer.async_training.mode=one_step_off", "trainer.placement=group_colocate"]


class RolloutDiesAtStep3(OneStepOffTrainer):
    """Kills the rollout pool's process (SIGKILL, through Ray) just before the batch of step 3 is asked for."""

    def generate_ahead(self, step):
        if step == 3:
            ray.kill(self.groups.rollout.hosts[0])
        return super().generate_ahead(step)


class ActorDiesAtStep2(OneStepOffTrainer):
    """Kills the actor pool's process while the rollout generates the batch of step 3."""

    def learn(self, batch, metrics):
        if self.global_step == 2:
            ray.kill(self.groups.actor_rollout.hosts[0])
        super().learn(batch, metrics)


@pytest.mark.parametrize(
    ("loop", "group", "method"),
    [(RolloutDiesAtStep3, "rollout", "generate_sequences"), (ActorDiesAtStep2, "actor_rollout", "compute_log_prob")],
)
def test_a_dead_pool_stops_the_run_naming_it_and_leaves_nothing(
    arithmetic_files, tmp_path, monkeypatch, loop, group, method
):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VARIABLE, tag)
    monkeypatch.setattr(train_main, "OneStepOffTrainer", loop)
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
