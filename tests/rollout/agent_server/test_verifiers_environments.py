"""verifiers environments as the rollout, run by the real runner in its own venv (.venv-verifiers, `make
verifiers-env`) against the endpoint's token route over a scripted engine: the shipped single-turn reasoning-gym
taskset and the two-turn environment (examples/environments) score what the engine produced, their samples are
token for token what verifiers' client rendered and the engine generated, and bad set-ups are refused by name."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import reasoning_gym
from endpoint_helpers import EOS, ScriptedBackend, agent_config, params
from test_endpoint_protocol import response_of

from hybridflow.batch_keys import (
    AGENT_BRANCHES,
    AGENT_FAILURE,
    AGENT_METRICS,
    AGENT_REQUESTS,
    AGENT_REWARD,
    ATTENTION_MASK,
    DATA_SOURCE,
    EXTRA_INFO,
    INDEX,
    PROMPTS,
    RAW_PROMPT,
    REWARD_MODEL,
)
from hybridflow.data.tasks.verifiers_env import check_environment_rows, environment_rows, make_environment_splits
from hybridflow.models import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rollout.agent_server.config import VerifiersConfig
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.verifiers_runner.launch import verifiers_python

ENVIRONMENTS = str(Path(__file__).parents[3] / "examples" / "environments")
SETTINGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
ARGS = {"taskset": {"dataset": "chain_sum", "settings": SETTINGS}}
RECHECK = "Check your answer. Reply with the final answer only."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def python():
    return verifiers_python()  # .venv-verifiers: `make test-slow` builds it; its absence fails here with the fix


@pytest.fixture(scope="module")
def single_rows(python):
    """Three train rows of the single-turn taskset, written as the data writer writes them."""
    return make_environment_splits("reasoning_gym_single", ARGS, ENVIRONMENTS, python, 3, 1, 0)["train"]


def answers(indices: list[int]) -> list[str]:
    """The reasoning-gym answers of the environment's tasks, computed here from reasoning-gym itself."""
    dataset = reasoning_gym.create_dataset("chain_sum", seed=0, size=1000, **SETTINGS)
    return [str(dataset[i]["answer"]) for i in indices]


def environment_rollout(tokenizer, python, env: str, scripts: dict[int, list[str]], **settings):
    verifiers = VerifiersConfig(
        env=env, args=settings.pop("args", ARGS), path=ENVIRONMENTS, python=python, renderer={"name": "default"}
    )
    config = agent_config("", verifiers=verifiers, **settings)
    backend = ScriptedBackend(tokenizer, scripts, config.max_branches_per_session)
    return AgentFunctionRollout(backend, tokenizer, config, tool_role="tool", format="hermes")


def as_batch(rows: list[dict]) -> DataProto:
    def column(values) -> np.ndarray:
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array

    return DataProto.from_dict(
        non_tensors={
            RAW_PROMPT: column([row["prompt"] for row in rows]),
            DATA_SOURCE: column([row[DATA_SOURCE] for row in rows]),
            REWARD_MODEL: column([row[REWARD_MODEL] for row in rows]),
            EXTRA_INFO: column([row[EXTRA_INFO] for row in rows]),
            INDEX: column(range(len(rows))),
        }
    )


def rendered(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation's ids as the model's chat template renders them, ready for the next assistant turn."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def prompt_of(batch, row: int) -> list[int]:
    width = batch.batch[PROMPTS].shape[1]
    return batch.batch[PROMPTS][row][batch.batch[ATTENTION_MASK][row, :width].bool()].tolist()


@pytest.mark.slow
def test_a_single_turn_taskset_scores_what_the_engine_generated(tokenizer, python, single_rows):
    rows = single_rows
    right = answers([row[EXTRA_INFO]["task_index"] for row in rows])
    scripts = {0: [f"{right[0]}{EOS}"], 1: [f"{int(right[1]) + 1}{EOS}"], 2: [f"<answer>{right[2]}</answer>{EOS}"]}
    rollout = environment_rollout(tokenizer, python, "reasoning_gym_single", scripts)
    batch = rollout.generate_sequences(as_batch(rows), params(32))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", "", ""]  # the runner's trace check passed too
    assert batch.non_tensor_batch[AGENT_REWARD].tolist() == [1.0, 0.0, 1.0]
    metrics = batch.non_tensor_batch[AGENT_METRICS]
    assert [m["reward/answer_score"] for m in metrics] == [1.0, 0.0, 1.0] and {m["turns"] for m in metrics} == {1.0}
    assert batch.batch[AGENT_REQUESTS].tolist() == [1, 1, 1]
    for i, row in enumerate(rows):  # verifiers' client rendered the task with the model's chat template
        assert prompt_of(batch, i) == rendered(tokenizer, row["prompt"])
        tokens, mask, _ = response_of(batch, i)
        assert tokens == tokenizer.encode(scripts[i][0], add_special_tokens=False) and mask == [1] * len(tokens)


@pytest.mark.slow
def test_a_two_turn_environment_trains_both_replies_and_masks_its_message(tokenizer, python):
    rows = make_environment_splits("reasoning_gym_recheck", ARGS, ENVIRONMENTS, python, 2, 1, 0)["train"]
    right = answers([row[EXTRA_INFO]["task_index"] for row in rows])
    scripts = {0: [f"maybe 3{EOS}", f"{right[0]}{EOS}"], 1: [f"{right[1]}{EOS}", f"{int(right[1]) - 1}{EOS}"]}
    rollout = environment_rollout(tokenizer, python, "reasoning_gym_recheck", scripts)
    batch = rollout.generate_sequences(as_batch(rows), params(64))
    assert batch.non_tensor_batch[AGENT_FAILURE].tolist() == ["", ""]
    assert batch.non_tensor_batch[AGENT_REWARD].tolist() == [1.0, 0.0]  # the second reply is scored
    assert batch.batch[AGENT_REQUESTS].tolist() == [2, 2] and batch.batch[AGENT_BRANCHES].tolist() == [1, 1]
    for i in range(2):
        first, second = (tokenizer.encode(text, add_special_tokens=False) for text in scripts[i])
        tokens, mask, _ = response_of(batch, i)
        tail = tokens[len(first) : len(tokens) - len(second)]
        assert tokens[: len(first)] == first and tokens[len(tokens) - len(second) :] == second
        assert mask == [1] * len(first) + [0] * len(tail) + [1] * len(second)
        assert RECHECK in tokenizer.decode(tail)
        # the whole sequence is the two-turn conversation as the chat template renders it
        conversation = [
            *rows[i]["prompt"],
            {"role": "assistant", "content": scripts[i][0].removesuffix(EOS)},
            {"role": "user", "content": RECHECK},
        ]
        assert prompt_of(batch, i) + tokens[: len(tokens) - len(second)] == rendered(tokenizer, conversation)


@pytest.mark.slow
def test_an_environment_that_does_not_load_fails_its_samples_at_once(tokenizer, python):
    row = {
        "prompt": [{"role": "user", "content": "x"}],
        DATA_SOURCE: "verifiers:nowhere",
        REWARD_MODEL: {"ground_truth": ""},
        EXTRA_INFO: {"task_index": 0},
    }
    rollout = environment_rollout(tokenizer, python, "no_such_environment_module", {0: []}, timeout_s=300.0)
    batch = rollout.generate_sequences(as_batch([row]), params(16))
    failure = batch.non_tensor_batch[AGENT_FAILURE][0]
    assert "the verifiers runner exited" in failure and "no_such_environment_module" in failure


@pytest.mark.slow
def test_the_data_writer_names_distinct_tasks_and_refuses_what_it_cannot_write(python, tmp_path):
    out = tmp_path / "data"
    command = [sys.executable, "-m", "hybridflow.data.tasks", "verifiers", "--out", str(out), "--python", python]
    env = ["--env", "reasoning_gym_single", "--env-args", json.dumps(ARGS), "--env-path", ENVIRONMENTS]
    done = subprocess.run([*command, *env, "--train", "6", "--test", "3"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    train, test = (pd.read_parquet(out / f"{split}.parquet") for split in ("train", "test"))
    train_tasks = [extra["task_index"] for extra in train[EXTRA_INFO]]
    test_tasks = [extra["task_index"] for extra in test[EXTRA_INFO]]
    assert len(set(train_tasks)) == 6 and len(set(test_tasks)) == 3 and not set(train_tasks) & set(test_tasks)
    assert set(train[DATA_SOURCE]) == {"verifiers:reasoning_gym_single"}
    assert list(test["prompt"].iloc[0])[0]["content"].endswith("Give only the final answer, nothing else.")

    refused = tmp_path / "refused"
    for words, message in (
        (["--env", "no_such_environment_module"], "does not load"),
        ([*env, "--env-args", "[1]"], "JSON object"),
    ):
        done = subprocess.run(
            [*command[:5], str(refused), *command[6:], *words, "--train", "6", "--test", "3"],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert not refused.exists()


def test_rows_split_the_tasks_by_a_seeded_permutation():
    description = {"env": "e", "rows": [{"index": i, "prompt": [], "hash": f"h{i}"} for i in range(10)]}
    splits = environment_rows(description, 6, 3, seed=1)
    assert environment_rows(description, 6, 3, seed=1) == splits  # deterministic in the seed
    assert environment_rows(description, 6, 3, seed=2) != splits
    train, test = ([row[EXTRA_INFO]["task_index"] for row in splits[k]] for k in ("train", "test"))
    assert len(set(train)) == 6 and len(set(test)) == 3 and not set(train) & set(test)
    assert all(row[EXTRA_INFO]["task_hash"] == f"h{row[EXTRA_INFO]['task_index']}" for row in splits["train"])
    with pytest.raises(ValueError, match="has 10 tasks; --train 8 --test 3 needs 11"):
        environment_rows(description, 8, 3, seed=1)


@pytest.mark.slow
def test_a_run_refuses_rows_written_from_another_environment(python, single_rows):
    rows = single_rows
    check_environment_rows("reasoning_gym_single", ARGS, ENVIRONMENTS, python, rows)  # as written: accepted
    other = {"taskset": {"dataset": "chain_sum", "settings": {**SETTINGS, "max_digits": 2}}}
    with pytest.raises(ValueError, match="not the task the data was written from"):
        check_environment_rows("reasoning_gym_single", other, ENVIRONMENTS, python, rows)
    with pytest.raises(ValueError, match="names no task"):
        check_environment_rows("reasoning_gym_single", ARGS, ENVIRONMENTS, python, [{EXTRA_INFO: {}}])
