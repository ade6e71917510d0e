"""A run killed with SIGKILL in the middle of a step and resumed gives the metrics of a run that never stopped:
synchronous, synchronous with LoRA adapters, Ulysses sequence parallelism, a LoRA student distilled from a teacher,
one-step-off (killed after the batch of step 3 was generated, while step 3 trains on it and the rollout's pool
generates the batch of step 4), and the agent endpoint (killed while an agent of step 3 holds its session open). The
uninterrupted run is made in this process, on the module's Ray cluster, and so is the resumed one; the killed run is
a command of its own that joins that cluster (``trainer.ray_address``), as a driver joins any cluster: the kill ends
the command, and Ray ends its job's worker processes and placement groups."""

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
from hybridflow.models import resolve_model_path

pytestmark = pytest.mark.slow

# wall-clock times, throughput, MFU and memory: not reproducible
MEASUREMENTS = (
    "timing_s/",
    "perf/",
    "transfer/seconds",
    "async/trainer_wait_s",
    "async/rollout_idle_s",
    "agent/server_ms_per_request",
    "agent/returned/seconds",  # each agent's wall time
)
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
    # the agent endpoint: the user's agent (AGENT) talks to the rollout's endpoint; the kill comes while sessions of
    # step 3 are open, and the resumed run must regenerate them, none counted twice
    "agent_endpoint": [
        "actor_rollout_ref.rollout.response_length=32",  # after the args response_length, so it wins
        "actor_rollout_ref.rollout.agent.max_prompt_tokens=128",
    ],
    "lora": [
        "actor_rollout_ref.model.lora.rank=4",
        "actor_rollout_ref.model.lora.alpha=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ],
    # Ulysses: the actor, its reference and a critic (PPO with GAE) each split their micro-batches' tokens over the
    # 2 ranks (tests/trainer/test_sequence_parallel_e2e.py compares them with sp = 1)
    "ulysses": [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        "algorithm.adv_estimator=gae",
        "critic.ulysses_sequence_parallel_size=2",
        "critic.ppo_mini_batch_size=2",
        "critic.fsdp.param_dtype=fp32",
        "critic.optim.lr=1e-3",
    ],
    # pipeline stages: the actor, its reference and a critic (PPO with GAE) each split into 2 stages over the 2 ranks
    # (1F1B, two micro-batches a step; tests/trainer/test_pipeline_parallel_e2e.py compares them with pp = 1)
    "pipeline": [
        "actor_rollout_ref.actor.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.ref.pipeline_model_parallel_size=2",
        "algorithm.adv_estimator=gae",
        "critic.pipeline_model_parallel_size=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=2",
        "critic.fsdp.param_dtype=fp32",
        "critic.optim.lr=1e-3",
    ],
    # a mixture-of-experts critic (PPO with GAE; tiny-qwen3-moe beside the tiny-llama actor: one tokenizer) whose
    # experts split over the 2 ranks (tests/trainer/test_expert_parallel_e2e.py compares it with ep = 1)
    # mixtures of experts: the actor (with routing replay) and the critic each split their experts over the 2 ranks
    # (tests/trainer/test_expert_parallel_e2e.py compares them with ep = 1)
    "experts": [
        "actor_rollout_ref.model.path=tiny-qwen3-moe",
        "actor_rollout_ref.actor.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "algorithm.adv_estimator=gae",
        "critic.model.path=tiny-qwen3-moe",
        "critic.expert_model_parallel_size=2",
        "critic.router_aux_loss_coef=0.01",
        "critic.ppo_mini_batch_size=2",
        "critic.fsdp.param_dtype=fp32",
        "critic.optim.lr=1e-3",
    ],
    # on-policy distillation of a LoRA student, mixed with the task reward, the teacher (tiny-llama of another seed,
    # args puts its directory in) on a pool of its own
    "lora_distill": [
        "actor_rollout_ref.model.lora.rank=4",
        "actor_rollout_ref.model.lora.alpha=8",
        "algorithm.distillation.reward_coef=0.5",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=1",
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


# The agent of the agent_endpoint mode, two requests per session, rewarded by the fraction of digits. It pauses as
# REWARD does, but in the rollout's worker (whose environment is the cluster's): while the folder "gate" beside this
# file exists, the first session of step 3 (after the 16 of steps 1 and 2) to have its first answer announces itself
# in it and waits, its session open, the step's other sessions going on meanwhile.
AGENT = """
import os, time
import openai

GATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate")


def digits_agent(base_url, api_key, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["raw_prompt"])
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    if os.path.isdir(GATE):
        with open(os.path.join(GATE, "sessions"), "a") as log:
            log.write("x")
        if os.path.getsize(os.path.join(GATE, "sessions")) > 16:
            open(os.path.join(GATE, "paused"), "w").close()
            time.sleep(600)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "42?"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    text = (second.choices[0].message.content or "").replace(" ", "")
    return {"reward": sum(c.isdigit() for c in text) / max(1, len(text)), "first_tokens": first.usage.completion_tokens}
"""


def args(files, run_dir, mode: str) -> list[str]:
    train, test = files
    if mode == "agent_endpoint":
        agent = run_dir.parent / "agent.py"
        agent.write_text(AGENT)
        scoring = f"actor_rollout_ref.rollout.agent.function={agent}:digits_agent"
    else:
        reward = run_dir.parent / "reward.py"
        reward.write_text(REWARD)
        scoring = f"custom_reward_function.path={reward}"
    teacher = [f"teacher.model.path={resolve_model_path('tiny-llama', seed=1)}"] if mode == "lora_distill" else []
    return [
        *teacher,
        scoring,
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",  # 8 prompts: 2 steps per epoch, 2 epochs
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        # fp32 on every host: where the CPU has bf16 units, auto is bf16, whose packed kernels give a row numbers
        # that depend on the rows batched with it (the endpoint's agents batch as they arrive)
        "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
        "actor_rollout_ref.ref.fsdp.param_dtype=fp32",
        "actor_rollout_ref.rollout.dtype=fp32",
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
    if mode == "agent_endpoint":
        assert len((gate / "sessions").read_text()) > 16  # a session of step 3 was open when the run was killed
        for path in gate.iterdir():
            path.unlink()
        gate.rmdir()  # the resumed run's agents do not wait

    assert cli(["train", *args(files, run_dir, mode)]) == 0  # resumed (resume_mode=auto), in this process

    expected, got = records(reference_dir), records(run_dir)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in (3, 4):
        want, have = comparable(expected[step]), comparable(got[step])
        if mode.startswith("lora") and step == 3:  # the restarted engine takes the base once more, then adapters again
            synced = "switch/generation_weights_mb"
            assert have[synced] > 10 * want[synced] and got[4][synced] == expected[4][synced]
            want = {k: v for k, v in want.items() if not k.startswith("switch/")}
            have = {k: v for k, v in have.items() if not k.startswith("switch/")}
        assert want.keys() == have.keys() and len(want) > 30
        assert mode != "lora_distill" or 0 < want["distill/advantage_share"] <= 1
        for key, value in want.items():
            assert abs(have[key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, have[key], value)
