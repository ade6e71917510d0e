"""Fully asynchronous training killed with SIGKILL in the middle of a step, with groups queued ahead and prompts
in flight, then resumed: every prompt of the data set is trained exactly once per epoch (nothing lost with
the queue, nothing trained twice), and no group trains more than max_staleness versions stale."""

import json
import os
import pickle
import signal
import time

import pytest
from test_kill_and_resume import train

from hybridflow.cli import main as cli
from hybridflow.data.tasks import write_task
from hybridflow.run_files import TRAINED_PROMPTS_FILE
from hybridflow.trainer.loop.async_queue import ROLLOUTER_STATE

pytestmark = pytest.mark.slow

MAX_STALENESS = 2

# The arithmetic score. With $PAUSE_DIR set, the scoring of step 5 (the trainer scores each training sample in
# turn: once before training, checking the function; then 4 samples per step) announces itself and waits: the test
# kills the run there, in the middle of the first step of the second epoch.
REWARD = """
import os, time
from hybridflow.reward import get_scorer

calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += extra_info["split"] == "train"  # validation scores test rows
    gate = os.environ.get("PAUSE_DIR")
    if gate and calls > 1 + 4 * 4:
        open(os.path.join(gate, "paused"), "w").close()
        time.sleep(600)
    time.sleep(0.05)  # a trainer slower than the rollout: the queue fills up to the bound
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)
"""


def args(files, run_dir) -> list[str]:
    train, test = files
    reward = run_dir.parent / "reward.py"
    reward.write_text(REWARD)
    return [
        f"custom_reward_function.path={reward}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=2",  # 8 prompts: 4 steps per epoch, 2 epochs
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "trainer.total_epochs=2",
        "trainer.save_freq=1",
        "trainer.test_freq=4",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.n_workers_per_node=1",
        "trainer.placement=group_colocate",
        "trainer.async_training.mode=fully_async",
        f"trainer.async_training.max_staleness={MAX_STALENESS}",
        "trainer.async_training.chunk_prompts=1",
        "algorithm.rollout_correction.rollout_is=token",
        f"trainer.default_local_dir={run_dir}",
    ]


def lineage(run_dir) -> dict[int, dict]:
    """Each step's record; a resumed run drops those after its checkpoint, as it does their metrics."""
    records = [json.loads(line) for line in (run_dir / TRAINED_PROMPTS_FILE).read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), steps  # each step once
    return {r["step"]: r for r in records}


def test_kill_minus_9_then_resume_trains_every_prompt_once_per_epoch(local_ray, tmp_path):
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    files = (data / "train.parquet", data / "test.parquet")

    run_dir = tmp_path / "run"
    gate = tmp_path / "gate"
    gate.mkdir()
    victim = train(args(files, run_dir), pause_dir=gate)
    deadline = time.time() + 300
    while not (gate / "paused").exists():
        assert time.time() < deadline and victim.poll() is None, victim.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert sorted(lineage(run_dir)) == [1, 2, 3, 4]

    # the checkpoint after step 4 holds generation done ahead: queued groups, or prompts that were in flight
    state = pickle.loads((run_dir / "global_step_4" / ROLLOUTER_STATE).read_bytes())
    assert len(state["queue"]) + len(state["backlog"]) > 0
    assert len(state["queue"]) <= MAX_STALENESS * 2 + 2

    assert cli(["train", *args(files, run_dir)]) == 0  # resumed (resume_mode=auto), in this process

    steps = lineage(run_dir)
    assert sorted(steps) == list(range(1, 9))
    for epoch in (0, 1):
        indices = sorted(i for step in range(4 * epoch + 1, 4 * epoch + 5) for i in steps[step]["index"])
        assert indices == list(range(8)), (epoch, indices)
    for step, record in steps.items():
        assert all(0 <= step - 1 - version <= MAX_STALENESS for version in record["version"]), (step, record)
    metrics = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == list(range(1, 9)) and "val/score/mean" in metrics[8]
