"""Rows that name a verifiers environment's tasks: the run's data set when its samples are the environment's
episodes (rollout.agent.verifiers).

The environment holds its own tasks (and scores them); a row names one by its position, ``extra_info.task_index``,
with the task's content hash, ``extra_info.task_hash``, which the runner checks so that a changed environment is
refused instead of trained on the wrong task. The prompt column is the task's opening conversation (for the report
and the length filter; the environment renders its own). Train and test rows are distinct tasks: a seeded
permutation of the tasks read, the first ``test`` of them held out.
"""

from __future__ import annotations

from typing import Any

from hybridflow.batch_keys import DATA_SOURCE, EXTRA_INFO, REWARD_MODEL
from hybridflow.data.tasks.base import split_rng
from hybridflow.verifiers_runner.launch import describe_environment

SOURCE_PREFIX = "verifiers"  # data_source = "verifiers:<env>"


def environment_rows(description: dict[str, Any], train: int, test: int, seed: int) -> dict[str, list[dict]]:
    """Train and test rows of the tasks ``description`` lists (describe_environment's output)."""
    env, tasks = description["env"], description["rows"]
    if train + test > len(tasks):
        raise ValueError(
            f"the environment {env!r} has {len(tasks)} tasks; --train {train} --test {test} needs {train + test} "
            "distinct ones (lower them, or give the environment more tasks)"
        )
    order = list(range(len(tasks)))
    split_rng(f"{SOURCE_PREFIX}:{env}", "order", seed).shuffle(order)
    chosen = {"test": order[:test], "train": order[test : test + train]}
    return {
        split: [
            {
                DATA_SOURCE: f"{SOURCE_PREFIX}:{env}",
                "prompt": tasks[i]["prompt"],  # the default data.prompt_key
                REWARD_MODEL: {"ground_truth": "", "style": "environment"},
                EXTRA_INFO: {"split": split, "index": n, "task_index": i, "task_hash": tasks[i]["hash"], "env": env},
            }
            for n, i in enumerate(indices)
        ]
        for split, indices in chosen.items()
    }


def make_environment_splits(
    env: str, args: dict[str, Any], path: str, python: str, train: int, test: int, seed: int
) -> dict[str, list[dict]]:
    """Load the environment in its venv (``python``), read up to train + test tasks, and split them."""
    return environment_rows(describe_environment(python, env, args, path, limit=train + test), train, test, seed)


def check_environment_rows(env: str, args: dict[str, Any], path: str, python: str, rows: list[dict]) -> None:
    """Before a run starts: the environment loads, and each row names one of its tasks (extra_info.task_index)
    with that task's hash (the data was written from this environment, with these args). ValueError naming the
    first row that does not, and what to do."""
    indices = []
    for n, row in enumerate(rows):
        extra = row.get(EXTRA_INFO) or {}
        if not isinstance(extra, dict) or "task_index" not in extra:
            raise ValueError(
                f"row {n} names no task of the environment (extra_info.task_index): write the data with "
                f"`python -m hybridflow.data.tasks verifiers --env {env}`"
            )
        indices.append(int(extra["task_index"]))
    described = describe_environment(python, env, args, path, limit=max(indices, default=0) + 1)["rows"]
    for n, (row, index) in enumerate(zip(rows, indices)):
        if index >= len(described):
            raise ValueError(f"row {n} names task {index}; the environment {env!r} has {len(described)} tasks")
        written = row[EXTRA_INFO].get("task_hash")
        if written and written != described[index]["hash"]:
            raise ValueError(
                f"row {n}: task {index} of {env!r} is not the task the data was written from (its content "
                "differs: the environment or rollout.agent.verifiers.args changed); write the data again"
            )
