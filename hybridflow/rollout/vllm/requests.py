"""vLLM behind the asynchronous request API (rollout/requests.py), for multi-turn agent loops.

The engine stays the in-process one of `VllmRollout` (its weights are the trainer's, reloaded in place),
driven step by step from the agent loops' event loop: ``generate`` adds a vLLM request whose prompt is
the conversation so far, and a server task runs ``LLMEngine.step()`` while any request is unfinished,
yielding to the loops between steps so tools run while the others decode. Each turn's prompt begins
with the previous turn's whole context, so vLLM's automatic prefix caching finds it cached and
computes only the tokens past the last full cached block (the appended ones, and at most a block
before them); `RequestStats.prefill_tokens` counts what was computed (vLLM's ``num_cached_tokens``).
vLLM's asynchronous front end (AsyncLLM) is not used: it runs the engine in another process, where the
trainer's in-place weight reload does not reach.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.requests import RequestEngine, RequestStats, TurnOutput

if TYPE_CHECKING:
    from hybridflow.rollout.vllm.rollout import VllmRollout


class VllmRequestEngine(RequestEngine):
    def __init__(self, rollout: VllmRollout):
        self.rollout = rollout
        self.engine = rollout.llm.llm_engine
        self._stats = RequestStats()
        self._serving = False

    @property
    def stats(self) -> RequestStats:
        return self._stats

    @asynccontextmanager
    async def serving(self, params: SamplingParams, *, max_len: int, max_requests: int) -> AsyncIterator[None]:
        if self._serving:
            raise RuntimeError("the engine is already serving")
        self.params, self.max_len = params, max_len
        self.contexts: dict[int, list[int]] = {}  # request -> its conversation so far (token ids)
        self.turns: dict[int, int] = {}  # request -> turns started (names vLLM's request ids and seeds)
        self.pending: dict[str, tuple[int, asyncio.Future]] = {}  # vLLM request id -> (request, its future)
        self._stats, self._serving, self._closing = RequestStats(), True, False
        self._wake = asyncio.Event()
        self.rollout.cache.restore()
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

    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        from vllm.inputs import TokensPrompt

        if not self._serving:
            raise RuntimeError("generate needs an `async with engine.serving(...)` block")
        context = self.contexts.setdefault(request, [])
        context += new_tokens
        if max_new_tokens < 1 or not context:
            raise ValueError(f"request {request}: a turn needs new tokens and max_new_tokens >= 1")
        if len(context) + max_new_tokens > self.max_len:
            raise ValueError(
                f"request {request}: {len(context)} context tokens + {max_new_tokens} new exceed the "
                f"{self.max_len} positions the session was started with"
            )
        turn = self.turns.get(request, 0)
        self.turns[request] = turn + 1
        vllm_id = f"{request}/{turn}"
        # turn t of request r samples as request r * 1024 + t of a one-turn call: distinct streams, reproducible
        sampling = self.rollout.sampling_params(self.params, request * 1024 + turn, max_new_tokens, final_only=True)
        self.engine.add_request(vllm_id, TokensPrompt(prompt_token_ids=list(context)), sampling)
        future = asyncio.get_running_loop().create_future()
        self.pending[vllm_id] = (request, future)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            if vllm_id in self.pending:
                self.pending.pop(vllm_id)
                self.engine.abort_request([vllm_id])
            raise

    def release(self, request: int) -> None:
        self.contexts.pop(request, None)
        self.turns.pop(request, None)

    async def _serve(self) -> None:
        try:
            while True:
                if self.pending:
                    self._step()
                    await asyncio.sleep(0)  # let the agent loops run (tools, new turns)
                elif self._closing:
                    return
                else:
                    self._wake.clear()
                    await self._wake.wait()
        except BaseException as error:  # noqa: BLE001  (every waiting turn must hear of it, not hang)
            for _, future in self.pending.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"the vLLM engine failed: {error!r}"))
            raise

    def _step(self) -> None:
        for output in self.engine.step():
            if not output.finished or output.request_id not in self.pending:
                continue
            request, future = self.pending.pop(output.request_id)
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            log_probs = [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
            self.contexts[request] += tokens
            prompt_length = len(output.prompt_token_ids)
            self._stats.prefill_calls += 1
            self._stats.prefill_tokens += prompt_length - (output.num_cached_tokens or 0)
            self._stats.decode_tokens += len(tokens)
            self._stats.turns += 1
            stopped = bool(tokens) and tokens[-1] in self.rollout.stop_token_ids
            if not future.done():
                future.set_result(TurnOutput(tokens, log_probs, stopped))
