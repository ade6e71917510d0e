"""What the agent endpoint's tests share: a request engine that answers with scripted turns, the rollout over it,
rows to run agents on, and the endpoint served alone (`LiveEndpoint`) for tests that are the client themselves."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np

from hybridflow.batch_keys import DATA_SOURCE, EXTRA_INFO, INDEX, RAW_PROMPT, REWARD_MODEL
from hybridflow.protocol import DataProto
from hybridflow.rollout.agent.chat import ChatFormat
from hybridflow.rollout.agent.parsers import TOOL_CALL_FORMATS
from hybridflow.rollout.agent_server.config import AgentServerConfig
from hybridflow.rollout.agent_server.listener import AgentServer
from hybridflow.rollout.agent_server.rendering import MessageRenderer
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.rollout.agent_server.server import build_app
from hybridflow.rollout.agent_server.sessions import Session, SessionTable
from hybridflow.rollout.agent_server.turns import TurnRunner
from hybridflow.rollout.base import Rollout, SamplingParams
from hybridflow.rollout.requests import RequestEngine, RequestStats, TurnOutput
from hybridflow.trainer.setup.config import default_config

AGENTS = Path(__file__).parent / "user_agents.py"
EOS = "<|im_end|>"


def agent_config(function: str, **changes) -> AgentServerConfig:
    """The YAML's rollout.agent settings with ``function`` (a name in user_agents.py) and ``changes``."""
    defaults = default_config().actor_rollout_ref.rollout.agent
    return dataclasses.replace(defaults, function=f"{AGENTS}:{function}" if function else "", **changes)


class ScriptedEngine(RequestEngine):
    """Each turn of a session answers with the next text of ``scripts[session index]`` (a text ending in EOS
    stopped). Engine request r belongs to session r // branches. Log-probs are -(k + 1) / 100 for the request's
    k-th generated token. Records each call's (request, new tokens)."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]], branches: int):
        self.tokenizer = tokenizer
        self.scripts = {i: list(turns) for i, turns in scripts.items()}
        self.branches = branches
        self.calls: list[tuple[int, list[int]]] = []
        self.contexts: dict[int, list[int]] = {}
        self.released: set[int] = set()
        self.generated: dict[int, int] = {}

    @property
    def stats(self) -> RequestStats:
        return RequestStats()

    @asynccontextmanager
    async def serving(self, params: SamplingParams, *, max_len: int, max_requests: int):
        yield

    async def generate(self, request: int, new_tokens: list[int], max_new_tokens: int) -> TurnOutput:
        await asyncio.sleep(0)
        self.calls.append((request, list(new_tokens)))
        turns = self.scripts[request // self.branches]
        text = turns.pop(0) if turns else f"nothing more{EOS}"
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens]
        start = self.generated.get(request, 0)
        self.generated[request] = start + len(tokens)
        self.contexts[request] = self.contexts.get(request, []) + list(new_tokens) + tokens
        stopped = bool(tokens) and tokens[-1] == self.tokenizer.convert_tokens_to_ids(EOS)
        return TurnOutput(tokens, [-(start + i + 1) / 100 for i in range(len(tokens))], stopped)

    def release(self, request: int) -> None:
        self.released.add(request)


class ScriptedBackend(Rollout):
    def __init__(self, tokenizer, scripts, branches: int):
        self.engine = ScriptedEngine(tokenizer, scripts, branches)
        self.eos_token_ids = [tokenizer.convert_tokens_to_ids(EOS)]
        self.pad_token_id = tokenizer.pad_token_id

    def request_engine(self):
        return self.engine

    def generate_sequences(self, prompts, params):
        raise AssertionError("the endpoint must use the request engine")

    def load_weights(self, named_tensors):
        pass

    def release_cache(self):
        pass


def scripted_rollout(tokenizer, function: str, scripts: dict[int, list[str]], **changes) -> AgentFunctionRollout:
    config = agent_config(function, **changes)
    backend = ScriptedBackend(tokenizer, scripts, config.max_branches_per_session)
    return AgentFunctionRollout(backend, tokenizer, config, tool_role="tool", format="hermes")


def rows(questions: list[str], answers: list[str] | None = None, extra: list[dict] | None = None) -> DataProto:
    """Rows as the dataset gives them to generation: the chat prompt, data source, ground truth, extra_info."""
    n = len(questions)
    answers = answers or [""] * n
    extra = extra or [{} for _ in range(n)]

    def column(values) -> np.ndarray:
        array = np.empty(n, dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        return array

    return DataProto.from_dict(
        non_tensors={
            RAW_PROMPT: column([[{"role": "user", "content": q}] for q in questions]),
            DATA_SOURCE: column(["test"] * n),
            REWARD_MODEL: column([{"ground_truth": a, "style": "rule"} for a in answers]),
            EXTRA_INFO: column(extra),
            INDEX: column(range(n)),
        }
    )


def params(max_new_tokens: int = 256) -> SamplingParams:
    return SamplingParams(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=0)


class LiveEndpoint:
    """The endpoint served by a thread of its own over a scripted engine, for tests that talk to it directly (the
    openai SDK, httpx, schemathesis) with keys of sessions they open. ``response_length``: each branch's budget."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]], *, response_length: int = 64, **changes):
        self.config = agent_config("", **changes)
        self.backend = ScriptedBackend(tokenizer, scripts, self.config.max_branches_per_session)
        self.run_key = "hf-run-test-key"
        self.table = SessionTable(self.config, self.run_key)
        renderer = MessageRenderer(ChatFormat(tokenizer, self.backend.eos_token_ids, "tool"))
        runner = TurnRunner(
            self.backend.engine,
            renderer,
            TOOL_CALL_FORMATS["hermes"],
            response_length=response_length,
            max_prompt_tokens=self.config.max_prompt_tokens,
        )
        self.app = build_app(
            self.config,
            self.table,
            runner,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_model_len=self.config.max_prompt_tokens + response_length,
            vocab_size=len(tokenizer),
        )
        self.server = AgentServer(self.config, self.app)
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.server.running():
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> LiveEndpoint:
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("the endpoint did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self.loop.close()

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def open_session(self, *, external: bool = False) -> Session:
        """A new session (its own scripted turns: ``scripts[index]``, none: "nothing more")."""

        async def open_one() -> Session:
            index = self.table.opened
            self.backend.engine.scripts.setdefault(index, [])
            return self.table.open(index, {"index": index}, external=external)

        return asyncio.run_coroutine_threadsafe(open_one(), self.loop).result(timeout=30)

    def session_url(self, session: Session) -> str:
        return f"{self.base_url}/sessions/{session.id}/v1"
