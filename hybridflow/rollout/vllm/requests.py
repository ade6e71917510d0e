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

from hybridflow.rollout.requests import SteppedRequestEngine, TurnOutput
from hybridflow.rollout.vllm.kv_cache import CacheMemory
from hybridflow.rollout.vllm.sampling import vllm_sampling


class VllmRequestEngine(SteppedRequestEngine):
    """engine: the `VllmRollout`'s LLMEngine; cache: its KV-cache memory (restored when a session opens);
    stop_token_ids: the tokens that end a turn."""

    def __init__(self, engine, cache: CacheMemory, stop_token_ids: list[int]):
        super().__init__()
        self.engine = engine
        self.cache = cache
        self.stop_token_ids = list(stop_token_ids)

    def _open(self, max_requests: int) -> None:
        self.contexts: dict[int, list[int]] = {}  # request -> its conversation so far (token ids)
        self.turns: dict[int, int] = {}  # request -> turns started (names vLLM's request ids and seeds)
        self.pending: dict[str, tuple[int, asyncio.Future]] = {}  # vLLM request id -> (request, its future)
        self.cache.restore()

    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        from vllm.inputs import TokensPrompt

        self.require_serving()
        context = self.contexts.setdefault(request, [])
        self.check_turn(request, len(context) + len(new_tokens), max_new_tokens)
        context += new_tokens
        turn = self.turns.get(request, 0)
        self.turns[request] = turn + 1
        vllm_id = f"{request}/{turn}"
        # turn t of request r samples as request r * 1024 + t of a one-turn call: distinct streams, reproducible
        sampling = vllm_sampling(self.params, request * 1024 + turn, max_new_tokens, self.stop_token_ids, True)
        self.engine.add_request(vllm_id, TokensPrompt(prompt_token_ids=list(context)), sampling)
        future = asyncio.get_running_loop().create_future()
        self.pending[vllm_id] = (request, future)
        self.wake()
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

    def _has_work(self) -> bool:
        return bool(self.pending)

    def _unanswered(self) -> list[asyncio.Future]:
        return [future for _, future in self.pending.values()]

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
            stopped = bool(tokens) and tokens[-1] in self.stop_token_ids
            if not future.done():
                future.set_result(TurnOutput(tokens, log_probs, stopped))
