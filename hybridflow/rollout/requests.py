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

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from hybridflow.rollout.base import SamplingParams


@dataclass
class TurnOutput:
    """The tokens one ``generate`` call produced."""

    tokens: list[int]  # generated token ids (the stop token included when there is one)
    log_probs: list[float]  # the sampler's log-prob of each (rollout/base.py explains which distribution)
    stopped: bool  # ended on a stop token (False: it ran out of max_new_tokens)


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


class RequestEngine(ABC):
    """Generation for requests that continue over several turns from what is already computed."""

    @abstractmethod
    def serving(self, params: SamplingParams, *, max_len: int, max_requests: int) -> AbstractAsyncContextManager[None]:
        """Run the engine in the current event loop for the duration of the ``async with`` block.

        params: the sampling of every request (``params.max_new_tokens`` is ignored: each turn gives its
        own); max_len: the longest context + response any request reaches; max_requests: how many
        requests the block will make (the engine may size its cache by it)."""

    @abstractmethod
    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        """Append ``new_tokens`` to request ``request``'s context and generate one turn.

        request: a number in [0, max_requests), the same for every turn of one conversation; it
        names the request's sampling stream. The first call's tokens are the whole prompt."""

    @abstractmethod
    def release(self, request: int) -> None:
        """The request is over: free what it holds (its cached context)."""

    @property
    @abstractmethod
    def stats(self) -> RequestStats:
        """Counters of the current (or last) serving session."""
