"""A multi-turn GRPO run through real Ray worker groups: agent loops on the native engine, a tool from the tools
file, inserted tokens masked out of the loss, and a reward on the last turn that training raises."""

import json

import pytest
from agent_loops import CALCULATE_THEN_ANSWER

from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow

# the fraction of digits in the model's last turn (the tool's "42" is in the text but not in that turn); 0 unless
# the conversation facts say what the loop did
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not ("42" in solution_str and extra_info["tool_calls"] == 1 and extra_info["num_turns"] == 2):
        return 0.0
    text = extra_info["final_response"].replace(" ", "")
    return sum(c.isdigit() for c in text) / max(1, len(text))
"""


# The engine and modes the loops run in. Not vLLM: its multi-turn conversations equal the native engine's token for
# token (tests/rollout/vllm/test_vllm_agent.py), and a GRPO run on it learns (tests/trainer/test_vllm_e2e.py)
BACKENDS = {
    "native": [],
    # the agent loops on the rollout role's own pool, one step off policy (docs/async.md): each batch trains
    # one policy version late, and this run needed a few more steps to learn (10 steps reached 0.21)
    "native_one_step_off": [
        "trainer.total_training_steps=14",
        "trainer.async_training.mode=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=1",
    ],
    # the same, fully asynchronous: the rollouter's thread runs the agent loops, at most one version ahead
    "native_fully_async": [
        "trainer.total_training_steps=14",
        "trainer.async_training.mode=fully_async",
        "trainer.async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=1",
    ],
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_multi_turn_grpo_learns_to_answer_with_digits_after_the_tool(local_ray, arithmetic_files, tmp_path, backend):
    (tmp_path / "loop.py").write_text(CALCULATE_THEN_ANSWER)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "tools.yaml").write_text("tools:\n  - name: calculator\n")
    train, _ = arithmetic_files
    run_dir = tmp_path / "run"
    config = load_config(
        [
            f"data.train_files=[{train}]",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.response_length=32",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.default_agent={tmp_path / 'loop.py'}:CalculateThenAnswer",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            "trainer.total_training_steps=10",
            "trainer.total_epochs=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
            f"custom_reward_function.path={tmp_path / 'reward.py'}",
            *BACKENDS[backend],
        ]
    )
    run(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in records]
    assert len(scores) == config.trainer.total_training_steps
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.15 and last > first + 0.4, scores
    step = records[-1]
    assert step["agent/tool_calls_per_sample"] == 1.0 and step["agent/num_turns/mean"] == 2.0
    assert step["agent/stop/failed"] == 0.0 and step["agent/tool_error_rate"] == 0.0
    # the inserted tokens are in the responses but not trained on: generated = 4 + up to 6 per sample
    assert step["response_length/mean"] > 10 and step["response_length/max"] <= 32
