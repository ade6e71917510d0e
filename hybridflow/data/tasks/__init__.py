"""Built-in RL tasks that generate their own data: `arithmetic`, `countdown`, and `calculator` (multi-turn, with a
calculator tool); and `reasoning_gym`, a mix of reasoning-gym's tasks (``--rg NAME key=value ...``: reasoning_gym.py).

    python -m hybridflow.data.tasks arithmetic --out data/arithmetic --train 5000 --test 200 --seed 0

writes DIR/train.parquet and DIR/test.parquet in the RLHFDataset row format; each task's
scorer is registered in hybridflow.reward under the same data_source name. ``--gold`` (calculator) adds each
row's correct conversation as a ``messages`` column: the supervised data of ``hybridflow sft``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.data.io import write_rows
from hybridflow.data.tasks import arithmetic, calculator, countdown
from hybridflow.data.tasks.reasoning_gym import TaskSpec, make_splits
from hybridflow.data.tasks.verifiers_env import make_environment_splits

TASKS: dict[str, Callable[[int, str, int], list[dict[str, Any]]]] = {
    "arithmetic": arithmetic.make_rows,
    "calculator": calculator.make_rows,
    "countdown": countdown.make_rows,
}


# tasks that can write gold trajectories: a row -> its correct conversation (chat messages), for hybridflow sft
GOLD: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {"calculator": calculator.gold_messages}


def make_task_rows(task: str, count: int, split: str, seed: int) -> list[dict[str, Any]]:
    """`count` rows of a built-in task's `split` ("train" or "test"), deterministic in `seed`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    if count <= 0:
        raise ValueError(f"{split} split of {count} rows: give a positive count (--{split} N)")
    return TASKS[task](count, split, seed)


def write_task(
    task: str, out: str | Path, train: int, test: int, seed: int = 0, *, gold: bool = False
) -> dict[str, Path]:
    """Write OUT/train.parquet and OUT/test.parquet; returns their paths by split. ``gold``: each row also holds its
    correct conversation (a ``messages`` column, for ``hybridflow sft``), so one file serves SFT and RL."""
    if gold and task not in GOLD:
        raise ValueError(f"task {task!r} has no gold trajectories; tasks that have: {sorted(GOLD)}")
    out = Path(out)
    paths = {}
    for split, count in (("train", train), ("test", test)):
        rows = make_task_rows(task, count, split, seed)
        if gold:
            rows = [{**row, "messages": GOLD[task](row)} for row in rows]
        paths[split] = write_rows(rows, out / f"{split}.parquet")
    return paths


def write_reasoning_gym(
    specs: list[TaskSpec], out: str | Path, train: int, test: int, seed: int = 0
) -> dict[str, Path]:
    """Write OUT/train.parquet and OUT/test.parquet of a reasoning-gym mix (see reasoning_gym.py)."""
    for split, count in (("train", train), ("test", test)):
        if count <= 0:
            raise ValueError(f"{split} split of {count} rows: give a positive count (--{split} N)")
    out = Path(out)
    return {
        split: write_rows(rows, out / f"{split}.parquet")
        for split, rows in make_splits(specs, train, test, seed).items()
    }


def write_verifiers_env(
    env: str, args: dict[str, Any], path: str, python: str, out: str | Path, train: int, test: int, seed: int = 0
) -> dict[str, Path]:
    """Write OUT/train.parquet and OUT/test.parquet naming a verifiers environment's tasks (see verifiers_env.py)."""
    for split, count in (("train", train), ("test", test)):
        if count <= 0:
            raise ValueError(f"{split} split of {count} rows: give a positive count (--{split} N)")
    splits = make_environment_splits(env, args, path, python, train, test, seed)
    return {split: write_rows(rows, Path(out) / f"{split}.parquet") for split, rows in splits.items()}


__all__ = [
    "GOLD",
    "TASKS",
    "TaskSpec",
    "make_task_rows",
    "write_reasoning_gym",
    "write_task",
    "write_verifiers_env",
]
