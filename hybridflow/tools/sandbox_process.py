"""The sandboxed process from outside (tools/sandbox.py starts it): its stdin fed, its stdout and stderr kept within
one byte budget, and the kill at the wall timeout, at the output limit, or on cancellation, after which nothing of the
sandbox is left."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

CHUNK = 65536


class Output:
    """stdout and stderr, kept up to one shared byte budget; ``full`` is set once something was dropped."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.streams = {1: bytearray(), 2: bytearray()}
        self.full = asyncio.Event()

    async def pump(self, stream: asyncio.StreamReader, number: int) -> None:
        """Read to the end, keeping what fits: past the budget, chunks are dropped (memory stays bounded)
        but still read, so the pipe reaches EOF once the sandbox is killed."""
        while chunk := await stream.read(CHUNK):
            kept = chunk[: self.budget]
            self.streams[number] += kept
            self.budget -= len(kept)
            if len(kept) < len(chunk):
                self.full.set()

    def text(self, number: int) -> str:
        return self.streams[number].decode("utf-8", errors="replace")


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()


async def _kill(proc: asyncio.subprocess.Process, finished: asyncio.Task) -> None:
    """SIGKILL the sandbox's pid-namespace init: the kernel kills every process of the namespace before
    that init can be reaped, so once bwrap (its parent) is done, nothing of the sandbox is left.
    Before bwrap has made the namespace, its process group is all there is."""
    with contextlib.suppress(OSError):
        for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
    try:
        await asyncio.wait_for(asyncio.shield(finished), 2.0)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await finished


async def _until_done(proc: asyncio.subprocess.Process, pumps: list[asyncio.Task]) -> None:
    """Both pipes at EOF (every process of the sandbox has exited) and bwrap reaped."""
    await asyncio.gather(*pumps)
    await proc.wait()


async def supervise(
    proc: asyncio.subprocess.Process, stdin: bytes, max_output_bytes: int, timeout_s: float
) -> tuple[Output, bool]:
    """Feed stdin and collect output until the sandbox ends; kill it at the timeout, at the output limit,
    or when cancelled. Returns the output and whether the wall timeout killed it."""
    out = Output(max_output_bytes)
    pumps = [asyncio.create_task(out.pump(proc.stdout, 1)), asyncio.create_task(out.pump(proc.stderr, 2))]
    finished = asyncio.create_task(_until_done(proc, pumps))
    full = asyncio.create_task(out.full.wait())
    feed = asyncio.create_task(_feed(proc, stdin))
    try:
        await asyncio.wait([finished, full], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        return out, not finished.done() and not out.full.is_set()
    finally:
        if not finished.done():
            await _kill(proc, finished)
        for task in (full, feed):
            task.cancel()
