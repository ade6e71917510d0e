"""GRPO on a verifiers environment's episodes, on real Ray worker groups: the environment runs in its own venv
(.venv-verifiers) and its model calls reach the run's endpoint as token ids (verifiers' TrainClient). A two-turn
environment whose reward the tiny model can learn (the fraction of digits in its second reply) is trained through
the endpoint and the reward rises (sync); one_step_off and fully_async run the shipped reasoning-gym taskset for
two steps on the rollout's own pool. On vLLM the endpoint makes the same engine calls for the token route as for the
chat route (rollout/agent_server/turns.py), whose conversations there equal the native engine's
(tests/rollout/vllm/test_vllm_agent_endpoint.py)."""

import json
from pathlib import Path

import pytest

from hybridflow.data.tasks import write_verifiers_env
from hybridflow.trainer.commands.train import run
from hybridflow.trainer.setup.config import load_config
from hybridflow.verifiers_runner.launch import verifiers_python

pytestmark = pytest.mark.slow

ENVIRONMENTS = Path(__file__).parents[2] / "examples" / "environments"

# a verifiers environment as a user writes one: a taskset of questions and a two-turn exchange, scored by the
# fraction of digits in the model's second reply
DIGITS_ENV = """
import verifiers.v1 as vf


class DigitsTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        text = trace.last_reply.replace(" ", "")
        return sum(c.isdigit() for c in text) / max(1, len(text))


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        for a in range(8):
            for b in range(8):
                yield DigitsTask(vf.TaskData(prompt=f"What is {a} + {b}?"), self.config.task)


class DigitsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "hybridflow-chat"}, runtime=vf.SubprocessConfig())


class DigitsEnv(vf.Env[DigitsEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn("The calculator says 42.")


__all__ = ["DigitsTaskset", "DigitsEnv"]
"""

SMALL = [
    "trainer.total_training_steps=2",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "algorithm.rollout_correction.rollout_is=token",
    "trainer.placement=group_colocate",
    "trainer.n_workers_per_node=1",
]
MODES = {
    "one_step_off": [*SMALL, "trainer.async_training.mode=one_step_off"],
    "fully_async": [
        *SMALL,
        "trainer.async_training.mode=fully_async",
        "trainer.async_training.max_staleness=1",
        "trainer.async_training.partial_rollout=false",
    ],
}
RG_ARGS = {"taskset": {"dataset": "chain_sum", "settings": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}}


def records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_two_turn_verifiers_environment_trains_through_the_endpoint(local_ray, tmp_path):
    (tmp_path / "digits_env.py").write_text(DIGITS_ENV)
    data = tmp_path / "data"
    write_verifiers_env("digits_env", {}, str(tmp_path), verifiers_python(), data, train=48, test=8, seed=0)
    run_dir = tmp_path / "run"
    config = load_config(
        [
            f"data.train_files=[{data / 'train.parquet'}]",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.response_length=48",
            "actor_rollout_ref.rollout.agent.max_prompt_tokens=128",
            "actor_rollout_ref.rollout.agent.verifiers.env=digits_env",
            f"actor_rollout_ref.rollout.agent.verifiers.path={tmp_path}",
            # the first turn short, as in the endpoint's own test: the budget is for the second
            "actor_rollout_ref.rollout.agent.verifiers.args={agent: {sampling: {max_tokens: 4}}}",
            "actor_rollout_ref.actor.optim.lr=2e-2",
            # fp32 on every host (auto is bf16 where the CPU has bf16 units): the run learns as it was tuned to
            "actor_rollout_ref.actor.fsdp.param_dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32",
            # 12 steps: every branch is trained, so the first replies (cut at 4 tokens, their text not the answer)
            # share each update with the second, and the learning takes two steps more than on the last branches
            "trainer.total_training_steps=12",
            "trainer.total_epochs=2",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
        ]
    )
    run(config)
    records = records_of(run_dir)
    scores = [r["critic/score/mean"] for r in records]
    assert len(scores) == 12
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert first < 0.15 and last > first + 0.4, scores
    step = records[-1]
    assert step["agent/stop/failed"] == 0.0  # every episode's trace matched the endpoint's record
    # the default renderer re-renders the conversation each turn: a cut first turn whose text does not tokenise
    # back to the same ids starts a second branch; every branch is trained, each session counted once in the scores
    branched = [r for r in records if r["agent/branches_per_session"] > 1.0]
    assert branched, [r["agent/branches_per_session"] for r in records]
    for record in records:
        assert record["agent/trained_branches_per_session"] == record["agent/branches_per_session"]
        if record["agent/stop/failed"] == 0.0:  # a failed episode's tokens leave the update with it
            assert record["agent/trained_token_share"] == 1.0  # every generated token of every branch is trained
        # token-exact rows: the trainer's log-probs of every branch's tokens are the sampler's (fp32)
        assert record["rollout/log_prob_diff_max"] < 1e-4
    assert step["agent/requests_per_session"] == 2.0 and 1.0 <= step["agent/branches_per_session"] <= 2.0
    assert step["agent/returned/turns"] == 2.0 and step["agent/returned/reward/digits"] == pytest.approx(scores[-1])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_reasoning_gym_taskset_runs_in_the_asynchronous_modes(local_ray, tmp_path, mode):
    data = tmp_path / "data"
    write_verifiers_env(
        "reasoning_gym_single", RG_ARGS, str(ENVIRONMENTS), verifiers_python(), data, train=16, test=4, seed=0
    )
    run_dir = tmp_path / "run"
    config = load_config(
        [
            f"data.train_files=[{data / 'train.parquet'}]",
            "actor_rollout_ref.rollout.response_length=16",
            "actor_rollout_ref.rollout.agent.max_prompt_tokens=128",
            "actor_rollout_ref.rollout.agent.verifiers.env=reasoning_gym_single",
            f"actor_rollout_ref.rollout.agent.verifiers.path={ENVIRONMENTS}",
            f"actor_rollout_ref.rollout.agent.verifiers.args={json.dumps(RG_ARGS)}",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={run_dir}",
            *MODES[mode],
        ]
    )
    run(config)
    records = records_of(run_dir)
    assert len(records) == 2
    for step in records:
        assert step["agent/stop/failed"] == 0.0 and step["agent/requests_per_session"] == 1.0
        assert "actor/pg_loss" in step and 0.0 <= step["critic/score/mean"] <= 1.0
