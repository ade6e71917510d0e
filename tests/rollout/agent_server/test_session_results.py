"""What an external session's end says: a giving-up names the run's agents as the run set them (a verifiers
environment, external agents), and a reward or metric that is not a finite number is refused."""

import asyncio
import dataclasses

import pytest
from endpoint_helpers import agent_config

from hybridflow.rollout.agent_server.errors import ApiError
from hybridflow.rollout.agent_server.sessions import SessionTable


def ended(config, body):
    async def run():
        table = SessionTable(config, "hf-run-key")
        session = table.open(0, {}, external=True)
        table.finish(session.key, session.id, body)
        return session.result.result()

    return asyncio.run(run())


def verifiers_config():
    config = agent_config("")
    return dataclasses.replace(config, verifiers=dataclasses.replace(config.verifiers, env="digits_env"))


@pytest.mark.parametrize(
    "config, named",
    [
        (verifiers_config(), "the verifiers environment (rollout.agent.verifiers.env=digits_env) gave the session up"),
        (
            dataclasses.replace(agent_config(""), external=True, endpoint_dir="/tmp/endpoint"),
            "the external agent (rollout.agent.external=true) gave the session up",
        ),
    ],
)
def test_giving_up_names_the_agents_the_run_set(config, named):
    outcome = ended(config, {"abandon": True, "reason": "the episode's trace did not match"})
    assert isinstance(outcome, RuntimeError)
    assert str(outcome) == f"{named}: the episode's trace did not match"
    assert "rollout.agent.function" not in str(outcome)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"reward": float("inf")}, "reward"),
        ({"reward": float("nan")}, "reward"),
        ({"reward": True}, "reward"),
        ({"reward": 10**400}, "reward"),
        ({"reward": 1.0, "metrics": {"turns": float("inf")}}, "metrics"),
    ],
)
def test_a_reward_or_metric_that_is_not_finite_is_refused(body, param):
    with pytest.raises(ApiError) as error:
        ended(verifiers_config(), body)
    assert error.value.status == 400 and error.value.param == param
