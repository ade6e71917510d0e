"""Checkpoint directories on the driver: atomic writes, the latest pointer, pruning, resume selection.

A checkpoint is written into ``global_step_N.tmp-<id>/`` and renamed to ``global_step_N/`` only
once every role and the driver's state are in it and the ``COMPLETE`` marker is written; the
pointer file is updated after the rename. A crash at any moment therefore leaves either a
finished checkpoint or a ``.tmp`` directory that resume ignores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def is_complete(directory: Path) -> bool:
    return directory.is_dir() and (directory / COMPLETE).is_file() and (directory / TRAINER_STATE).is_file()


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

    def save(self, step: int, write_roles: Callable[[Path], None], trainer_state: dict) -> Path:
        """``write_roles(tmp_dir)`` has the workers write their state; then the driver's state, marker, rename."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f"global_step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        write_roles(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        (tmp / COMPLETE).write_text("")
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
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
            shutil.rmtree(path)

    def latest(self) -> Path | None:
        """The pointer's checkpoint if it is complete, else the highest complete one."""
        pointer = self.run_dir / LATEST
        if pointer.is_file():
            candidate = self.step_dir(int(pointer.read_text().strip() or -1))
            if is_complete(candidate):
                return candidate
        complete = self.complete_checkpoints()
        return complete[-1][1] if complete else None

    def resume_from(self, resume_mode: str) -> Path | None:
        """``disable``: None; ``auto``: the latest complete checkpoint (or None); else a checkpoint path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = Path(resume_mode).expanduser()
        if not is_complete(path):
            raise FileNotFoundError(
                f"trainer.resume_mode={resume_mode}: not a complete checkpoint directory "
                f"(a global_step_N directory with {COMPLETE} and {TRAINER_STATE}); use auto, disable, or such a path"
            )
        return path


def read_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / TRAINER_STATE).read_text())
