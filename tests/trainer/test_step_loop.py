"""The one step loop (trainer/loop/step_loop.py) with trainers written here, each one small class in this file and
nothing else: the schedule of validation and checkpoints, the run's records (metrics.jsonl, timeline.jsonl,
verified checkpoints), resume to the same numbers, the end of the data, the trainer's end after a failure."""

import json
from pathlib import Path

import pytest

from hybridflow.run_files import TIMELINE_FILE, read_spans
from hybridflow.trainer.loop.step_loop import CheckpointParts, Schedule, StepLoop
from hybridflow.trainer.services.checkpoint_check import MANIFEST, is_complete
from hybridflow.trainer.services.tracking import Tracking

DATA = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
ROLE_FILE = "value.json"  # where this trainer's "model" lives in a checkpoint


class RunningMean:
    """A trainer whose model is one number, moved halfway towards each datum; validation is its distance to 4."""

    shown = (("train/value", "value"), ("val/error", "val error"))

    def __init__(self, data: list[float]):
        self.data, self.position, self.value = data, 0, 0.0
        self.ended: list[bool] = []

    def begin(self, step, timeline):
        pass

    def step(self, step, timeline):
        if self.position == len(self.data):
            return None
        with timeline.stage("update", on_driver=True):
            self.value += (self.data[self.position] - self.value) / 2
            self.position += 1
        return {"train/value": self.value, "train/step_seen": float(step)}

    def validate(self, step, timeline):
        return {"val/error": abs(self.value - 4.0)}

    def checkpoint(self, step):
        value = self.value

        def write(directory: Path) -> None:
            (directory / ROLE_FILE).write_text(json.dumps(value))

        return CheckpointParts(state={"position": self.position}, write=write)

    def restore(self, checkpoint, state):
        self.value = json.loads((checkpoint / ROLE_FILE).read_text())
        self.position = state["position"]

    def collect_spans(self, timeline):
        pass

    def end(self, failed):
        self.ended.append(failed)


def fit(trainer, run_dir: Path, *, total_steps=5, test_freq=2, save_freq=3, resume_from=None) -> dict:
    schedule = Schedule(
        total_steps=total_steps, test_freq=test_freq, save_freq=save_freq, val_before_train=True, has_validation=True
    )
    with Tracking(["jsonl"], run_dir) as tracking:
        return StepLoop(trainer, schedule=schedule, run_dir=run_dir, tracking=tracking).fit(resume_from=resume_from)


def records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def expected_values(count: int) -> list[float]:
    value, values = 0.0, []
    for datum in DATA[:count]:
        value += (datum - value) / 2
        values.append(value)
    return values


def test_schedule_and_records(tmp_path):
    trainer = RunningMean(DATA)
    last = fit(trainer, tmp_path)
    got = records(tmp_path)
    assert sorted(got) == [0, 1, 2, 3, 4, 5]
    assert [got[s]["train/value"] for s in range(1, 6)] == expected_values(5)
    assert [s for s in got if "val/error" in got[s]] == [0, 2, 4, 5]  # before training, every 2, the last
    assert got[4]["val/error"] == abs(expected_values(4)[-1] - 4.0)
    assert [s for s in got if "timing_s/save_checkpoint" in got[s]] == [3, 5]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_3", "global_step_5"]
    assert is_complete(tmp_path / "global_step_3") and (tmp_path / "global_step_3" / MANIFEST).is_file()
    state = json.loads((tmp_path / "global_step_3" / "trainer_state.json").read_text())
    assert state == {"global_step": 3, "position": 3}
    stages = {(span.step, span.stage) for span in read_spans(tmp_path / TIMELINE_FILE)}
    assert {(0, "validate"), (1, "update"), (2, "validate"), (3, "save_checkpoint"), (5, "validate")} <= stages
    assert last["train/step_seen"] == 5.0 and trainer.ended == [False]


def test_resume_continues_to_the_numbers_of_a_run_that_never_stopped(tmp_path):
    fit(RunningMean(DATA), tmp_path / "whole")
    fit(RunningMean(DATA), tmp_path / "resumed", total_steps=3)
    fit(resumed_again := RunningMean(DATA), tmp_path / "resumed", resume_from=tmp_path / "resumed" / "global_step_3")
    whole, again = records(tmp_path / "whole"), records(tmp_path / "resumed")
    for step in (4, 5):
        assert again[step]["train/value"] == whole[step]["train/value"]
        assert again[step]["val/error"] == whole[step]["val/error"]
    assert resumed_again.position == 5


def test_the_run_ends_where_the_data_does(tmp_path):
    trainer = RunningMean(DATA[:2])
    last = fit(trainer, tmp_path, total_steps=5, save_freq=0)
    assert sorted(records(tmp_path)) == [0, 1, 2]
    assert last["train/step_seen"] == 2.0 and trainer.ended == [False]


def test_nothing_to_train_past_the_last_step(tmp_path, capsys):
    fit(RunningMean(DATA), tmp_path, total_steps=3, save_freq=3)
    trainer = RunningMean(DATA)
    assert fit(trainer, tmp_path, total_steps=3, resume_from=tmp_path / "global_step_3") == {}
    assert "nothing to train: the run is at step 3 of 3" in capsys.readouterr().out
    assert trainer.ended == []  # nothing was started


class FailsAtStep3(RunningMean):
    def step(self, step, timeline):
        if step == 3:
            raise RuntimeError("a worker died")
        return super().step(step, timeline)


def test_a_failing_step_ends_the_trainer_as_failed_and_keeps_what_was_recorded(tmp_path):
    trainer = FailsAtStep3(DATA)
    with pytest.raises(RuntimeError, match="a worker died"):
        fit(trainer, tmp_path)
    assert trainer.ended == [True]
    assert sorted(records(tmp_path)) == [0, 1, 2]


class ValidationOnly:
    """A trainer whose step only validates: the smallest trainer there is (an evaluation sweep over time, say)."""

    shown = (("val/clock", "clock"),)

    def begin(self, step, timeline): ...

    def step(self, step, timeline):
        return self.validate(step, timeline)

    def validate(self, step, timeline):
        return {"val/clock": float(step)}

    def checkpoint(self, step):
        return CheckpointParts(state={}, write=lambda directory: None)

    def restore(self, checkpoint, state): ...

    def collect_spans(self, timeline): ...

    def end(self, failed): ...


def test_a_trainer_whose_step_only_validates(tmp_path):
    fit(ValidationOnly(), tmp_path, total_steps=3, save_freq=0)
    got = records(tmp_path)
    assert [got[s]["val/clock"] for s in (0, 1, 2, 3)] == [0.0, 1.0, 2.0, 3.0]


class KilledAtCommit(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def test_a_run_killed_as_its_checkpoint_completes_resumes_with_every_record(tmp_path, monkeypatch):
    """The checkpoint of step 3 becomes complete (renamed into place) and the run dies at once: the step's metrics
    must already be written, or the resumed run (which starts after step 3) would never write them."""
    import hybridflow.trainer.services.checkpoint as checkpoint_module

    fit(RunningMean(DATA), tmp_path / "whole")
    replace = checkpoint_module.os.replace

    def replace_then_die(source, target):
        replace(source, target)
        if Path(target).name == "global_step_3":
            raise KilledAtCommit

    with monkeypatch.context() as dying:
        dying.setattr(checkpoint_module.os, "replace", replace_then_die)
        with pytest.raises(KilledAtCommit):
            fit(RunningMean(DATA), tmp_path / "killed")
    fit(RunningMean(DATA), tmp_path / "killed", resume_from=tmp_path / "killed" / "global_step_3")
    whole, killed = records(tmp_path / "whole"), records(tmp_path / "killed")
    assert sorted(killed) == sorted(whole) == [0, 1, 2, 3, 4, 5]
    assert [killed[s]["train/value"] for s in range(1, 6)] == [whole[s]["train/value"] for s in range(1, 6)]
    assert "timing_s/save_checkpoint" in killed[3]
