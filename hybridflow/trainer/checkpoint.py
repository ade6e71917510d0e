"""Checkpoint directories on the driver: atomic writes, a manifest, verified resume with fallback, pruning.

A checkpoint is written into ``global_step_N.tmp-<id>/``: every role's state, the driver's state
(``trainer_state.json``), then ``MANIFEST.json`` (each file's size and CRC-32) and the ``COMPLETE``
marker; only then is it renamed to ``global_step_N/`` and the pointer file updated. A crash at any
moment leaves either a finished checkpoint or a ``.tmp`` directory, which the next run removes.

Resuming verifies the chosen checkpoint against its manifest (and that its trainer state reads)
before any worker loads it. ``auto`` falls back from a damaged newest checkpoint to the newest good
one, with a warning that names the bad one and why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

from hybridflow.validation import UserError

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_KEYS = ("global_step", "data_loader", "kl_coef")
STEP_DIR = re.compile(r"^global_step_(\d+)$")
TMP_DIR = re.compile(r"^global_step_\d+\.tmp-[0-9a-f]+$")
FREE_SPACE_MARGIN = 1.1  # a save needs the last checkpoint's size times this, free


class CheckpointNotFound(UserError, FileNotFoundError):
    """A path given as a checkpoint (or a run directory) holds none that can be loaded."""


class CheckpointError(UserError, OSError):
    """A checkpoint cannot be written (no space, no permission) or every one found is damaged."""


def is_complete(directory: Path) -> bool:
    """Written to the end (marker and trainer state present); ``problems`` says whether it is intact."""
    return directory.is_dir() and (directory / COMPLETE).is_file() and (directory / TRAINER_STATE).is_file()


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def write_manifest(directory: Path) -> int:
    """Record every file's size and CRC-32; returns the total size in bytes."""
    entries = {str(p.relative_to(directory)): {"size": p.stat().st_size, "crc32": _crc32(p)} for p in _files(directory)}
    (directory / MANIFEST).write_text(json.dumps(entries, indent=1))
    return sum(entry["size"] for entry in entries.values())


def checkpoint_size(directory: Path) -> int:
    """Bytes of a checkpoint's files."""
    return sum(p.stat().st_size for p in _files(directory))


def problems(directory: Path) -> list[str]:
    """What is wrong with a checkpoint: missing, truncated or changed files, an unreadable trainer state.
    Empty for an intact one. A checkpoint without a manifest (older hybridflow) is checked for its
    trainer state only."""
    if not is_complete(directory):
        return [f"not complete (no {COMPLETE} or {TRAINER_STATE})"]
    found = []
    try:
        state = json.loads((directory / TRAINER_STATE).read_text())
        missing = [key for key in TRAINER_STATE_KEYS if key not in state]
        if missing:
            found.append(f"{TRAINER_STATE} lacks {missing}")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        found.append(f"{TRAINER_STATE} is not valid JSON ({error})")
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return found
    try:
        entries = json.loads(manifest.read_text())
    except json.JSONDecodeError as error:
        return [*found, f"{MANIFEST} is not valid JSON ({error})"]
    for name, entry in entries.items():
        path = directory / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            found.append(f"{name} has {path.stat().st_size} bytes, {entry['size']} were written")
        elif _crc32(path) != entry["crc32"]:
            found.append(f"{name} changed since it was written (CRC-32)")
    return found


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

    def save(self, step: int, write_roles: Callable[[Path], None], trainer_state: dict) -> Path:
        """``write_roles(tmp_dir)`` has the workers write their state; then the driver's state, manifest,
        marker, rename. A failed save leaves no ``.tmp`` directory and the earlier checkpoints intact."""
        self.check_free_space()
        tmp = self.run_dir / f"global_step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            write_roles(tmp)
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            write_manifest(tmp)
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

    def _pointer(self) -> int | None:
        pointer = self.run_dir / LATEST
        if not pointer.is_file():
            return None
        text = pointer.read_text().strip()
        if not text.isdigit():
            warnings.warn(f"{pointer} holds {text[:40]!r}, not a step number; ignoring it", stacklevel=2)
            return None
        return int(text)

    def latest(self) -> Path | None:
        """The newest intact checkpoint: the pointer's, else the highest; damaged ones are skipped with a
        warning naming them. CheckpointError when checkpoints exist but every one is damaged."""
        candidates = [path for _, path in reversed(self.complete_checkpoints())]
        pointer = self._pointer()
        if pointer is not None and self.step_dir(pointer) in candidates:
            candidates.remove(self.step_dir(pointer))
            candidates.insert(0, self.step_dir(pointer))
        damaged = []
        for path in candidates:
            found = problems(path)
            if not found:
                if damaged:
                    warnings.warn(
                        f"skipping damaged checkpoint(s) {'; '.join(damaged)}; resuming from {path.name}", stacklevel=2
                    )
                return path
            damaged.append(f"{path} ({', '.join(found)})")
        if damaged:
            raise CheckpointError(
                f"every checkpoint in {self.run_dir} is damaged: {'; '.join(damaged)}. Set trainer.resume_mode=disable "
                "to start over (the old files stay), or point trainer.default_local_dir elsewhere"
            )
        return None

    def resume_from(self, resume_mode: str) -> Path | None:
        """``disable``: None; ``auto``: the newest intact checkpoint (or None); else a checkpoint path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = Path(resume_mode).expanduser()
        if not is_complete(path):
            raise CheckpointNotFound(
                f"trainer.resume_mode={resume_mode}: not a complete checkpoint directory "
                f"(a global_step_N directory with {COMPLETE} and {TRAINER_STATE}); use auto, disable, or such a path"
            )
        found = problems(path)
        if found:
            raise CheckpointError(f"trainer.resume_mode={resume_mode}: the checkpoint is damaged: {', '.join(found)}")
        return path


def read_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / TRAINER_STATE).read_text())
