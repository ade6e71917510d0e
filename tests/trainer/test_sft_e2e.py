"""``hybridflow sft`` end to end on a local Ray cluster (2 workers, the tiny model): the held-out loss falls; a run
killed with SIGKILL in the middle of an epoch resumes to the losses of a run that never stopped; the checkpoint
exports to a model directory that ``hybridflow train`` starts from. The runs that
are not killed, the resumed one too, share the module's Ray cluster, in this process; the killed run is a command
of its own that joins it."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from hybridflow.cli import main as cli
from hybridflow.data.io import write_rows
from hybridflow.data.tasks import write_task
from hybridflow.trainer.services.checkpoint_check import is_complete

pytestmark = pytest.mark.slow

MEASUREMENTS = ("timing_s/", "perf/")  # wall-clock times and memory: not reproducible
STEPS = 8  # 16 samples in batches of 4: 4 steps an epoch, 2 epochs


def conversations(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}"},
                ]
            }
        )
    return rows


def conversation_files(root) -> tuple:
    """16 training and 8 held-out conversations as JSONL files under ``root``."""
    return write_rows(conversations(16, 0), root / "train.jsonl"), write_rows(conversations(8, 1), root / "val.jsonl")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return conversation_files(tmp_path_factory.mktemp("sft_data"))


def arguments(files, run_dir) -> list[str]:
    train, val = files
    return [
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.train_batch_size=4",
        "engine.micro_batch_size_per_gpu=1",  # two micro-batches a rank: gradient accumulation
        "optim.lr=2e-3",
        "engine.fsdp.param_dtype=fp32",  # layouts compare to a tight tolerance
        "trainer.total_epochs=2",
        "trainer.save_freq=2",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]


def kill_after_checkpoint(command: str, args: list[str], run_dir: Path, steps: int) -> None:
    """``python -m hybridflow.trainer.commands.<command>`` as a command of its own, joining this process's Ray
    cluster (the module's), killed with SIGKILL once its checkpoint of step 2 is complete and before its last step:
    the kill ends the command, and Ray ends its job's worker processes and placement groups."""
    cluster = f"trainer.ray_address={ray.get_runtime_context().gcs_address}"
    victim = subprocess.Popen(
        [sys.executable, "-m", f"hybridflow.trainer.commands.{command}", *args, cluster],
        start_new_session=True,  # its own process group: the kill takes whatever the command started
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    while not is_complete(run_dir / "global_step_2"):
        assert time.time() < deadline and victim.poll() is None, "the run ended before its checkpoint of step 2"
        time.sleep(0.01)
    os.killpg(victim.pid, signal.SIGSTOP)  # frozen at once, somewhere in the steps after the checkpoint
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert steps not in records(run_dir), "the kill came too late: the run had finished"


def assert_same_records(expected: dict[int, dict], got: dict[int, dict]) -> None:
    """Every step's metrics equal, to 1e-6 relative, but for the wall-clock and memory measurements."""
    assert sorted(got) == sorted(expected)
    for step, want in expected.items():
        want = {k: v for k, v in want.items() if not k.startswith(MEASUREMENTS)}
        have = {k: v for k, v in got[step].items() if not k.startswith(MEASUREMENTS)}
        assert want.keys() == have.keys()
        for key, value in want.items():
            assert abs(have[key] - value) <= 1e-6 * max(1.0, abs(value)), (step, key, have[key], value)


def records(run_dir) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(local_ray, files, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft_reference") / "run"
    assert cli(["sft", *arguments(files, run_dir)]) == 0
    return run_dir


def test_the_held_out_loss_falls(reference):
    got = records(reference)
    assert sorted(got) == list(range(STEPS + 1))  # step 0: the validation before training
    assert got[STEPS]["val/loss"] < 0.8 * got[0]["val/loss"]
    assert got[STEPS]["sft/loss"] < got[1]["sft/loss"]
    assert got[1]["train/samples"] == 4 and got[1]["train/trained_tokens"] > 0


def test_kill_minus_9_mid_epoch_then_resume_matches_an_uninterrupted_run(files, reference, tmp_path):
    run_dir = tmp_path / "interrupted"
    kill_after_checkpoint("sft", arguments(files, run_dir), run_dir, STEPS)
    assert cli(["sft", *arguments(files, run_dir)]) == 0  # resumed (resume_mode=auto), in this process
    assert_same_records(records(reference), records(run_dir))


def test_lora_adapters_under_tensor_parallelism_start_from_the_same_loss_and_checkpoint_only_themselves(
    files, reference, tmp_path
):
    """Tensor-parallel groups of 2 with LoRA adapters (zero at the start, so the model is the base): the same
    held-out loss before training and the same first loss as the full run on two data-parallel ranks; the
    checkpoint holds the adapters, and exports as peft's adapter directory."""
    run_dir = tmp_path / "lora_tp"
    args = [
        *arguments(files, run_dir),
        "engine.tensor_model_parallel_size=2",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "trainer.total_training_steps=2",
    ]
    assert cli(["sft", *args]) == 0
    expected, got = records(reference), records(run_dir)
    assert got[0]["val/loss"] == pytest.approx(expected[0]["val/loss"], rel=1e-5)
    assert got[1]["sft/loss"] == pytest.approx(expected[1]["sft/loss"], rel=1e-5)
    assert got[2]["sft/loss"] != expected[2]["sft/loss"]  # the adapters trained, not the whole model
    assert got[2]["val/loss"] < got[0]["val/loss"]

    def state_bytes(run: Path) -> int:
        return sum(f.stat().st_size for f in (run / "global_step_2" / "actor" / "dcp").rglob("*") if f.is_file())

    assert state_bytes(run_dir) < state_bytes(reference) / 4  # tiny layers: rank-4 adapters are an eighth of each
    assert cli(["export", str(run_dir), str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_the_checkpoint_exports_to_a_model_that_grpo_starts_from(reference, tmp_path):
    model_dir = tmp_path / "sft_model"
    assert cli(["export", str(reference), str(model_dir)]) == 0
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    data = tmp_path / "data"
    write_task("arithmetic", data, train=8, test=4, seed=0)
    code = cli(
        [
            "train",
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files=[{data / 'train.parquet'}]",
            "data.val_files=[]",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=8",
            "trainer.total_training_steps=1",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path / 'grpo'}",
        ]
    )
    assert code == 0
    (step,) = records(tmp_path / "grpo").values()
    assert step["step"] == 1 and "actor/pg_loss" in step
