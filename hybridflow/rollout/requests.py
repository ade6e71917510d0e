"""The asynchronous request API that multi-turn rollout (rollout/agent) drives a generation engine through.

A request is one conversation. Each ``generate`` call is one assistant turn: it appends tokens to
the request's context (its prompt on the first call; later the tool output and template tokens the
agent loop inserted) and decodes until a stop token or ``max_new_tokens``. The engine keeps what it
has computed of the context between calls, so a turn computes only the tokens appended since the
last one. Many requests run at once in one asyncio event loop: while one awaits its tools, the
others keep decoding.

    async with engine.serving(params, max_len=..., max_requests=n):
        turn = await engine.generate(request, prompt_ids, max_new_tokens=64)
        turn = await engine.generate(request, tool_ids, max_new_tokens=64 - ...)
        engine.release(request)   # its cache is free for a waiting request

Sampling is counter-based per request (rollout/native/sampler.py): request r's k-th generated token,
counted over all its turns, draws from a stream of (seed, r, k), so the samples do not depend on
which other requests shared a decode step, or when their tools returned.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import torch

from hybridflow.rollout.sampling import SamplingParams


@dataclass
class TurnOutput:
    """The tokens one ``generate`` call produced."""

    tokens: list[int]  # generated token ids (the stop token included when there is one)
    log_probs: list[float]  # the sampler's log-prob of each (rollout/base.py explains which distribution)
    stopped: bool  # ended on a stop token (False: it ran out of max_new_tokens)
    # with SamplingParams.record_routes (a mixture of experts): the experts each computed position of the request's
    # context chose, (positions, layers, k), positions 0.. of its prompt, earlier turns and this turn; the turn's last
    # token is not computed yet (the next turn computes it), so it has none (routing replay, models/routing.py)
    routes: torch.Tensor | None = None


@dataclass
class RequestStats:
    """What one serving session computed (for tests and benchmarks)."""

    prefill_calls: int = 0  # forwards over appended tokens (first turns and later turns)
    prefill_tokens: int = 0  # tokens those forwards computed
    decode_steps: int = 0  # decode forwards
    decode_tokens: int = 0  # sequences summed over decode steps
    turns: int = 0  # generate calls answered
    slot_moves: int = 0  # sequences whose cache was moved to another slot (native engine)
    shared_prefix_tokens: int = 0  # prompt tokens computed once for several requests
    # where a serving session's time went (stepped engines): before its first engine step (the first turns arriving),
    # in engine steps, between steps (the event loop's other work: tools, an endpoint's requests; or no turn to step),
    # and after its last step until the block ended
    seconds_to_first_step: float = 0.0
    step_seconds: float = 0.0
    between_steps_seconds: float = 0.0
    after_last_step_seconds: float = 0.0


class RequestEngine(ABC):
    """Generation for requests that continue over several turns from what is already computed."""

    @abstractmethod
    def serving(self, params: SamplingParams, *, max_len: int, max_requests: int) -> AbstractAsyncContextManager[None]:
        """Run the engine in the current event loop for the duration of the ``async with`` block.

        params: the sampling of every request (``params.max_new_tokens`` is ignored: each turn gives its
        own); max_len: the longest context + response any request reaches; max_requests: how many
        requests the block will run at once, unreleased (the engine may size its cache by it)."""

    @abstractmethod
    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        """Append ``new_tokens`` to request ``request``'s context and generate one turn.

        request: a number, the same for every turn of one conversation and distinct from every other
        conversation's in the session; it names the request's sampling stream. The first call's tokens are
        the whole prompt."""

    @abstractmethod
    def release(self, request: int) -> None:
        """The request is over: free what it holds (its cached context)."""

    @property
    @abstractmethod
    def stats(self) -> RequestStats:
        """Counters of the current (or last) serving session."""

    def route_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of the routes its turns return when serving with
        ``params.record_routes``; None: this engine records no routes (and refuses such a session)."""
        return None


class SteppedRequestEngine(RequestEngine):
    """A request engine over a synchronous one: a server task runs one engine step at a time while any turn is
    in progress, and yields to the event loop between steps (so tools run and new turns arrive while the others
    decode). Subclasses say how to open a session, whether there is work, how to step, and which futures wait."""

    # event-loop passes between two steps: 1 lets the agent loops' coroutines run; a server in the same loop (the
    # agent endpoint) needs a few, since a request takes several passes (read, parse, reply) to reach the engine
    io_passes = 1

    def __init__(self) -> None:
        self._stats = RequestStats()
        self._serving = False

    @property
    def stats(self) -> RequestStats:
        return self._stats

    @asynccontextmanager
    async def serving(self, params: SamplingParams, *, max_len: int, max_requests: int) -> AsyncIterator[None]:
        if self._serving:
            raise RuntimeError("the engine is already serving")
        if params.record_routes and self.route_shape() is None:
            raise ValueError(
                f"record_routes: {type(self).__name__} records no routes (a model without mixture-of-experts layers, "
                "or an engine that cannot say which experts each token chose)"
            )
        self.params, self.max_len = params, max_len
        self._open(max_requests)
        self._stats, self._serving, self._closing = RequestStats(), True, False
        self._opened, self._last_step_end = time.perf_counter(), None
        self._wake = asyncio.Event()
        server = asyncio.create_task(self._serve())
        try:
            yield
        finally:
            self._closing = True
            self._wake.set()
            try:
                await server
            finally:
                self._serving = False
                self._close()
                if self._last_step_end is None:
                    self._stats.seconds_to_first_step = time.perf_counter() - self._opened
                else:
                    self._stats.after_last_step_seconds = time.perf_counter() - self._last_step_end

    def require_serving(self) -> None:
        if not self._serving:
            raise RuntimeError("generate needs an `async with engine.serving(...)` block")

    def check_turn(self, request: int, context_tokens: int, max_new_tokens: int) -> None:
        """A turn can start: it generates something, and it fits in ``max_len``."""
        if max_new_tokens < 1 or not context_tokens:
            raise ValueError(f"request {request}: a turn needs new tokens and max_new_tokens >= 1")
        if context_tokens + max_new_tokens > self.max_len:
            raise ValueError(
                f"request {request}: {context_tokens} context tokens + {max_new_tokens} new exceed the "
                f"{self.max_len} positions the session was started with"
            )

    def wake(self) -> None:
        """Work may have arrived (a new turn, a freed slot): the server looks again."""
        self._wake.set()

    async def _serve(self) -> None:
        try:
            while True:
                if self._has_work():
                    self._timed_step()
                    for _ in range(self.io_passes):
                        await asyncio.sleep(0)  # let the agent loops run (tools, new turns)
                elif self._closing:
                    return
                else:
                    self._wake.clear()
                    await self._wake.wait()
        except BaseException as error:  # noqa: BLE001  (every waiting turn must hear of it, not hang)
            for future in self._unanswered():
                if not future.done():
                    future.set_exception(RuntimeError(f"the generation engine failed: {error!r}"))
            raise

    def _timed_step(self) -> None:
        started, stats = time.perf_counter(), self._stats
        if self._last_step_end is None:
            stats.seconds_to_first_step = started - self._opened
        else:
            stats.between_steps_seconds += started - self._last_step_end
        self._step()
        self._last_step_end = time.perf_counter()
        stats.step_seconds += self._last_step_end - started

    @abstractmethod
    def _open(self, max_requests: int) -> None:
        """Prepare a session for up to ``max_requests`` requests (``self.params``, ``self.max_len`` are set)."""

    def _close(self) -> None:
        """The session ended (after its last step): undo what ``_open`` set up beyond the requests."""

    @abstractmethod
    def _has_work(self) -> bool:
        """Whether a step would make progress now."""

    @abstractmethod
    def _step(self) -> None:
        """One engine step; turns that end resolve their futures."""

    @abstractmethod
    def _unanswered(self) -> list[asyncio.Future]:
        """The futures of the turns in progress (they fail if the engine does)."""
