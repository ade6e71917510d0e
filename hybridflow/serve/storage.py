"""Saved weights under ``tinker://`` paths, each a directory the service owns.

    tinker://<model_id>/weights/<name>          a training state: the adapter and its AdamW state
    tinker://<model_id>/sampler_weights/<name>  the adapter alone, for sampling

A path maps to ``<storage>/<model_id>/<kind>/<name>/`` with the adapter in peft's layout and ``meta.json`` (its
rank, parts, scaling, base model and owner). A save is written into a scratch directory and renamed into place, so
a path holds a whole save or nothing, also across a crash; paths survive a restart of the service. A path
belongs to the API key that saved it: other keys cannot see it (another session of the same key can, which is how
a client resumes a run).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
META_FILE = "meta.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9-]{1,64}:train:[0-9]{1,9}")


class PathError(ValueError):
    """A tinker:// path that is malformed (``status`` 400), not found or not the caller's (404)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def owner_of(api_key: str) -> str:
    """The name an API key's saves are filed under (a hash: the key itself is never written)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class SavedPath:
    uri: str
    model_id: str
    kind: str  # "weights" | "sampler_weights"
    name: str


def parse_path(uri: str) -> SavedPath:
    """The parts of a tinker:// path; PathError (400) naming what is wrong."""
    if not uri.startswith(SCHEME):
        raise PathError(f"{uri!r} is not a tinker:// path (tinker://<model_id>/weights/<name>)", 400)
    parts = uri[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.fullmatch(parts[0]) or not _NAME.fullmatch(parts[2]):
        raise PathError(
            f"{uri!r} is not tinker://<model_id>/{{weights|sampler_weights}}/<name> (a name of letters, digits, "
            "'.', '_', '-', up to 128)",
            400,
        )
    return SavedPath(uri, parts[0], parts[1], parts[2])


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise PathError(f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' (up to 128, no '/')", 400)


class Storage:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        (self.root / ".scratch").mkdir(parents=True, exist_ok=True)

    def directory(self, saved: SavedPath) -> Path:
        return self.root / saved.model_id / saved.kind / saved.name

    def save(
        self, saved: SavedPath, owner: str, meta: dict, write: Callable[[Path], None], *, overwrite: bool = False
    ) -> None:
        """``write(scratch)`` fills a scratch directory; with ``meta`` (and its owner) it becomes the path's
        directory in one rename. PathError (400) when the path exists and ``overwrite`` is off."""
        target = self.directory(saved)
        if target.exists() and not overwrite:
            raise PathError(f"{saved.uri} exists; save under another name, or pass overwrite", 400)
        scratch = self.root / ".scratch" / uuid.uuid4().hex
        scratch.mkdir()
        try:
            write(scratch)
            (scratch / META_FILE).write_text(json.dumps({**meta, "owner": owner, "path": saved.uri}))
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                old = self.root / ".scratch" / uuid.uuid4().hex
                os.rename(target, old)
                os.rename(scratch, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def read(self, uri: str, owner: str) -> tuple[SavedPath, Path, dict]:
        """The path's parts, directory and meta, for its owner only (PathError 404 otherwise: another key's
        paths are not told apart from missing ones)."""
        saved = parse_path(uri)
        directory = self.directory(saved)
        try:
            meta = json.loads((directory / META_FILE).read_text())
        except (OSError, ValueError):
            meta = None
        if meta is None or meta.get("owner") != owner:
            raise PathError(f"{uri} does not exist (or was saved with another API key)", 404)
        return saved, directory, meta

    def remove(self, saved: SavedPath) -> None:
        shutil.rmtree(self.directory(saved), ignore_errors=True)

    def clear_scratch(self) -> None:
        """Scratch left by a save that a crash interrupted."""
        for leftover in (self.root / ".scratch").iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
