"""``hybridflow rm`` end to end on a local Ray cluster (2 workers, the tiny model): the held-out pairs come to be
scored right; a run killed with SIGKILL between checkpoints resumes to the metrics of a run that never stopped;
tensor parallelism takes the data-parallel run's steps; the checkpoint (a full or a LoRA run's) exports to a sequence
classifier that scores the held-out answers as the run did, and an RL run loads it as its reward model
(``reward_model.path``) and trains on its scores alone."""

import math
import random

import pytest
import torch
from test_one_step_off_e2e import overrides

from hybridflow.cli import main as cli
from hybridflow.data.io import write_rows
from hybridflow.models import load_reward_model, load_tokenizer
from hybridflow.trainer.commands import train as train_main
from hybridflow.trainer.setup.config import load_config
from tests.trainer.test_sft_e2e import assert_same_records, kill_after_checkpoint, records

pytestmark = pytest.mark.slow

STEPS = 6  # 12 pairs in batches of 4: 3 steps an epoch, 2 epochs


def pairs(count: int, seed: int) -> list[dict]:
    """A worked answer chosen over a refusal, with a margin of 0.2 (the loss asks for a gap beyond it)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "chosen": f"{a} + {b} = {a + b}",
                "rejected": rng.choice(["I do not know.", "No idea, sorry.", "Ask someone else."]),
                "gap": 0.2,
            }
        )
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_data")
    return write_rows(pairs(12, 0), root / "train.jsonl"), write_rows(pairs(8, 1), root / "val.jsonl")


def arguments(files, run_dir) -> list[str]:
    train, val = files
    return [
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.margin_key=gap",
        "data.train_batch_size=4",
        "engine.micro_batch_size_per_gpu=2",  # one pair a micro-batch, two a rank: gradient accumulation
        "optim.lr=2e-3",
        "engine.fsdp.param_dtype=fp32",  # runs compare to a tight tolerance
        "trainer.total_epochs=2",
        "trainer.save_freq=2",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def reference(local_ray, files, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rm_reference") / "run"
    assert cli(["rm", *arguments(files, run_dir)]) == 0
    return run_dir


def test_the_held_out_pairs_come_to_be_scored_right(reference):
    got = records(reference)
    assert sorted(got) == list(range(STEPS + 1))  # step 0: the validation before training
    # the new head is 0: every score is 0, the loss log(1 + e^0.2) (the margin), no pair scored right (ties)
    assert got[0]["val/rm/loss"] == pytest.approx(math.log1p(math.exp(0.2)), abs=1e-6)
    assert got[0]["val/rm/accuracy"] == 0.0
    assert got[STEPS]["val/rm/accuracy"] == 1.0
    assert got[STEPS]["val/rm/score_margin"] > 0.5
    assert got[STEPS]["val/rm/loss"] < 0.5
    assert got[1]["train/pairs"] == 4


def test_kill_minus_9_between_checkpoints_then_resume_matches_an_uninterrupted_run(files, reference, tmp_path):
    run_dir = tmp_path / "interrupted"
    kill_after_checkpoint("rm", arguments(files, run_dir), run_dir, STEPS)
    assert cli(["rm", *arguments(files, run_dir)]) == 0  # resumed (resume_mode=auto), in this process
    assert_same_records(records(reference), records(run_dir))


def test_tensor_parallelism_takes_the_steps_of_the_data_parallel_run(files, reference, tmp_path):
    """The same model split over 2 ranks by layer instead of by pairs: the first two steps' numbers match."""
    run_dir = tmp_path / "tp"
    args = [*arguments(files, run_dir), "engine.tensor_model_parallel_size=2", "trainer.total_training_steps=2"]
    assert cli(["rm", *args]) == 0
    got, want = records(run_dir), records(reference)
    for step in (1, 2):
        for key in ("rm/loss", "rm/chosen_score", "rm/rejected_score", "rm/grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("rm_export") / "model"
    assert cli(["export", str(reference), str(model_dir)]) == 0
    return model_dir


def mean_scores(model_dir, rows) -> dict[str, float]:
    """The answers' mean scores by an exported model, each scored as the RL reward worker scores
    (workers/reward_model.py): the conversation through the chat template, tokenised whole, one forward."""
    model, tokenizer = load_reward_model(model_dir).eval(), load_tokenizer(model_dir)
    assert type(model).__name__.endswith("ForSequenceClassification")
    scores = {"chosen": [], "rejected": []}
    for row in rows:
        for side in scores:
            messages = [*row["prompt"], {"role": "assistant", "content": row[side]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            with torch.no_grad():
                logits = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits
            scores[side].append(float(logits[0, 0]))
    return {side: sum(values) / len(values) for side, values in scores.items()}


def test_the_export_is_a_sequence_classifier_scoring_as_the_run_did(reference, exported):
    """The held-out answers' mean scores are the run's last validation's."""
    scores, last = mean_scores(exported, pairs(8, 1)), records(reference)[STEPS]
    assert scores["chosen"] == pytest.approx(last["val/rm/chosen_score"], abs=1e-4)
    assert scores["rejected"] == pytest.approx(last["val/rm/rejected_score"], abs=1e-4)


def test_a_lora_reward_model_exports_merged_with_its_trained_head(files, tmp_path):
    """LoRA adapts the backbone and trains the head whole (it starts at 0: a head that did not train would score
    0); ``export --merged`` writes the classifier, which scores the held-out answers as the run's validation did."""
    run_dir, model_dir = tmp_path / "lora", tmp_path / "lora_model"
    args = [*arguments(files, run_dir), "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]
    assert cli(["rm", *args, "trainer.total_training_steps=2"]) == 0
    assert cli(["export", str(run_dir), str(model_dir), "--merged"]) == 0
    scores, last = mean_scores(model_dir, pairs(8, 1)), records(run_dir)[2]
    assert scores["chosen"] != 0.0
    assert scores["chosen"] == pytest.approx(last["val/rm/chosen_score"], abs=1e-4)
    assert scores["rejected"] == pytest.approx(last["val/rm/rejected_score"], abs=1e-4)


def test_an_rl_run_loads_it_as_its_reward_model_and_trains_on_its_scores(
    local_ray, arithmetic_files, exported, tmp_path
):
    """replace_rule_reward: the training rewards are the reward model's (its scores of the tiny policy's answers
    vary; the rule-based reward is logged beside them), and validation scores by the rule alone."""
    settings = [
        "reward_model.enable=true",
        f"reward_model.model.path={exported}",
        "reward_model.replace_rule_reward=true",
        "reward_model.fsdp.param_dtype=fp32",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=1",
    ]
    train_main.run(load_config(overrides(arithmetic_files, tmp_path, *settings)))
    step = records(tmp_path / "run")[1]
    assert step["critic/score/max"] > step["critic/score/min"]  # the reward model tells the answers apart
    assert "reward/rule_score" in step
    # validation by the rule alone: test_one_step_off_e2e.REWARD gives multiples of 1/6, so the mean over the 8
    # held-out prompts is a multiple of 1/48 (a reward model's score added to any would not be)
    total = step["val/arithmetic/score_mean"] * 48
    assert total == pytest.approx(round(total), abs=1e-6)
