"""The error the driver sees when a worker raises."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker raised: names the group, the method and the rank, and carries the worker's traceback."""

    def __init__(self, group: str, method: str, rank: int, cause: BaseException, remote_traceback: str):
        self.group = group
        self.method = method
        self.rank = rank
        self.cause = cause
        self.remote_traceback = remote_traceback
        super().__init__(
            f"worker group '{group}', rank {rank}, method '{method}' raised "
            f"{type(cause).__name__}: {cause}\n--- worker traceback ---\n{remote_traceback}"
        )


class WorkerLost(WorkerError):
    """A worker's process is gone (its actor died, it crashed, Ray killed it for memory, or its node died): the
    group cannot answer again."""

    @property
    def reason(self) -> str:
        """The first line of Ray's account of it."""
        lines = str(self.cause).strip().splitlines()
        return lines[0] if lines else type(self.cause).__name__
