"""``hybridflow dpo`` end to end on a local Ray cluster (2 workers, the tiny model): the held-out pairs come to
prefer their chosen answers; a run killed with SIGKILL between checkpoints resumes to the metrics of a run that
never stopped; LoRA under tensor parallelism starts at log 2 (the model is its reference); the checkpoint exports to
a model directory. The runs that are not killed share the module's Ray cluster, in this process; the killed run is a
command of its own that joins it."""

import math
import random

import pytest

from hybridflow.cli import main as cli
from hybridflow.data.io import write_rows
from tests.trainer.test_sft_e2e import assert_same_records, kill_after_checkpoint, records

pytestmark = pytest.mark.slow

STEPS = 6  # 12 pairs in batches of 4: 3 steps an epoch, 2 epochs


def pairs(count: int, seed: int) -> list[dict]:
    """Sums with the right answer chosen and a wrong one rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong = a + b + rng.choice([-2, -1, 1, 2])
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "chosen": f"{a} + {b} = {a + b}",
                "rejected": f"{a} + {b} = {wrong}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_data")
    return write_rows(pairs(12, 0), root / "train.jsonl"), write_rows(pairs(8, 1), root / "val.jsonl")


def arguments(files, run_dir) -> list[str]:
    train, val = files
    return [
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.train_batch_size=4",
        "engine.micro_batch_size_per_gpu=2",  # one pair a micro-batch, two a rank: gradient accumulation
        "algorithm.beta=0.5",
        "optim.lr=2e-3",
        "engine.fsdp.param_dtype=fp32",  # runs compare to a tight tolerance
        "trainer.total_epochs=2",
        "trainer.save_freq=2",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def reference(local_ray, files, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dpo_reference") / "run"
    assert cli(["dpo", *arguments(files, run_dir)]) == 0
    return run_dir


def test_the_held_out_pairs_come_to_prefer_the_chosen_answers(reference):
    got = records(reference)
    assert sorted(got) == list(range(STEPS + 1))  # step 0: the validation before training
    # before training the model is its reference: every implicit reward is 0, the loss log 2, no pair preferred
    assert got[0]["val/dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert got[0]["val/dpo/reward_accuracy"] == 0.0
    assert got[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the first step starts at the reference
    # 6 steps of 4 pairs (seed 0): 0.59, 0.75 and 0.31 measured
    assert got[STEPS]["val/dpo/loss"] < math.log(2) - 0.05
    assert got[STEPS]["val/dpo/reward_accuracy"] > 0.5
    assert got[STEPS]["val/dpo/reward_margin"] > 0.1
    assert got[1]["train/pairs"] == 4 and got[1]["train/trained_tokens"] > 0


def test_kill_minus_9_between_checkpoints_then_resume_matches_an_uninterrupted_run(files, reference, tmp_path):
    run_dir = tmp_path / "interrupted"
    kill_after_checkpoint("dpo", arguments(files, run_dir), run_dir, STEPS)
    assert cli(["dpo", *arguments(files, run_dir)]) == 0  # resumed (resume_mode=auto), in this process
    assert_same_records(records(reference), records(run_dir))


def test_lora_under_tensor_parallelism_starts_at_its_reference_and_learns(files, reference, tmp_path):
    """Adapters are 0 at the start, so the model is its own reference (adapters off): the first loss is log 2 as in
    the full run; after 2 steps the held-out loss is below it."""
    run_dir = tmp_path / "lora_tp"
    args = [
        *arguments(files, run_dir),
        "engine.tensor_model_parallel_size=2",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "optim.lr=1e-2",
        "trainer.total_training_steps=2",
    ]
    assert cli(["dpo", *args]) == 0
    got = records(run_dir)
    assert got[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert got[2]["val/dpo/loss"] < math.log(2)


def test_the_checkpoint_exports_to_a_model_directory(reference, tmp_path):
    model_dir = tmp_path / "dpo_model"
    assert cli(["export", str(reference), str(model_dir)]) == 0
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_the_other_losses_start_at_their_reference_values_and_learn(files, reference, tmp_path, loss_type):
    """At the start the model is its reference, h = 0: IPO's loss is (1/(2β))² = 1 at β = 0.5 and the hinge's 1;
    after 4 steps the held-out loss is below it and more pairs prefer the chosen answer than at the start (none)."""
    run_dir = tmp_path / loss_type
    args = [*arguments(files, run_dir), f"algorithm.loss_type={loss_type}", "trainer.total_training_steps=4"]
    assert cli(["dpo", *args]) == 0
    got = records(run_dir)
    assert got[0]["val/dpo/loss"] == pytest.approx(1.0, abs=1e-6)
    assert got[1]["dpo/loss"] == pytest.approx(1.0, abs=1e-6)
    assert got[4]["val/dpo/loss"] < 1.0
    assert got[4]["val/dpo/reward_accuracy"] > 0.0
