"""Running code in the sandbox from a test, and looking at the host while it runs."""

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from hybridflow.tools.sandbox import SandboxLimits, SandboxResult, run_python


def run(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:  # noqa: B008
    return asyncio.run(run_python(code, limits, stdin=stdin))


def new_marker() -> str:
    """A unique string to put in a run's code, to find its processes by."""
    return f"marker-{uuid.uuid4().hex}"


def processes_with(marker: str) -> list[int]:
    """Live host processes whose command line holds ``marker`` (zombies have an empty one)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``condition`` without blocking the event loop (the run under test goes on meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
