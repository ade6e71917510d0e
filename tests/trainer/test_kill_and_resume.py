"""A run killed with SIGKILL in the middle of a step and resumed gives the metrics of a run that never stopped:
synchronous, synchronous with LoRA adapters, and one-step-off (killed after the batch of step 3 was generated,
while step 3 trains on it and the rollout's pool generates the batch of step 4). The uninterrupted run is made in
this process, on the module's Ray cluster, and so is the resumed one; the killed run is a command of its own that
joins that cluster (``trainer.ray_address``), as a driver joins any cluster: the kill ends the command, and Ray ends
its job's worker processes and placement groups."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from hybridflow.cli import main as cli
from hybridflow.data.tasks import write_task

# wall-clock times, throughput, MFU and memory: not reproducible
MEASUREMENTS = ("timing_s/", "perf/", "transfer/seconds", "async/trainer_wait_s", "async/rollout_idle_s")
MODES = {
    "sync": [],
    "one_step_off": [
        "trainer.async_training.mode=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=1",
    ],
    # LoRA adapters (the checkpoint holds them and their optimizer state), with a KL loss whose reference is the
    # actor with its adapters off
    "lora": [
        "actor_rollout_ref.model.lora.rank=4",
        "actor_rollout_ref.model.lora.alpha=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ],
}

# The arithmetic score, as every run gets it. With $PAUSE_DIR set, the scoring of step 3 (the
# driver scores each sample in turn: once before training, checking that the function scores the
# first row; then steps 1 and 2 score 8 samples each) announces itself with
# $PAUSE_DIR/paused and waits: the test kills the run there, deterministically in the middle of
# that step, however fast steps are.
REWARD = """
import os, time
from hybridflow.reward import get_scorer

calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    gate = os.environ.get("PAUSE_DIR")
    if gate and calls > 1 + 16:
        open(os.path.join(gate, "paused"), "w").close()
        time.sleep(600)
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)
"""


def args(files, run_dir, mode: str) -> list[str]:
    train, test = files
    reward = run_dir.parent / "reward.py"
    reward.write_text(REWARD)
    return [
        f"custom_reward_function.path={reward}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",  # 8 prompts: 2 steps per epoch, 2 epochs
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.total_epochs=2",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
        *MODES[mode],
    ]


def train(arguments: list[str], pause_dir=None) -> subprocess.Popen:
    """``hybridflow train`` as a command of its own, on the Ray cluster this process runs (a cluster of its own
    would cost seconds to start and stop, each time)."""
    cluster = f"trainer.ray_address={ray.get_runtime_context().gcs_address}"
    return subprocess.Popen(
        [sys.executable, "-m", "hybridflow.trainer.commands.train", *arguments, cluster],
        env={**os.environ, "PAUSE_DIR": str(pause_dir or "")},
        start_new_session=True,  # its own process group: the kill takes whatever the command started
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def records(run_dir) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r for r in map(json.loads, lines)}


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(MEASUREMENTS)}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kill_minus_9_mid_step_then_resume_matches_an_uninterrupted_run(local_ray, tmp_path, mode):
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    files = (data / "train.parquet", data / "test.parquet")

    reference_dir = tmp_path / "reference"
    assert cli(["train", *args(files, reference_dir, mode)]) == 0

    run_dir = tmp_path / "interrupted"
    gate = tmp_path / "gate"
    gate.mkdir()
    victim = train(args(files, run_dir, mode), pause_dir=gate)
    deadline = time.time() + 240
    while not (gate / "paused").exists():  # step 3 (the first of the second epoch) is scoring its samples
        assert time.time() < deadline and victim.poll() is None, "the run ended before step 3 scored"
        time.sleep(0.05)
    assert sorted(records(run_dir)) == [1, 2]  # step 2 is logged after its checkpoint is complete
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert 3 not in records(run_dir), "the kill came too late to interrupt step 3"

    assert cli(["train", *args(files, run_dir, mode)]) == 0  # resumed (resume_mode=auto), in this process

    expected, got = records(reference_dir), records(run_dir)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in (3, 4):
        want, have = comparable(expected[step]), comparable(got[step])
        if mode == "lora" and step == 3:  # the restarted engine takes the base once more, then adapters again
            synced = "switch/generation_weights_mb"
            assert have[synced] > 10 * want[synced] and got[4][synced] == expected[4][synced]
            want = {k: v for k, v in want.items() if not k.startswith("switch/")}
            have = {k: v for k, v in have.items() if not k.startswith("switch/")}
        assert want.keys() == have.keys() and len(want) > 30
        for key, value in want.items():
            assert abs(have[key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, have[key], value)
