"""The on-disk cache of built-in models: one finished Hugging Face directory per model.

A directory appears in the cache only when it is complete: it is built in a temporary
sibling directory and renamed into place (an atomic rename on one filesystem), so a crash
or Ctrl-C mid-build leaves at most a `.tmp-*` folder, never a half model that later loads
wrong. A lock file serialises builders, so when several worker processes resolve the same
name at start-up, one builds and the others wait and reuse it.

Each directory holds `hybridflow_source.json`, the fingerprint of what it was built from;
a directory whose fingerprint differs from the requested one (a newer GGUF, a changed
builder) is rebuilt and replaced.

A build says what it does in one line of its own (`announce`), not in transformers' progress
bars, which are off while it runs (library_output.py).

transformers' `save_pretrained` writes a model's files only on distributed rank 0, silently: a worker of another
rank that is the first to ask for a model builds it in a child process of its own, and every build must leave a
`config.json` before it enters the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from hybridflow.library_output import quiet_transformers

FINGERPRINT_FILE = "hybridflow_source.json"


def cache_root() -> Path:
    """`$HYBRIDFLOW_CACHE`, or `hybridflow` in the user's cache directory (`$XDG_CACHE_HOME`, by default
    `~/.cache`)."""
    root = os.environ.get("HYBRIDFLOW_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "hybridflow"


def model_cache_dir(key: str) -> Path:
    """Where the built-in model with this cache key lives (it may not exist yet)."""
    return cache_root() / "models" / key


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_fingerprint(directory: Path) -> dict | None:
    try:
        return json.loads((directory / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None


def materialise(target: Path, fingerprint: dict, build: Callable[[Path], None], announce: str = "") -> Path:
    """Return `target`, first building it with `build(tmp_dir)` unless it is already there.

    `build` writes a complete Hugging Face directory into the empty folder it is given; `announce`, when
    given, is printed (with the target) as the build starts.
    """
    if _read_fingerprint(target) == fingerprint:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if _read_fingerprint(target) == fingerprint:  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            if announce:
                print(f"hybridflow: {announce} into {target}", flush=True)
            _build(build, tmp)
            if not (tmp / "config.json").is_file():
                written = sorted(path.name for path in tmp.iterdir())
                raise RuntimeError(f"building {target.name} wrote no config.json (only {written})")
            (tmp / FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
            if target.exists():  # stale: built from something else; move it aside, then drop it
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
                os.rename(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _build(build: Callable[[Path], None], directory: Path) -> None:
    """``build(directory)`` here, or in a child process when this one is a distributed rank other than 0 (whose
    ``save_pretrained`` would write nothing). A build that may run apart must pickle (a module-level function or a
    ``functools.partial`` of one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        _quiet_build(build, directory)
        return
    child = multiprocessing.get_context("spawn").Process(target=_quiet_build, args=(build, directory))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building into {directory} in a child process failed (exit code {child.exitcode})")


def _quiet_build(build: Callable[[Path], None], directory: Path) -> None:
    with quiet_transformers():
        build(directory)
