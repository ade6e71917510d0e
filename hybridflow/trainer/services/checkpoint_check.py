"""What makes a checkpoint directory whole, and the check that it is: the ``COMPLETE`` marker, the driver's
``trainer_state.json``, and ``MANIFEST.json`` (each file's size and CRC-32) against the files; without a manifest
(an older hybridflow's checkpoint) each role's layout (engine/checkpoint.py ``state_problems``). A file that cannot
be read counts as damage. The manager (checkpoint.py) writes and chooses checkpoints with these."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path
from typing import BinaryIO

from hybridflow.engine.checkpoint import state_problems
from hybridflow.run_files import ACTOR_STATE, CRITIC_STATE

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_KEYS = ("global_step", "data_loader")  # every trainer's; RL's adds kl_coef


def is_complete(directory: Path) -> bool:
    """Written to the end (marker and trainer state present); ``problems`` says whether it is intact."""
    return directory.is_dir() and (directory / COMPLETE).is_file() and (directory / TRAINER_STATE).is_file()


def _crc32(file: BinaryIO) -> int:
    crc = 0
    while chunk := file.read(1 << 22):
        crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def write_manifest(directory: Path) -> int:
    """Record every file's size and CRC-32; returns the total size in bytes."""
    entries = {}
    for path in _files(directory):
        with path.open("rb") as file:
            entries[str(path.relative_to(directory))] = {"size": os.fstat(file.fileno()).st_size, "crc32": _crc32(file)}
    (directory / MANIFEST).write_text(json.dumps(entries, indent=1))
    return sum(entry["size"] for entry in entries.values())


def checkpoint_size(directory: Path) -> int:
    """Bytes of a checkpoint's files."""
    return sum(p.stat().st_size for p in _files(directory))


def _unreadable(name: str, error: OSError) -> str:
    return (
        f"{name} is missing"
        if isinstance(error, FileNotFoundError)
        else f"{name} cannot be read ({error.strerror or error})"
    )


def listing_problem(directory: Path) -> str | None:
    try:
        empty = not any(directory.iterdir())
    except FileNotFoundError:
        return "it does not exist"
    except NotADirectoryError:
        return "it is not a directory"
    except OSError as error:
        return f"it cannot be listed ({error.strerror or error})"
    return "an empty directory" if empty else None


def _trainer_state_problems(directory: Path) -> list[str]:
    try:
        state = json.loads((directory / TRAINER_STATE).read_bytes())
    except OSError as error:
        return [_unreadable(TRAINER_STATE, error)]
    except ValueError as error:  # not JSON, or not UTF-8
        return [f"{TRAINER_STATE} is not valid JSON ({error})"]
    if not isinstance(state, dict):
        return [f"{TRAINER_STATE} is not a JSON object"]
    missing = [key for key in TRAINER_STATE_KEYS if key not in state]
    return [f"{TRAINER_STATE} lacks {missing}"] if missing else []


def _manifest_problems(directory: Path) -> list[str] | None:
    """Each file the manifest lists that is missing, unreadable, or not the size or CRC-32 written; None
    when there is no manifest."""
    try:
        text = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        return [_unreadable(MANIFEST, error)]
    try:
        expected = {str(name): (int(entry["size"]), int(entry["crc32"])) for name, entry in json.loads(text).items()}
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        return [f"{MANIFEST} is not a manifest ({type(error).__name__}: {error})"]
    found = []
    for name, (size, crc) in sorted(expected.items()):
        try:
            with (directory / name).open("rb") as file:
                actual = os.fstat(file.fileno()).st_size
                if actual != size:
                    found.append(f"{name} has {actual} bytes, {size} were written")
                elif _crc32(file) != crc:
                    found.append(f"{name} changed since it was written (CRC-32)")
        except OSError as error:
            found.append(_unreadable(name, error))
    return found


def _layout_problems(directory: Path) -> list[str]:
    found = []
    for role in (ACTOR_STATE, CRITIC_STATE):
        role_dir = directory / role
        if role_dir.is_dir():
            found += [f"{role}/{problem}" for problem in state_problems(role_dir)]
        elif role_dir.exists():
            found.append(f"{role} is not a directory")
        elif role == ACTOR_STATE:  # every run has an actor; a critic only some estimators
            found.append(f"{ACTOR_STATE}/ is missing")
    return found


def _file_problems(directory: Path) -> list[str]:
    """With a manifest, each file's size and CRC-32 (then, all intact, each role's layout); without one,
    each role's layout only."""
    return _manifest_problems(directory) or _layout_problems(directory)


def role_problems(directory: Path) -> list[str]:
    """What is wrong with the roles' state in a checkpoint (all that ``export`` reads); see ``problems``."""
    listing = listing_problem(directory)
    return [listing] if listing else _file_problems(directory)


def problems(directory: Path) -> list[str]:
    """What keeps a resume from a checkpoint; empty for an intact one. An empty or unlistable directory, no
    ``COMPLETE`` marker, a trainer state that does not read; with a manifest, each file missing, cut
    short or changed; without one (``is_verified``), each role's layout (``state_problems``). A file that
    cannot be read is a problem like any other, named with the reason."""
    listing = listing_problem(directory)
    if listing:
        return [listing]
    found = [] if (directory / COMPLETE).is_file() else [f"no {COMPLETE} marker (not written to the end)"]
    return found + _trainer_state_problems(directory) + _file_problems(directory)


def is_verified(directory: Path) -> bool:
    """Whether the checkpoint has a manifest (its files' contents checked, not only their layout)."""
    return (directory / MANIFEST).is_file()


def warn_if_unverified(checkpoint: Path) -> None:
    if not is_verified(checkpoint):
        warnings.warn(
            f"{checkpoint} has no {MANIFEST} (written by an older hybridflow, or not by the trainer): its files were "
            "checked for presence and size only, not their contents",
            stacklevel=3,
        )


def read_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / TRAINER_STATE).read_text())
