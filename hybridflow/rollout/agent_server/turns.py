"""One request's turn: route it to a branch, render what the engine has not seen (a chat request) or take the ids
as sent (a token request), generate, parse tool calls, record the tokens. Nothing is recorded for a request that
fails before its turn is generated."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any

from hybridflow.rollout.agent.parsers import MalformedCall, ToolCallParser
from hybridflow.rollout.agent_server.errors import bad_request
from hybridflow.rollout.agent_server.generate_api import TokenReply, TokenRequest
from hybridflow.rollout.agent_server.openai_api import Reply, TurnRequest, normalise_messages
from hybridflow.rollout.agent_server.rendering import MessageRenderer
from hybridflow.rollout.agent_server.sessions import Branch, Session
from hybridflow.rollout.requests import RequestEngine, TurnOutput

_CALL_MARKUP = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class ArrivalGate:
    """Holds the first turns of a call's sessions until every session's has arrived, or none has for ``window_s``,
    then lets them all go at once: the engine prefills them together, as it does the in-process loops' first turns,
    instead of one by one as the agents' requests trickle in."""

    def __init__(self, expected: int, window_s: float):
        self.expected = expected
        self.window_s = window_s
        self.arrived = 0
        self.released = asyncio.Event()
        self.last_arrival = time.monotonic()

    def leave(self) -> None:
        """A session ended without a first turn (its agent failed): wait for one fewer."""
        self.expected -= 1
        if self.arrived >= self.expected:
            self.released.set()

    async def arrive(self) -> None:
        if self.released.is_set():
            return
        self.arrived += 1
        self.last_arrival = time.monotonic()
        if self.arrived >= self.expected:
            self.released.set()
        while not self.released.is_set():
            try:
                await asyncio.wait_for(self.released.wait(), timeout=self.window_s)
            except TimeoutError:
                if time.monotonic() - self.last_arrival >= self.window_s:
                    self.released.set()


class TurnRunner:
    """Turns of every session of one generation call over ``engine``. response_length: each branch's budget of
    response tokens (generated and inserted together, as for the in-process agent loops)."""

    def __init__(
        self,
        engine: RequestEngine,
        renderer: MessageRenderer,
        parse: ToolCallParser,
        *,
        response_length: int,
        max_prompt_tokens: int,
        gate: ArrivalGate | None = None,
    ):
        self.engine = engine
        self.renderer = renderer
        self.tokenizer = renderer.chat.tokenizer
        self.end_token = renderer.chat.prefix[-1]  # the token that ends an assistant turn in the template
        self.parse = parse
        self.response_length = response_length
        self.max_prompt_tokens = max_prompt_tokens
        self.gate = gate

    async def run(self, session: Session, request: TurnRequest) -> Reply:
        """A chat turn (/chat/completions, /responses): its messages routed to a branch, the new ones rendered."""
        started = time.perf_counter()
        branch, tail = session.route(request.messages, request.tools)
        if branch is None:
            branch = self._new_branch(self.renderer.conversation_ids(request.messages, request.tools), request.tools)
            inserted: list[int] = []
        else:
            inserted = ([self.end_token] if branch.open_turn else []) + self.renderer.tail_ids(tail)
        turn, prompt_tokens, cached = await self._generate(session, branch, inserted, request.max_tokens, started)
        started = time.perf_counter()
        tokens, log_probs, stopped = turn.tokens, turn.log_probs, turn.stopped
        body = tokens[:-1] if stopped else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        finish = "stop" if stopped else "length"
        cut = _stop_cut(self.tokenizer, body, request.stop)
        if cut is not None:
            kept, text = cut
            branch.stale = kept < len(tokens)  # the engine went on past the stop string
            tokens, log_probs, stopped, finish = tokens[:kept], log_probs[:kept], False, "stop"
        branch.add_inserted(inserted)
        branch.add_generated(tokens, log_probs)
        branch.open_turn = not stopped
        content, calls = text, []
        if request.parse_tools and stopped:
            content, calls = self._tool_calls(session, text)
        reply = Reply(
            content=content,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else finish,
            tokens=[self.tokenizer.decode([t]) for t in tokens],
            log_probs=list(log_probs),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            completion_tokens=len(tokens),
        )
        branch.finish_reason = reply.finish_reason
        branch.messages = [*request.messages, *normalise_messages([reply.message()])]
        session.last = branch
        session.counts.requests += 1
        session.counts.tool_calls += len(calls)
        session.counts.server_seconds += time.perf_counter() - started
        return reply

    async def run_tokens(self, session: Session, request: TokenRequest) -> TokenReply:
        """A token-level turn (/inference/v1/generate): the request's ids extend a token branch exactly, or start
        one; the ids it adds after the branch's context are recorded as inserted (mask 0), verbatim."""
        started = time.perf_counter()
        branch, inserted = session.route_tokens(request.token_ids)
        if branch is None:
            branch = self._new_branch(list(request.token_ids), [], by_tokens=True)
            inserted = []
        turn, prompt_tokens, cached = await self._generate(session, branch, inserted, request.max_tokens, started)
        started = time.perf_counter()
        tokens, log_probs, stopped = turn.tokens, turn.log_probs, turn.stopped
        stops = set(request.stop_token_ids)
        first_stop = next((i for i, token in enumerate(tokens) if token in stops), None)
        if first_stop is not None and first_stop < len(tokens) - 1:  # a stop id of the client's, not the model's
            kept = first_stop + 1
            branch.stale = True  # the engine went on past it
            tokens, log_probs, stopped = tokens[:kept], log_probs[:kept], True
        elif first_stop is not None:
            stopped = True
        branch.add_inserted(inserted)
        branch.add_generated(tokens, log_probs)
        branch.open_turn = not stopped
        branch.finish_reason = "stop" if stopped else "length"
        session.last = branch
        session.counts.requests += 1
        session.counts.server_seconds += time.perf_counter() - started
        return TokenReply(
            token_ids=list(tokens),
            log_probs=list(log_probs),
            finish_reason=branch.finish_reason,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
        )

    def _new_branch(self, prompt: list[int], tools: list[dict[str, Any]], *, by_tokens: bool = False) -> Branch:
        if len(prompt) > self.max_prompt_tokens:
            raise bad_request(
                f"the conversation is {len(prompt)} tokens; at most {self.max_prompt_tokens} "
                "(rollout.agent.max_prompt_tokens) may start a trajectory",
                param="token_ids" if by_tokens else "messages",
                code="context_length_exceeded",
            )
        return Branch(prompt=prompt, tools=tools, messages=[], engine_request=-1, by_tokens=by_tokens)

    async def _generate(
        self, session: Session, branch: Branch, inserted: list[int], max_tokens: int | None, started: float
    ) -> tuple[TurnOutput, int, int]:
        """Generate one turn on ``branch`` after ``inserted`` (a new branch: engine_request -1): the engine's output,
        the context's length before the turn and how much of it was already computed. Checks the branch's response
        budget first; the branch joins the session only once its first turn is generated."""
        new_branch = branch.engine_request < 0
        budget = self.response_length - len(branch.tokens) - len(inserted)
        param = "token_ids" if branch.by_tokens else "messages"
        if budget < 1:
            raise bad_request(
                f"the trajectory's {self.response_length} response tokens (rollout.response_length) are spent: "
                f"{len(branch.tokens)} held, {len(inserted)} more for the new input",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > budget:
            raise bad_request(
                f"max_tokens={max_tokens} is more than the {budget} tokens left in this trajectory's budget",
                param="sampling_params.max_tokens" if branch.by_tokens else "max_tokens",
                code="max_tokens_exceeded",
            )
        if new_branch or branch.stale:  # a fresh engine request: the whole context
            engine_request = session.next_engine_request()
            new_tokens, cached = branch.context + inserted, 0
            for other in session.branches:  # a session holds one engine request (its cache) at a time
                if other is not branch and not other.stale:
                    self.engine.release(other.engine_request)
                    other.stale = True
        else:
            engine_request = branch.engine_request
            new_tokens, cached = inserted, len(branch.context)
        prompt_tokens = len(branch.context) + len(inserted)
        session.counts.server_seconds += time.perf_counter() - started
        if self.gate is not None and session.counts.requests == 0:
            await self.gate.arrive()
        try:
            turn = await self.engine.generate(engine_request, new_tokens, max_tokens or budget)
        except Exception:
            branch.stale = not new_branch  # the engine may hold tokens that were not recorded
            raise
        if new_branch:
            session.branches.append(branch)
        branch.engine_request, branch.stale, branch.routes = engine_request, False, turn.routes
        return turn, prompt_tokens, cached

    def _tool_calls(self, session: Session, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a turn's text; text that does not parse is returned as it is, and counted."""
        parsed = self.parse(text)
        if not parsed:
            return text, []
        if any(isinstance(call, MalformedCall) for call in parsed):
            session.counts.parse_failures += 1
            return text, []
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": _json(call.arguments)},
            }
            for call in parsed
        ]
        content = _CALL_MARKUP.sub("", text).strip()
        return content or None, calls


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _stop_cut(tokenizer: Any, tokens: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens kept, text before the stop string) at the first token whose text completes one of ``stops``."""
    if not stops:
        return None
    for kept in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:kept], skip_special_tokens=True)
        found = [text.index(stop) for stop in stops if stop in text]
        if found:
            return kept, text[: min(found)]
    return None
