"""Checkpoint directories: atomic completion, the latest pointer, pruning, what auto-resume picks,
damaged checkpoints found by their manifest, and saves that cannot be written."""

import json
import os
import shutil

import pytest

from hybridflow.trainer.checkpoint import (
    COMPLETE,
    LATEST,
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    problems,
    read_trainer_state,
)


def write_role(directory):
    (directory / "actor").mkdir()
    (directory / "actor" / "weights.bin").write_bytes(b"x" * 10)
    (directory / "actor" / "rng_rank0.pt").write_bytes(b"r" * 40)


def state(step: int) -> dict:
    return {"global_step": step, "data_loader": {"epoch": 0, "position": step}, "kl_coef": 0.001}


def test_save_is_complete_and_points_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, write_role, state(3))
    assert path == tmp_path / "global_step_3" and (path / COMPLETE).is_file()
    assert (tmp_path / LATEST).read_text() == "3"
    assert read_trainer_state(path) == state(3)
    assert set(json.loads((path / MANIFEST).read_text())) == {
        "actor/weights.bin",
        "actor/rng_rank0.pt",
        "trainer_state.json",
    }
    assert not list(tmp_path.glob("*.tmp-*"))
    assert manager.resume_from("auto") == path and manager.resume_from("disable") is None


def test_half_written_checkpoints_are_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(2, write_role, state(2))
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
        manager.save(step, write_role, state(step))
    assert [s for s, _ in manager.complete_checkpoints()] == [2, 3]


def test_resume_from_an_explicit_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(5, write_role, state(5))
    assert manager.resume_from(str(path)) == path
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resume_from(str(tmp_path / "global_step_9"))


DAMAGE = {
    "a shard deleted": lambda path: (path / "actor" / "weights.bin").unlink(),
    "a shard truncated": lambda path: os.truncate(path / "actor" / "weights.bin", 3),
    "a shard overwritten": lambda path: (path / "actor" / "weights.bin").write_bytes(b"y" * 10),
    "the RNG file truncated": lambda path: os.truncate(path / "actor" / "rng_rank0.pt", 0),
    "the trainer state not JSON": lambda path: (path / "trainer_state.json").write_text("{not json"),
    "the trainer state without its keys": lambda path: (path / "trainer_state.json").write_text("{}"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_auto_resume_skips_a_damaged_newest_checkpoint(tmp_path, damage):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, write_role, state(1))
    bad = manager.save(2, write_role, state(2))
    assert problems(bad) == []
    DAMAGE[damage](bad)
    assert problems(bad)
    with pytest.warns(UserWarning, match="global_step_2"):
        assert manager.latest() == good
    with pytest.raises(CheckpointError, match="damaged"):
        manager.resume_from(str(bad))


def test_a_pointer_that_is_not_a_number_is_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    newest = manager.save(4, write_role, state(4))
    (tmp_path / LATEST).write_text("four\n")
    with pytest.warns(UserWarning, match="not a step number"):
        assert manager.latest() == newest


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    manager = CheckpointManager(tmp_path)
    only = manager.save(1, write_role, state(1))
    (only / "actor" / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged.*resume_mode=disable"):
        manager.latest()


def test_unfinished_saves_are_removed(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_role, state(1))
    for name in ("global_step_2.tmp-deadbeef", "global_step_3.tmp-0123abcd"):
        (tmp_path / name / "actor").mkdir(parents=True)
    assert sorted(p.name for p in manager.remove_unfinished()) == [
        "global_step_2.tmp-deadbeef",
        "global_step_3.tmp-0123abcd",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", LATEST]


def test_a_save_without_room_fails_before_writing(tmp_path):
    manager = CheckpointManager(tmp_path)
    first = manager.save(1, write_role, state(1))
    # the last checkpoint, as large as the free space (a sparse file: no real disk is used)
    os.truncate(first / "actor" / "weights.bin", shutil.disk_usage(tmp_path).free)
    with pytest.raises(CheckpointError, match="GiB free.*max_ckpt_to_keep"):
        manager.save(2, write_role, state(2))
    assert not list(tmp_path.glob("*.tmp-*")) and not (tmp_path / "global_step_2").exists()


def test_a_failed_save_leaves_no_tmp_and_names_the_problem(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_role, state(1))

    def fails(directory):
        write_role(directory)
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are intact"):
        manager.save(2, fails, state(2))
    assert not list(tmp_path.glob("*.tmp-*"))
    assert manager.latest() == tmp_path / "global_step_1"
