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
