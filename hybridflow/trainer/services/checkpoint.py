"""Checkpoint directories on the driver: atomic writes, a manifest, verified resume with fallback, pruning.

A checkpoint is written into ``global_step_N.tmp-<id>/``: every role's state, the driver's state
(``trainer_state.json``), then ``MANIFEST.json`` (each file's size and CRC-32) and the ``COMPLETE``
marker; only then is it renamed to ``global_step_N/`` and the pointer file updated. A crash at any
moment leaves either a finished checkpoint or a ``.tmp`` directory, which the next run removes.

Resuming (and ``export``) verifies the chosen checkpoint before anything loads it (checkpoint_check.py: every
file against the manifest, or without one each role's layout, with a warning that the contents are
unverified). ``auto`` falls
back from a damaged newest checkpoint (an empty ``global_step_N/``, a pointer to a step that is gone)
to the newest good one, with a warning that names each one skipped and why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridflow.trainer.services.checkpoint_check import (
    COMPLETE,
    TRAINER_STATE,
    checkpoint_size,
    is_complete,
    listing_problem,
    problems,
    warn_if_unverified,
    write_manifest,
)
from hybridflow.validation import UserError

LATEST = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
TMP_DIR = re.compile(r"^global_step_\d+\.tmp-[0-9a-f]+$")
FREE_SPACE_MARGIN = 1.1  # a save needs the last checkpoint's size times this, free


class CheckpointNotFound(UserError, FileNotFoundError):
    """A path given as a checkpoint (or a run directory) holds none that can be loaded."""


class CheckpointError(UserError, OSError):
    """A checkpoint cannot be written (no space, no permission) or the one asked for is damaged."""


@dataclass(frozen=True)
class Search:
    """What ``CheckpointManager.find_latest`` found."""

    checkpoint: Path | None  # the newest intact checkpoint (the pointer's first); None if there is none
    skipped: tuple[str, ...]  # each damaged one passed over on the way, with why: "<path> (problem, problem)"
    newer: tuple[Path, ...]  # global_step_N directories after the pointer's step, left unread

    def describe_skipped(self) -> str:
        untried = [f"not tried: {', '.join(p.name for p in self.newer)}, after the step {LATEST} names"]
        return "; ".join([*self.skipped, *(untried if self.newer else [])])

    def warnings(self, action: str) -> list[str]:
        """What to tell the user before ``action`` ("resuming from") the checkpoint found: the damaged ones
        skipped, the newer ones left alone."""
        assert self.checkpoint is not None
        notes = []
        if self.skipped:
            notes.append(f"skipping damaged checkpoint(s) {'; '.join(self.skipped)}; {action} {self.checkpoint.name}")
        if self.newer:
            names = [path.name + (f" ({listing})" if (listing := listing_problem(path)) else "") for path in self.newer]
            notes.append(
                f"ignoring {', '.join(names)}: after the step {LATEST} names as the last one saved (left by an "
                f"earlier run, or by a save stopped before it updated the pointer); {action} {self.checkpoint.name}"
            )
        return notes


class CheckpointManager:
    def __init__(self, run_dir: Path, max_to_keep: int = -1):
        self.run_dir = run_dir
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.run_dir / f"global_step_{step}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.run_dir.glob("global_step_*"):
            match = STEP_DIR.match(path.name)
            if match and is_complete(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def remove_unfinished(self) -> list[Path]:
        """Delete what interrupted saves left (``global_step_N.tmp-*``); returns what was removed."""
        stale = (
            [p for p in self.run_dir.glob("global_step_*.tmp-*") if TMP_DIR.match(p.name)]
            if self.run_dir.is_dir()
            else []
        )
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return stale

    def check_free_space(self) -> None:
        """CheckpointError when the disk cannot hold another checkpoint the size of the last one."""
        checkpoints = self.complete_checkpoints()
        if not checkpoints:
            return
        needed = checkpoint_size(checkpoints[-1][1]) * FREE_SPACE_MARGIN
        free = shutil.disk_usage(self.run_dir).free
        if free < needed:
            raise CheckpointError(
                f"{self.run_dir} has {free / 2**30:.2f} GiB free, and a checkpoint needs about "
                f"{needed / 2**30:.2f} GiB (the last one's size); free some space, keep fewer checkpoints "
                "(trainer.max_ckpt_to_keep) or write them elsewhere (trainer.default_local_dir)"
            )

    def save(
        self,
        step: int,
        write_roles: Callable[[Path], None],
        trainer_state: dict,
        before_commit: Callable[[], None] | None = None,
    ) -> Path:
        """``write_roles(tmp_dir)`` has the workers write their state; then the driver's state, manifest,
        ``before_commit()`` (what must exist whenever the checkpoint does: the step's records), marker, rename.
        A failed save leaves no ``.tmp`` directory and the earlier checkpoints intact."""
        self.check_free_space()
        tmp = self.run_dir / f"global_step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            write_roles(tmp)
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            write_manifest(tmp)
            if before_commit is not None:
                before_commit()
            (tmp / COMPLETE).write_text("")
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(error, OSError):
                raise CheckpointError(
                    f"writing the checkpoint of step {step} under {self.run_dir} failed: {error}; the earlier "
                    "checkpoints are intact (check the disk, or set trainer.default_local_dir elsewhere)"
                ) from error
            raise
        final = self.step_dir(step)
        if final.exists():
            self._remove(final)
        os.replace(tmp, final)
        pointer_tmp = self.run_dir / f"{LATEST}.tmp"
        pointer_tmp.write_text(str(step))
        os.replace(pointer_tmp, self.run_dir / LATEST)
        self._prune()
        return final

    def _prune(self) -> None:
        if self.max_to_keep <= 0:
            return
        for _, path in self.complete_checkpoints()[: -self.max_to_keep]:
            self._remove(path)

    @staticmethod
    def _remove(checkpoint: Path) -> None:
        """Renamed to a ``.tmp`` name first: a removal cut short leaves what the next run removes, never a
        half-deleted ``global_step_N``."""
        doomed = checkpoint.with_name(f"{checkpoint.name}.tmp-{uuid.uuid4().hex[:8]}")
        os.replace(checkpoint, doomed)
        shutil.rmtree(doomed)

    def _pointer(self) -> int | None:
        pointer = self.run_dir / LATEST
        try:
            text = pointer.read_text().strip()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            warnings.warn(f"{pointer} cannot be read ({error}); ignoring it", stacklevel=3)
            return None
        if not text.isdigit():
            warnings.warn(f"{pointer} holds {text[:40]!r}, not a step number; ignoring it", stacklevel=3)
            return None
        return int(text)

    def find_latest(self) -> Search:
        """The newest intact checkpoint. The pointer's step first (the last one saved: checkpoints after it
        are an earlier run's, which a run resumed from an older checkpoint left), then every
        ``global_step_N`` below it from the highest down, complete or not (an empty or half-copied one is
        damage to report, not to pass over in silence). A pointer to a step that is not there counts as a
        damaged checkpoint, and then every ``global_step_N`` is a candidate."""
        steps = {}
        try:
            listing = list(self.run_dir.iterdir()) if self.run_dir.is_dir() else []
        except OSError as error:
            raise CheckpointError(f"{self.run_dir} cannot be listed: {error.strerror or error}") from None
        for path in listing:
            if match := STEP_DIR.match(path.name):
                steps[int(match.group(1))] = path
        pointer = self._pointer()
        skipped, newer = [], []
        if pointer is not None and pointer not in steps:
            skipped.append(f"{self.step_dir(pointer)} (named by {LATEST}, but it does not exist)")
        elif pointer is not None:
            newer = [steps.pop(step) for step in sorted(steps) if step > pointer]
        for step in sorted(steps, reverse=True):
            found = problems(steps[step])
            if not found:
                return Search(steps[step], tuple(skipped), tuple(newer))
            skipped.append(f"{steps[step]} ({', '.join(found)})")
        return Search(None, tuple(skipped), tuple(newer))

    def latest(self) -> Path | None:
        """The checkpoint ``auto`` resumes from (``find_latest``); the damaged ones skipped are named in a
        warning, as is a checkpoint without a manifest. CheckpointError when checkpoints exist but every
        one is damaged (starting over would be a surprise)."""
        search = self.find_latest()
        if search.checkpoint is None:
            if search.skipped:
                raise CheckpointError(
                    f"every checkpoint in {self.run_dir} is damaged: {search.describe_skipped()}. Set "
                    "trainer.resume_mode=disable to start over (the old files stay), or point "
                    "trainer.default_local_dir elsewhere"
                )
            return None
        for note in search.warnings("resuming from"):
            warnings.warn(note, stacklevel=2)
        warn_if_unverified(search.checkpoint)
        return search.checkpoint

    def resume_from(self, resume_mode: str) -> Path | None:
        """``disable``: None; ``auto``: the newest intact checkpoint (or None); else a checkpoint path, which
        must be intact (CheckpointNotFound when it is not there, CheckpointError naming what is wrong)."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = Path(resume_mode).expanduser()
        if looks_like_run_dir(path) and not (path / COMPLETE).exists():
            raise CheckpointNotFound(
                f"trainer.resume_mode={resume_mode}: {path} is a run directory, not a checkpoint; give one of its "
                "global_step_N directories, or auto (with trainer.default_local_dir set to it)"
            )
        found = problems(path)
        if not found:
            warn_if_unverified(path)
            return path
        message = f"trainer.resume_mode={resume_mode}: cannot resume from {path}: {', '.join(found)}"
        if not path.is_dir():
            raise CheckpointNotFound(f"{message}; give auto, disable, or a global_step_N directory")
        raise CheckpointError(f"{message}; give an intact checkpoint, or auto or disable")


def looks_like_run_dir(path: Path) -> bool:
    """Whether ``path`` holds checkpoints (or their pointer), rather than being one."""
    try:
        return (path / LATEST).exists() or any(STEP_DIR.match(p.name) for p in path.iterdir())
    except OSError:
        return False
