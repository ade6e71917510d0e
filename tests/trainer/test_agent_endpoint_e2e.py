"""GRPO through the agent endpoint on real Ray worker groups: the user's agent, written with the openai SDK, talks
to the run's endpoint; its two-turn conversations are trained (the inserted user turn masked out) and the reward
it returns rises (sync); one_step_off and fully_async run the same agents on the rollout's own pool for two
steps."""

import json

import pytest

from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config

pytestmark = pytest.mark.slow

# The tiny random model cannot call tools; the agent asks twice, as a user would: a first short turn, a user message
# with the tool's result, then the answer, scored by the fraction of digits in it.
AGENT = """
import openai


def digits_agent(base_url, api_key, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["raw_prompt"])
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "The calculator says 42."})
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    text = (second.choices[0].message.content or "").replace(" ", "")
    return {"reward": sum(c.isdigit() for c in text) / max(1, len(text)), "first_tokens": first.usage.completion_tokens}
"""

# An OpenAI Agents SDK `Agent` with a function tool, on the SDK's default Responses API, as a coroutine in the
# rollout's event loop; its reward is the fraction of digits in its final output. The random model seldom ends a turn
# within the budget: the endpoint answers such a turn as `incomplete` (max_output_tokens), which the SDK raises as
# ModelBehaviorError; the agent scores it 0, and the sample is trained.
AGENTS_SDK = """
import openai
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import ModelBehaviorError

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    \"\"\"Evaluate an arithmetic expression.\"\"\"
    return "42"


async def sdk_agent(base_url, api_key, row):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = OpenAIResponsesModel(model="policy", openai_client=client)
    agent = Agent(name="calculator agent", instructions="Answer with digits.", tools=[calculator], model=model)
    try:
        result = await Runner.run(agent, row["raw_prompt"][-1]["content"], max_turns=3)
    except ModelBehaviorError:
        return 0.0
    text = str(result.final_output).replace(" ", "")
    return sum(c.isdigit() for c in text) / max(1, len(text))
"""

# the asynchronous modes only have to run the endpoint's agents on the rollout's own pool: two small steps
SMALL = [
    "trainer.total_training_steps=2",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
]
MODES = {
    "sync": [],
    "one_step_off": [
        *SMALL,
        "trainer.async_training.mode=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=1",
    ],
    "fully_async": [
        *SMALL,
        "trainer.async_training.mode=fully_async",
        "trainer.async_training.max_staleness=1",
        "trainer.async_training.partial_rollout=false",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.placement=group_colocate",
        "trainer.n_workers_per_node=1",
    ],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_openai_sdk_agent_trains_through_the_endpoint(local_ray, arithmetic_files, tmp_path, mode):
    (tmp_path / "agent.py").write_text(AGENT)
    train, _ = arithmetic_files
    run_dir = tmp_path / "run"
    config = load_config(
        [
            f"data.train_files=[{train}]",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.response_length=48",
            "actor_rollout_ref.rollout.agent.max_prompt_tokens=128",
            f"actor_rollout_ref.rollout.agent.function={tmp_path / 'agent.py'}:digits_agent",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            "trainer.total_training_steps=10",
            "trainer.total_epochs=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
            *MODES[mode],
        ]
    )
    run(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in records]
    assert len(scores) == config.trainer.total_training_steps
    if mode == "sync":
        first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
        assert first < 0.15 and last > first + 0.4, scores
    step = records[-1]
    assert step["agent/requests_per_session"] == 2.0 and step["agent/branches_per_session"] == 1.0
    # a first turn is 4 tokens, or fewer where the model ended it
    assert step["agent/stop/failed"] == 0.0 and 1.0 <= step["agent/returned/first_tokens"] <= 4.0
    assert step["agent/num_turns/mean"] == 2.0


def test_an_agents_sdk_agent_trains_through_the_responses_api(local_ray, arithmetic_files, tmp_path):
    (tmp_path / "sdk_agent.py").write_text(AGENTS_SDK)
    train, _ = arithmetic_files
    run_dir = tmp_path / "run"
    config = load_config(
        [
            f"data.train_files=[{train}]",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=24",
            "actor_rollout_ref.rollout.agent.max_prompt_tokens=512",
            f"actor_rollout_ref.rollout.agent.function={tmp_path / 'sdk_agent.py'}:sdk_agent",
            "trainer.total_training_steps=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
        ]
    )
    run(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for step in records:
        assert step["agent/stop/failed"] == 0.0 and step["agent/requests_per_session"] >= 1.0
        assert step["response_length/mean"] > 0 and "actor/pg_loss" in step
