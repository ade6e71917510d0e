"""The training service's futures and its worker queue: each request's result (or error) kept until fetched, and one
thread that runs the worker's calls in order, batching the samples that can run as one generation."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.controller.errors import WorkerLost
from hybridflow.serve.storage import PathError

log = logging.getLogger("hybridflow.serve")

USER, SERVER = "user", "server"  # the SDK's error categories (RequestErrorCategory)


class ServiceError(Exception):
    """A request refused on arrival: answered with HTTP ``status`` and the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Outcome:
    """A finished request: a protobuf payload, a JSON one, or an error with its category."""

    payload: bytes | dict | None = None
    error: str | None = None
    category: str = USER


class Results:
    """Each request's future: pending until its job finishes, then kept until fetched (at most ``max_kept``
    finished results; the oldest fetched go first, then the oldest)."""

    def __init__(self, max_kept: int):
        self.max_kept = max_kept
        self.futures: dict[str, asyncio.Future] = {}
        self.owner: dict[str, str] = {}
        self.finished: OrderedDict[str, bool] = OrderedDict()  # request id -> fetched

    def new(self, owner: str) -> str:
        request_id = uuid.uuid4().hex
        self.futures[request_id] = asyncio.get_running_loop().create_future()
        self.owner[request_id] = owner
        return request_id

    def finish(self, request_id: str, outcome: Outcome) -> None:
        future = self.futures.get(request_id)
        if future is None or future.done():
            return
        future.set_result(outcome)
        self.finished[request_id] = False
        while len(self.finished) > self.max_kept:
            fetched = [key for key, done in self.finished.items() if done]
            self._forget(fetched[0] if fetched else next(iter(self.finished)))

    def _forget(self, request_id: str) -> None:
        self.finished.pop(request_id, None)
        self.futures.pop(request_id, None)
        self.owner.pop(request_id, None)

    async def wait(self, request_id: str, owner: str, timeout: float) -> Outcome | None:
        """The outcome, or None when it is not ready within ``timeout``; ServiceError (404) for an unknown id
        or another key's."""
        future = self.futures.get(request_id)
        if future is None or self.owner.get(request_id) != owner:
            raise ServiceError(f"no request {request_id!r} (unknown, expired, or not this key's)", 404)
        try:
            outcome = await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return None
        self.finished[request_id] = True
        return outcome


@dataclass
class Job:
    """Work for the worker. Jobs with the same ``batch_key`` next to each other in the queue run as one call of
    ``run_many`` (samples from one sampler with the same settings), each answered with its own outcome."""

    request_id: str | None
    run: Callable[[], bytes | dict | None] | None = None
    batch_key: tuple | None = None
    run_many: Callable[[list[Job]], list[bytes | dict]] | None = None
    size: int = 1  # what it adds to a batch (samples)
    data: Any = None  # what ``run_many`` reads of each job


class Executor:
    """One thread running the worker's calls in submission order; each job's outcome goes back to the loop.

    When the worker's process is gone (``WorkerLost``), nothing it held can be served again: the job that met it
    and every queued one are answered with the reason, later ones are refused (503), and ``on_lost`` is called on
    the loop (the service stops; saved states on disk survive for the next one)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        finish: Callable[[str, Outcome], None],
        max_queued: int,
        max_batch: int,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.loop, self.finish, self.max_queued, self.max_batch = loop, finish, max_queued, max_batch
        self.on_lost = on_lost
        self.lost: str | None = None  # why the worker is gone
        self.jobs: deque[Job | None] = deque()
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="hybridflow-serve-executor", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.lost is not None:
            raise ServiceError(self.lost, 503)
        with self.ready:
            self.jobs.append(job)
            self.ready.notify()

    def full(self) -> bool:
        return len(self.jobs) >= self.max_queued

    def stop(self) -> None:
        with self.ready:
            self.jobs.append(None)
            self.ready.notify()
        self.thread.join(timeout=30)  # at once where the worker was lost (the thread has ended)

    def _next(self) -> list[Job] | None:
        """The next job, with the jobs right behind it that batch with it."""
        with self.ready:
            while not self.jobs:
                self.ready.wait()
            first = self.jobs.popleft()
            if first is None:
                return None
            batch, size = [first], first.size
            while (
                first.batch_key is not None
                and self.jobs
                and self.jobs[0] is not None
                and self.jobs[0].batch_key == first.batch_key
                and size + self.jobs[0].size <= self.max_batch
            ):
                batch.append(self.jobs.popleft())
                size += batch[-1].size
            return batch

    def _run(self) -> None:
        while (batch := self._next()) is not None:
            try:
                if batch[0].run_many is not None:
                    outcomes = [Outcome(payload=p) for p in batch[0].run_many(batch)]
                else:
                    outcomes = [Outcome(payload=batch[0].run())]
            except WorkerLost as error:
                self._lose(batch, error)
                return
            except Exception as error:  # one request's failure is its own: answered, and the service goes on
                outcomes = [_failure(error)] * len(batch)
            self._answer(batch, outcomes)

    def _answer(self, jobs: list[Job | None], outcomes: list[Outcome]) -> None:
        for job, outcome in zip(jobs, outcomes):
            if job is not None and job.request_id is not None:
                self.loop.call_soon_threadsafe(self.finish, job.request_id, outcome)

    def _lose(self, batch: list[Job], error: WorkerLost) -> None:
        self.lost = (
            f"the service's worker is gone ({error.reason}); the service stops: start it again "
            "(saved weights and states survive)"
        )
        log.error("%s", self.lost)
        with self.ready:
            waiting = [*batch, *self.jobs]
            self.jobs.clear()
        self._answer(waiting, [Outcome(error=self.lost, category=SERVER)] * len(waiting))
        if self.on_lost is not None:
            self.loop.call_soon_threadsafe(self.on_lost, self.lost)


def _failure(error: Exception) -> Outcome:
    cause = getattr(error, "cause", None) or error  # a Ray task error carries the worker's exception
    if isinstance(cause, (ValueError, KeyError, FileNotFoundError, PathError)):
        return Outcome(error=str(cause), category=USER)
    log.exception("a request failed in the worker", exc_info=error)
    return Outcome(error=f"the service failed on this request: {type(cause).__name__}: {cause}", category=SERVER)
