"""reasoning-gym as a task source: the data writer (deterministic, mixed by weight, held-out questions kept out of
the train split, bad settings refused) and the built-in scorer (the task's own verifier on the extracted answer)."""

import json
from collections import Counter

import pytest
import reasoning_gym

from hybridflow.data import read_rows
from hybridflow.data.tasks.__main__ import main as tasks_main
from hybridflow.data.tasks.reasoning_gym import ANSWER_FORMAT, TaskSpec, make_rows, make_splits, parse_spec
from hybridflow.reward import get_scorer
from hybridflow.validation import UserError

MIX = [
    TaskSpec("chain_sum", 1.0, {"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    TaskSpec("leg_counting", 3.0, {"min_animals": 1, "max_animals": 2}),
]

# the demo's tasks at its settings, and others at their defaults: each one's answer must score 1 through our scorer
SCORED = [
    TaskSpec("chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    TaskSpec("leg_counting", config={"min_animals": 1, "max_animals": 2}),
    TaskSpec("count_bits", config={"max_n": 255}),
    TaskSpec("spell_backward", config={"min_word_len": 3, "max_word_len": 4}),
    TaskSpec("letter_counting", config={"min_words": 1, "max_words": 1}),
    TaskSpec("number_sorting", config={"min_numbers": 3, "max_numbers": 3}),
    TaskSpec("basic_arithmetic"),
    TaskSpec("products"),
    TaskSpec("gcd"),
    TaskSpec("word_sorting"),
    TaskSpec("fraction_simplification"),
    TaskSpec("simple_equations"),
    TaskSpec("base_conversion"),
    TaskSpec("countdown"),
    TaskSpec("sentence_reordering"),  # its answers are sentences that end with a period
]


def question(row):
    return row["prompt"][0]["content"]


def test_deterministic_by_seed_and_split():
    assert make_rows(MIX, 40, "train", 0) == make_rows(MIX, 40, "train", 0)
    assert make_rows(MIX, 40, "train", 0) != make_rows(MIX, 40, "train", 1)
    assert [question(r) for r in make_rows(MIX, 40, "train", 0)] != [question(r) for r in make_rows(MIX, 40, "test", 0)]


def test_mixes_by_weight_and_names_each_task_as_its_data_source():
    rows = make_rows(MIX, 2000, "train", 0)
    counts = Counter(row["data_source"] for row in rows)
    assert set(counts) == {"reasoning_gym:chain_sum", "reasoning_gym:leg_counting"}
    share = counts["reasoning_gym:leg_counting"] / len(rows)
    assert abs(share - 0.75) < 0.03, share  # weights 1:3; a binomial's sd here is ~0.01
    for row in rows:
        assert question(row).endswith(ANSWER_FORMAT) and row["reward_model"]["style"] == "rule"
        truth = json.loads(row["reward_model"]["ground_truth"])
        assert truth["task"] == row["extra_info"]["task"] == row["data_source"].split(":")[1]


def test_ground_truth_names_the_entry_reasoning_gym_generates():
    """The row's ground truth regenerates the entry: the same question and answer reasoning-gym gives directly."""
    for row in make_rows(MIX, 20, "test", 3):
        truth = json.loads(row["reward_model"]["ground_truth"])
        dataset = reasoning_gym.create_dataset(truth["task"], size=truth["size"], seed=truth["seed"], **truth["config"])
        entry = dataset[truth["index"]]
        assert question(row) == entry["question"].rstrip() + ANSWER_FORMAT
        assert truth["answer"] == row["extra_info"]["answer"] == str(entry["answer"])


def test_test_questions_are_distinct_and_never_in_train():
    splits = make_splits(MIX, 400, 150, 0)
    test_questions = [question(r) for r in splits["test"]]
    assert len(set(test_questions)) == len(test_questions) == 150
    assert not set(test_questions) & {question(r) for r in splits["train"]}
    # chain_sum with two one-digit terms has a few hundred questions: too many asked is refused by name
    with pytest.raises(ValueError, match="chain_sum.*too few distinct questions"):
        make_splits([TaskSpec("chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 1})], 10, 1000, 0)


@pytest.mark.parametrize("spec", SCORED, ids=lambda spec: spec.name)
def test_every_answer_scores_one_and_a_wrong_one_less(spec):
    for row in make_rows([spec], 6, "test", 0):
        scorer = get_scorer(row["data_source"])
        truth, answer = row["reward_model"]["ground_truth"], row["extra_info"]["answer"]
        right = scorer(f"Let me think. <answer>{answer}</answer>", truth)
        assert right["score"] == 1.0 and right["acc"] == 1.0 and right["pred"] == answer
        wrong = scorer("<answer>certainly not this</answer>", truth)
        assert wrong["score"] < 1.0 and wrong["acc"] == 0.0
        # without tags the whole reply is the answer: the bare answer is right, more words are not
        assert scorer(f" {answer}.\n", truth)["acc"] == 1.0
        assert scorer(f"{answer}\n", truth) == {"score": 1.0, "acc": 1.0, "pred": answer}
        assert scorer(f"I think the answer might be {answer} but not sure", truth)["acc"] == 0.0
        assert scorer("  ", truth) == {"score": 0.0, "acc": 0.0, "pred": ""}
        # the last answer pair counts
        assert scorer(f"<answer>{answer}</answer> no, <answer>certainly not this</answer>", truth)["acc"] == 0.0


def test_spec_words_and_refusals():
    assert parse_spec(["chain_sum", "weight=2", "max_terms=3", "allow_negation=true"]) == TaskSpec(
        "chain_sum", 2.0, {"max_terms": 3, "allow_negation": True}
    )
    for words, problem in [
        (["weight=2"], "start with the task's name"),
        (["chain_sum", "max_terms"], "not key=value"),
        (["chain_sum", "weight=0"], "weight must be positive"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_spec(words)
    with pytest.raises(ValueError, match="named twice"):
        make_rows([MIX[0], MIX[0]], 5, "train", 0)


def test_command_writes_the_splits_and_refuses_bad_tasks_before_writing(tmp_path):
    out = tmp_path / "rg"
    args = ["reasoning_gym", "--out", str(out), "--train", "30", "--test", "10", "--seed", "1"]
    assert tasks_main([*args, "--rg", "chain_sum", "max_digits=1", "--rg", "count_bits", "weight=2", "max_n=255"]) == 0
    train, test = read_rows(out / "train.parquet"), read_rows(out / "test.parquet")
    assert len(train) == 30 and len(test) == 10
    assert (
        test
        == make_splits(
            [TaskSpec("chain_sum", config={"max_digits": 1}), TaskSpec("count_bits", 2.0, {"max_n": 255})], 30, 10, 1
        )["test"]
    )
    bad = tmp_path / "bad"
    for extra, problem in [
        (["--rg", "chain_sm"], "reasoning-gym has no task 'chain_sm'; its tasks: ab, acre"),
        (["--rg", "chain_sum", "max_term=3"], "unexpected keyword argument 'max_term'; its settings: allow_negation"),
        (["--rg", "leg_counting", "max_animals=0"], "invalid settings"),
        ([], "name its tasks with --rg"),
    ]:
        with pytest.raises(UserError, match=problem):
            tasks_main(["reasoning_gym", "--out", str(bad), *extra])
    with pytest.raises(UserError, match="--rg is for the reasoning_gym task"):
        tasks_main(["arithmetic", "--out", str(bad), "--rg", "chain_sum"])
    assert not bad.exists()
