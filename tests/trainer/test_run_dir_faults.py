"""Faults of a run directory, in whole runs on the shared Ray cluster: a damaged newest checkpoint falls back to
the newest good one and the run redoes its step; a run directory of another model refuses to resume, before
placing anything; a rerun without checkpoints keeps the earlier metrics file instead of repeating steps in it."""

import json
import time

import pytest
import ray
from test_faults import base

from hybridflow.cli import main as cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

MEASUREMENTS = ("timing_s/", "perf/")  # wall-clock times, throughput, MFU and memory: not reproducible


def records(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(MEASUREMENTS)}


def train(args: list[str]) -> None:
    assert cli(["train", *args]) == 0


def run_args(files, run_dir, steps: int) -> list[str]:
    return [
        *base(files, run_dir),
        "actor_rollout_ref.actor.optim.lr=1e-2",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.n_workers_per_node=1",
    ]


def test_a_damaged_newest_checkpoint_falls_back_and_the_run_redoes_its_step(arithmetic_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_args(arithmetic_files, run_dir, 3))
    original = records(run_dir)
    (run_dir / "global_step_3" / "actor" / "dcp" / ".metadata").unlink()  # the newest checkpoint is damaged
    with pytest.warns(UserWarning, match="skipping damaged checkpoint.*global_step_3.*metadata is missing"):
        train(run_args(arithmetic_files, run_dir, 3))  # resumes from step 2 and redoes step 3
    resumed = records(run_dir)
    assert sorted(resumed) == [1, 2, 3]
    assert comparable(resumed[3]) == pytest.approx(comparable(original[3]), rel=1e-5, abs=1e-6)
    assert len(comparable(resumed[3])) > 30
    assert not list(run_dir.glob("*.tmp-*"))
    assert cli(["export", str(run_dir), str(tmp_path / "hf")]) == 0  # a run directory: its latest checkpoint
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    capsys.readouterr()  # the export's own output

    # a run directory of another model refuses to resume, its config untouched
    saved = (run_dir / "config.yaml").read_bytes()
    placed = len(ray.util.placement_group_table())
    start = time.perf_counter()
    code = cli(["train", *run_args(arithmetic_files, run_dir, 5), "actor_rollout_ref.model.path=tiny-qwen2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hybridflow: error: ") and "Traceback" not in err
    assert len(ray.util.placement_group_table()) == placed and time.perf_counter() - start < 10  # nothing placed
    assert "trainer.default_local_dir" in err and "actor_rollout_ref.model.path" in err
    assert "trainer.experiment_name" in err and "trainer.resume_mode=disable" in err
    assert (run_dir / "config.yaml").read_bytes() == saved


def test_a_rerun_without_checkpoints_starts_a_new_metrics_file(arithmetic_files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [*run_args(arithmetic_files, run_dir, 1), "trainer.save_freq=-1"]
    train(args)
    first = (run_dir / "metrics.jsonl").read_text()
    train(args)
    assert "kept it as metrics.before-" in capsys.readouterr().out
    kept = list(run_dir.glob("metrics.before-*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == first
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
