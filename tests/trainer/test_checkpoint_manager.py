"""Checkpoint directories: atomic completion, the latest pointer, pruning, what auto-resume picks,
damaged checkpoints found by their manifest (or, without one, by their layout), files that cannot be
read, and saves that cannot be written.

Each checkpoint holds a real role state, written by engine/checkpoint.py for a 4x3 linear layer in this
one process (no process group): about 30 KB, a fraction of a second."""

import errno
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from hybridflow.engine.checkpoint import save_training_state
from hybridflow.engine.optim import TrainedModel
from hybridflow.trainer.services.checkpoint import LATEST, CheckpointError, CheckpointManager, CheckpointNotFound
from hybridflow.trainer.services.checkpoint_check import COMPLETE, MANIFEST, problems, read_trainer_state

SHARD = "actor/dcp/__0_0.distcp"  # rank 0's DCP shards: the only shard file of a one-process save
METADATA = "actor/dcp/.metadata"


def write_role(directory):
    """The actor's training state, as a worker writes it (one rank)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        save_training_state(directory / "actor", TrainedModel(model, optimizer, scheduler), rank=0)


def state(step: int) -> dict:
    return {"global_step": step, "data_loader": {"epoch": 0, "position": step}, "kl_coef": 0.001}


def test_save_is_complete_and_points_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, write_role, state(3))
    assert path == tmp_path / "global_step_3" and (path / COMPLETE).is_file()
    assert (tmp_path / LATEST).read_text() == "3"
    assert read_trainer_state(path) == state(3)
    assert set(json.loads((path / MANIFEST).read_text())) == {
        SHARD,
        METADATA,
        "actor/scheduler.pt",
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
    # a directory with the final name after the pointer's step, and no completion marker (e.g. copied by
    # hand, cut short): left alone, and said so
    (tmp_path / "global_step_6" / "actor").mkdir(parents=True)
    with pytest.warns(
        UserWarning, match=r"ignoring global_step_6: after the step .* names.*resuming from global_step_2"
    ):
        assert manager.latest() == tmp_path / "global_step_2"
    # a pointer naming an incomplete checkpoint falls back to the newest complete one, as loudly
    (tmp_path / LATEST).write_text("6")
    with pytest.warns(UserWarning, match=r"global_step_6 \(no COMPLETE marker.*resuming from global_step_2"):
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
    with pytest.raises(CheckpointNotFound, match="global_step_9: it does not exist"):
        manager.resume_from(str(tmp_path / "global_step_9"))
    with pytest.raises(CheckpointNotFound, match="is a run directory, not a checkpoint"):
        manager.resume_from(str(tmp_path))


def overwrite(path: Path) -> None:
    """The same number of bytes, other contents."""
    path.write_bytes(b"\x07" * path.stat().st_size)


# damage -> what the problem report says (with the manifest)
DAMAGE = {
    "a shard deleted": (lambda path: (path / SHARD).unlink(), f"{SHARD} is missing"),
    "a shard truncated": (lambda path: os.truncate(path / SHARD, 3), f"{SHARD} has 3 bytes, \\d+ were written"),
    "a shard overwritten": (lambda path: overwrite(path / SHARD), f"{SHARD} changed since it was written"),
    "the DCP metadata deleted": (lambda path: (path / METADATA).unlink(), f"{METADATA} is missing"),
    "the RNG file truncated": (lambda path: os.truncate(path / "actor/rng_rank0.pt", 0), "rng_rank0.pt has 0 bytes"),
    "the trainer state not JSON": (
        lambda path: (path / "trainer_state.json").write_text("{not json"),
        "trainer_state.json is not valid JSON",
    ),
    "the trainer state without its keys": (
        lambda path: (path / "trainer_state.json").write_text("{}"),
        r"trainer_state.json lacks \['global_step', 'data_loader'\]",
    ),
    "the manifest not JSON": (lambda path: (path / MANIFEST).write_text("{"), "MANIFEST.json is not a manifest"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_auto_resume_skips_a_damaged_newest_checkpoint(tmp_path, damage):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, write_role, state(1))
    bad = manager.save(2, write_role, state(2))
    assert problems(bad) == []
    damage_it, report = DAMAGE[damage]
    damage_it(bad)
    with pytest.warns(
        UserWarning, match=f"skipping damaged checkpoint.*global_step_2 .*{report}.*resuming from global_step_1"
    ):
        assert manager.latest() == good
    with pytest.raises(CheckpointError, match=f"cannot resume from {bad}: .*{report}"):
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
    (only / SHARD).unlink()
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
    os.truncate(first / SHARD, shutil.disk_usage(tmp_path).free)
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


# ---- checkpoints without a manifest (an older hybridflow's): checked by their layout ------------


def without_manifest(path: Path) -> Path:
    (path / MANIFEST).unlink()
    return path


def test_a_checkpoint_without_a_manifest_is_accepted_with_a_warning(tmp_path):
    manager = CheckpointManager(tmp_path)
    old = without_manifest(manager.save(1, write_role, state(1)))
    assert problems(old) == []
    with pytest.warns(UserWarning, match=f"{old} has no MANIFEST.json .*checked for presence and size only"):
        assert manager.latest() == old
    with pytest.warns(UserWarning, match="has no MANIFEST.json"):
        assert manager.resume_from(str(old)) == old


def not_metadata(path: Path) -> None:
    path.write_bytes(pickle.dumps({"model.weight": 1}))


# damage -> what the problem report says: what a checkpoint without a manifest can still be checked for
LAYOUT_DAMAGE = {
    "a shard truncated": (
        lambda path: os.truncate(path / SHARD, 3),
        f"{SHARD} has 3 bytes, and its DCP metadata places \\d+ in it",
    ),
    "a shard deleted": (lambda path: (path / SHARD).unlink(), f"{SHARD} is missing"),
    "the DCP metadata deleted": (lambda path: (path / METADATA).unlink(), f"{METADATA} is missing"),
    "the DCP metadata truncated": (
        lambda path: os.truncate(path / METADATA, 100),
        f"{METADATA} is not DCP metadata \\(UnpicklingError",
    ),
    "the DCP metadata another pickle": (lambda path: not_metadata(path / METADATA), "is not DCP metadata \\("),
    "the RNG state deleted": (lambda path: (path / "actor/rng_rank0.pt").unlink(), "actor/rng_rank0.pt is missing"),
    "the actor deleted": (lambda path: shutil.rmtree(path / "actor"), "actor/ is missing"),
    "the trainer state deleted": (lambda path: (path / "trainer_state.json").unlink(), "trainer_state.json is missing"),
}


@pytest.mark.parametrize("damage", sorted(LAYOUT_DAMAGE))
def test_a_damaged_checkpoint_without_a_manifest_is_found_by_its_layout(tmp_path, damage):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, write_role, state(1))
    bad = without_manifest(manager.save(2, write_role, state(2)))
    damage_it, report = LAYOUT_DAMAGE[damage]
    damage_it(bad)
    with pytest.warns(
        UserWarning, match=f"skipping damaged checkpoint.*global_step_2 .*{report}.*resuming from global_step_1"
    ):
        assert manager.latest() == good
    with pytest.raises(CheckpointError, match=f"cannot resume from {bad}: .*{report}"):
        manager.resume_from(str(bad))


# ---- files that cannot be read: damage, not a crash -------------------------------------------


def make_unreadable(monkeypatch, path: Path, error: OSError) -> None:
    """Opening ``path`` fails with ``error``: what a file with mode 000 gives a user other than root (these
    tests run as root, which ignores file modes), or a disk with a bad sector. Every read of a checkpoint
    (ours and DCP's) opens through ``Path.open``."""
    real_open = Path.open

    def fails(self, *args, **kwargs):
        if self == path:
            raise error
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", fails)


NO_PERMISSION = OSError(errno.EACCES, os.strerror(errno.EACCES))
IO_ERROR = OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize(
    "name, error",
    [(SHARD, NO_PERMISSION), (METADATA, NO_PERMISSION), ("trainer_state.json", NO_PERMISSION), (SHARD, IO_ERROR)],
    ids=["shard-EACCES", "metadata-EACCES", "trainer-state-EACCES", "shard-EIO"],
)
def test_a_file_that_cannot_be_read_is_damage(tmp_path, monkeypatch, manifest, name, error):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, write_role, state(1))
    bad = manager.save(2, write_role, state(2))
    if not manifest:
        without_manifest(bad)
    make_unreadable(monkeypatch, bad / name, error)
    report = f"{name} cannot be read \\({error.strerror}\\)"
    with pytest.warns(
        UserWarning, match=f"skipping damaged checkpoint.*global_step_2 .*{report}.*resuming from global_step_1"
    ):
        assert manager.latest() == good
    with pytest.raises(CheckpointError, match=f"cannot resume from {bad}: .*{report}"):
        manager.resume_from(str(bad))


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_a_shard_replaced_by_a_directory_or_a_dangling_link_is_damage(tmp_path, manifest):
    """Real unreadable files, no patching: open() fails with EISDIR, or ENOENT through the link."""
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, write_role, state(1))
    bad = manager.save(2, write_role, state(2))
    if not manifest:
        without_manifest(bad)
    (bad / SHARD).unlink()
    (bad / SHARD).mkdir()
    with pytest.warns(UserWarning, match=f"global_step_2 .*{SHARD} cannot be read \\(Is a directory\\)"):
        assert manager.latest() == good
    (bad / SHARD).rmdir()
    (bad / SHARD).symlink_to(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=f"cannot resume from {bad}: .*{SHARD} is missing"):
        manager.resume_from(str(bad))


# ---- what auto-resume passes over is said ------------------------------------------------------


@pytest.mark.parametrize("pointer", ["none", "older", "empty one"])
def test_an_empty_newest_directory_is_reported(tmp_path, pointer):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_role, state(1))
    good = manager.save(2, write_role, state(2))
    (tmp_path / "global_step_3").mkdir()
    if pointer == "none":
        (tmp_path / LATEST).unlink()
        expected = "skipping damaged checkpoint.*global_step_3 \\(an empty directory\\); resuming from global_step_2"
    elif pointer == "older":  # the pointer names step 2: step 3 is not this run's
        expected = (
            "ignoring global_step_3 \\(an empty directory\\): after the step .* names .*; resuming from global_step_2"
        )
    else:
        (tmp_path / LATEST).write_text("3")
        expected = "skipping damaged checkpoint.*global_step_3 \\(an empty directory\\); resuming from global_step_2"
    with pytest.warns(UserWarning, match=expected):
        assert manager.latest() == good


def test_a_pointer_to_a_missing_step_is_reported(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = manager.save(2, write_role, state(2))
    (tmp_path / LATEST).write_text("7")
    with pytest.warns(
        UserWarning, match="global_step_7 \\(named by latest_checkpointed_iteration.txt, but it does not"
    ):
        assert manager.latest() == good
    shutil.rmtree(good)  # a pointer, and no checkpoint at all: not a silent fresh start
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged: .*global_step_7 \\(named by"):
        manager.latest()


def test_a_directory_that_only_looks_like_a_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, write_role, state(1))
    (tmp_path / LATEST).unlink()
    junk = tmp_path / "global_step_5"
    (junk / "actor").mkdir(parents=True)
    (junk / "actor" / "model.bin").write_bytes(b"junk")
    expected = (
        "no COMPLETE marker \\(not written to the end\\), trainer_state.json is missing, actor/dcp/.metadata is missing"
    )
    with pytest.warns(UserWarning, match=f"global_step_5 \\({expected}\\); resuming from global_step_1"):
        assert manager.latest() == good
    with pytest.raises(CheckpointError, match=f"cannot resume from {junk}: {expected}; give an intact checkpoint"):
        manager.resume_from(str(junk))
    # the marker and a trainer state do not make it one
    (junk / COMPLETE).write_text("")
    (junk / "trainer_state.json").write_text(json.dumps(state(5)))
    with pytest.raises(CheckpointError, match=f"cannot resume from {junk}: actor/dcp/.metadata is missing; give"):
        manager.resume_from(str(junk))


# ---- the run directory before a run: nothing changes until the checks pass ----------------------


def snapshot(directory: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in directory.rglob("*")}


def test_prepare_run_dir_changes_nothing_when_the_checkpoint_is_damaged(tmp_path):
    from hybridflow.trainer.setup.config import ConfigError, load_config, to_yaml
    from hybridflow.trainer.setup.run_dir import prepare_run_dir
    from hybridflow.trainer.setup.run_plan import make_run_plan

    config = load_config([f"trainer.default_local_dir={tmp_path}"])
    plan = make_run_plan(config)
    manager = CheckpointManager(tmp_path)
    only = manager.save(1, write_role, state(1))
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "global_step_2.tmp-0123abcd" / "actor").mkdir(parents=True)  # an interrupted save
    os.truncate(only / SHARD, 3)
    before = snapshot(tmp_path)
    with pytest.raises(
        ConfigError, match=f"trainer.resume_mode.*every checkpoint .* is damaged: .*{SHARD} has 3 bytes"
    ):
        prepare_run_dir(config, plan)
    assert snapshot(tmp_path) == before
    # once the checkpoint is whole, the run directory is tidied
    shutil.rmtree(only)
    manager.save(1, write_role, state(1))
    assert prepare_run_dir(config, plan) == only
    assert not (tmp_path / "global_step_2.tmp-0123abcd").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
