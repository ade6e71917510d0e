"""Checkpoint directories: atomic completion, the latest pointer, pruning, and what auto-resume picks."""

import json

import pytest

from hybridflow.trainer.checkpoint import COMPLETE, LATEST, CheckpointManager, read_trainer_state


def write_role(directory):
    (directory / "actor").mkdir()
    (directory / "actor" / "weights.bin").write_bytes(b"x" * 10)


def test_save_is_complete_and_points_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, write_role, {"global_step": 3})
    assert path == tmp_path / "global_step_3" and (path / COMPLETE).is_file()
    assert (tmp_path / LATEST).read_text() == "3"
    assert read_trainer_state(path) == {"global_step": 3}
    assert not list(tmp_path.glob("*.tmp-*"))
    assert manager.resume_from("auto") == path and manager.resume_from("disable") is None


def test_half_written_checkpoints_are_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(2, write_role, {"global_step": 2})
    # a save killed before its rename: a .tmp directory with partial contents
    partial = tmp_path / "global_step_4.tmp-deadbeef"
    (partial / "actor").mkdir(parents=True)
    (partial / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    # a directory with the final name but no completion marker (e.g. copied by hand, cut short)
    (tmp_path / "global_step_6" / "actor").mkdir(parents=True)
    assert manager.latest() == tmp_path / "global_step_2"
    # a pointer naming an incomplete checkpoint falls back to the newest complete one
    (tmp_path / LATEST).write_text("6")
    assert manager.latest() == tmp_path / "global_step_2"


def test_max_to_keep_prunes_the_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        manager.save(step, write_role, {"global_step": step})
    assert [s for s, _ in manager.complete_checkpoints()] == [2, 3]


def test_resume_from_an_explicit_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(5, write_role, {"global_step": 5})
    assert manager.resume_from(str(path)) == path
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resume_from(str(tmp_path / "global_step_9"))
