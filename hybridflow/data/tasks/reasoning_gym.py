"""Tasks from reasoning-gym (procedural reasoning tasks with their own verifiers) as train/test parquet.

    python -m hybridflow.data.tasks reasoning_gym --out data/rg --train 2000 --test 200 --seed 0 \\
        --rg chain_sum min_terms=2 max_terms=2 max_digits=1 --rg leg_counting weight=2 min_animals=1 max_animals=2

Each ``--rg NAME [weight=W] [key=value ...]`` names one reasoning-gym dataset with its settings (the fields of its
config class, e.g. the difficulty); each row draws its task by weight. A row's prompt is the entry's question with
the answer format the scorer reads (the bare answer; ``<answer>...</answer>`` tags are read too); its data source
is ``reasoning_gym:<name>``, so validation reports ``val/reasoning_gym:<name>/score_mean`` per task. The ground
truth names the entry (task, settings, dataset seed, index) rather than copying it: the scorer regenerates the
exact entry and calls the dataset's own ``score_answer`` (hybridflow.reward.scorers.reasoning_gym). The test
split's questions are distinct and never appear in the train split.

reasoning-gym is an optional dependency (``pip install reasoning-gym``, in the project's test extra); it is imported
only here and by its scorer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from hybridflow.data.tasks.base import make_row, split_rng

SOURCE_PREFIX = "reasoning_gym"  # data_source = "reasoning_gym:<task>"
DATASET_SIZE = 10**9  # reasoning-gym datasets generate entry i from (seed, i): the size only bounds the index
# SmolLM2-135M never wrote <answer> tags when asked (none of 544 replies, four wordings): the prompt asks for the bare
# answer, and the scorer takes the whole reply when it has no tags (docs/environments.md)
ANSWER_FORMAT = "\n\nGive only the final answer, nothing else."
MAX_DRAWS_PER_ROW = 50  # distinct test questions: give up (with an error) after this many draws per row needed
INSTALL_FIX = "install it: pip install reasoning-gym==0.1.25 (the project's test extra has it)"


@dataclass(frozen=True)
class TaskSpec:
    """One reasoning-gym dataset of a mix: its registered name, its share of the rows and its config's settings."""

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError(
            f"reasoning-gym tasks need the reasoning-gym package, which is not installed: {INSTALL_FIX}"
        ) from error
    return reasoning_gym


def parse_value(text: str) -> Any:
    """A setting's value as YAML would read it: 2 -> int, 0.5 -> float, true -> bool, anything else -> the text."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_spec(words: list[str]) -> TaskSpec:
    """``["chain_sum", "weight=2", "max_terms=2"]`` -> TaskSpec (the ``--rg`` argument's words)."""
    if not words or "=" in words[0]:
        raise ValueError(f"--rg {' '.join(words)}: start with the task's name, then weight=W and key=value settings")
    config: dict[str, Any] = {}
    weight = 1.0
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ValueError(f"--rg {words[0]}: {word!r} is not key=value")
        if key == "weight":
            weight = float(value)
            if not weight > 0:
                raise ValueError(f"--rg {words[0]}: weight must be positive, got {value}")
        else:
            config[key] = parse_value(value)
    return TaskSpec(words[0], weight, config)


def check_spec(spec: TaskSpec) -> None:
    """Refuse an unknown task or setting with the known names, before any row is written."""
    reasoning_gym = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if spec.name not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {spec.name!r}; its tasks: {', '.join(sorted(DATASETS))}")
    try:
        reasoning_gym.create_dataset(spec.name, size=1, seed=0, **spec.config)
    except TypeError as error:  # an unknown field of the config dataclass
        fields = sorted(getattr(DATASETS[spec.name][1], "__dataclass_fields__", {}))
        fields = [name for name in fields if name not in ("seed", "size")]
        raise ValueError(f"--rg {spec.name}: {error}; its settings: {', '.join(fields)}") from None
    except (AssertionError, ValueError) as error:  # the config's own validate()
        raise ValueError(f"--rg {spec.name}: invalid settings {spec.config}: {error}") from None


def dataset_seed(task: str, split: str, seed: int) -> int:
    """The reasoning-gym seed of one (task, split, seed): stable across processes, independent per split."""
    return int.from_bytes(hashlib.sha256(f"{task}:{split}:{seed}".encode()).digest()[:4], "little")


def make_rows(
    specs: list[TaskSpec], count: int, split: str, seed: int, exclude: set[str] | frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """``count`` rows of ``split`` drawn from the mix by weight, deterministic in ``seed``. Questions in ``exclude``
    are skipped; the test split's questions are also distinct among themselves."""
    reasoning_gym = import_reasoning_gym()
    if not specs:
        raise ValueError("no reasoning-gym task given: add --rg NAME [key=value ...]")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"a task is named twice in the mix ({', '.join(names)}): give each once, with its weight")
    for spec in specs:
        check_spec(spec)
    rng = split_rng(SOURCE_PREFIX, split, seed)
    choices = rng.choices(range(len(specs)), weights=[spec.weight for spec in specs], k=count)
    datasets, next_index, seen = {}, dict.fromkeys(names, 0), set(exclude)
    rows = []
    for index, choice in enumerate(choices):
        spec = specs[choice]
        ds_seed = dataset_seed(spec.name, split, seed)
        if spec.name not in datasets:
            datasets[spec.name] = reasoning_gym.create_dataset(
                spec.name, size=DATASET_SIZE, seed=ds_seed, **spec.config
            )
        for _ in range(MAX_DRAWS_PER_ROW):
            entry_index = next_index[spec.name]
            next_index[spec.name] += 1
            entry = datasets[spec.name][entry_index]
            text = entry["question"].rstrip()
            if text not in seen:
                break
        else:
            raise ValueError(
                f"--rg {spec.name}: its {split} rows keep repeating questions already taken "
                f"({len(seen)} so far): the task has too few distinct questions at these settings; "
                "lower --test (or its weight) or widen its settings"
            )
        if split == "test":
            seen.add(text)
        ground_truth = {
            "task": spec.name,
            "config": spec.config,
            "seed": ds_seed,
            "size": DATASET_SIZE,
            "index": entry_index,
            "answer": str(entry["answer"]),
        }
        extra = {"split": split, "index": index, "task": spec.name, "answer": str(entry["answer"])}
        rows.append(
            make_row(
                f"{SOURCE_PREFIX}:{spec.name}",
                text + ANSWER_FORMAT,
                json.dumps(ground_truth, sort_keys=True),
                extra,
            )
        )
    return rows


def make_splits(specs: list[TaskSpec], train: int, test: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """The test split first (distinct questions), then the train split without any of them."""
    test_rows = make_rows(specs, test, "test", seed)
    held_out = {row["prompt"][0]["content"].removesuffix(ANSWER_FORMAT) for row in test_rows}
    return {"train": make_rows(specs, train, "train", seed, exclude=held_out), "test": test_rows}
