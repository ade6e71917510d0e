"""`AgentFunctionRollout`: each sample's agent is the user's own code, run against the endpoint.

For every row of a generation call a session is opened and ``rollout.agent.function`` is called with the session's
``base_url`` and ``api_key`` and the row (its chat prompt, data source, ground truth, extra_info, index); all of a
call's agents run at once (a plain function in its own thread, a coroutine function in the event loop), their
requests decoded together by the engine. What an agent returns is the sample's reward: a number, or a dict with
"reward" and more numbers (reported as ``agent/<name>``). The sample is the session's latest branch; its other
branches come with it in ``agent_branch_rows`` and are trained too (branch_rows.py). An agent that raises, times out
or makes no request leaves the update, with the reason in ``agent_failure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import numbers
import os
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.batch_keys import (
    AGENT_BRANCH_ROWS,
    AGENT_BRANCHES,
    AGENT_GENERATED_TOKENS,
    AGENT_METRICS,
    AGENT_PARSE_FAILURES,
    AGENT_REQUESTS,
    AGENT_REWARD,
    AGENT_SERVER_SECONDS,
    DATA_SOURCE,
    EXTRA_INFO,
    INDEX,
    RAW_PROMPT,
    REWARD_MODEL,
)
from hybridflow.protocol import DataProto
from hybridflow.rollout.agent.chat import ChatFormat
from hybridflow.rollout.agent.parsers import TOOL_CALL_FORMATS
from hybridflow.rollout.agent.rollout import assemble_trajectories
from hybridflow.rollout.agent.state import Trajectory
from hybridflow.rollout.agent_server.branch_rows import branch_trajectory, left_padded, other_branch_rows
from hybridflow.rollout.agent_server.config import AgentServerConfig
from hybridflow.rollout.agent_server.environment_runner import EnvironmentRunner
from hybridflow.rollout.agent_server.listener import AgentServer
from hybridflow.rollout.agent_server.rendering import MessageRenderer
from hybridflow.rollout.agent_server.server import build_app
from hybridflow.rollout.agent_server.sessions import Session, SessionTable, agents_of
from hybridflow.rollout.agent_server.turns import ArrivalGate, TurnRunner
from hybridflow.rollout.base import BackendWrapper, Rollout, SamplingParams
from hybridflow.user_code import load_object

logger = logging.getLogger(__name__)

IO_PASSES = 8  # event-loop passes between two engine steps while the endpoint serves (bench/agent_server.py)
ROW_COLUMNS = (RAW_PROMPT, DATA_SOURCE, REWARD_MODEL, EXTRA_INFO, INDEX)  # what an agent is given of its row


class AgentFailure(RuntimeError):
    pass


def agent_result(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from what an agent function returned."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise AgentFailure(f"the agent returned a dict without 'reward': keys {sorted(value)}")
        metrics = {str(k): float(v) for k, v in value.items() if k != "reward" and isinstance(v, numbers.Real)}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise AgentFailure(f"the agent returned {value!r}, not a finite number (or a dict with 'reward')")
    return float(value), metrics


def load_agent_function(spec: str) -> Any:
    function = load_object(spec, "actor_rollout_ref.rollout.agent.function")
    if not callable(function):
        raise TypeError(f"rollout.agent.function {spec!r} names {function!r}, which is not callable")
    return function


class AgentFunctionRollout(BackendWrapper):
    """Generation by the user's agents through the endpoint, over ``backend``'s request engine."""

    def __init__(self, backend: Rollout, tokenizer: Any, config: AgentServerConfig, *, tool_role: str, format: str):
        super().__init__(backend)
        self.tokenizer = tokenizer
        self.config = config
        self.function = load_agent_function(config.function) if config.function else None  # None: external agents
        self.run_key = f"hf-run-{secrets.token_urlsafe(24)}"  # the run's secret (external agents claim with it)
        self.renderer = MessageRenderer(ChatFormat(tokenizer, backend.eos_token_ids, tool_role))
        self.parse = TOOL_CALL_FORMATS[format]
        self._logged: set[str] = set()
        self.environment = (  # a verifiers environment's runner: its episodes are the agents
            EnvironmentRunner(config.verifiers, tokenizer, model=config.model_name, run_key=self.run_key)
            if config.verifiers.env
            else None
        )

    def generate_sequences(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """prompts: the row columns of ``ROW_COLUMNS`` (the tensors are not read: the agent renders its own
        conversation). params.max_new_tokens: each trajectory's response budget."""
        n = len(prompts)
        rows = [
            {key: _plain(prompts.non_tensor_batch[key][i]) for key in ROW_COLUMNS if key in prompts.non_tensor_batch}
            for i in range(n)
        ]
        route_shape = self.engine.route_shape() if params.record_routes else None
        sessions, outcomes = asyncio.run(self._run_all(rows, params))
        trajectories = [self._trajectory(i, s, o) for i, (s, o) in enumerate(zip(sessions, outcomes))]
        # every rank's prompts to the same width (max_prompt_tokens), so that the generation groups' batches join
        width, pad = self.config.max_prompt_tokens, self.pad_token_id
        prompt_ids, prompt_mask = left_padded([t.prompt for t in trajectories], pad, width)
        tensors, non_tensors = assemble_trajectories(
            prompt_ids, prompt_mask, trajectories, params.max_new_tokens, pad, route_shape
        )
        tensors |= _session_counts(sessions)
        non_tensors[AGENT_REWARD] = _objects([o[0] for o in outcomes])
        non_tensors[AGENT_METRICS] = _objects([o[1] for o in outcomes])
        non_tensors[AGENT_BRANCH_ROWS] = _objects(  # a failed session's branches leave the update with it
            [
                None
                if outcome[2]
                else other_branch_rows(
                    s,
                    prompt_width=width,
                    response_length=params.max_new_tokens,
                    pad_token_id=pad,
                    route_shape=route_shape,
                )
                for s, outcome in zip(sessions, outcomes)
            ]
        )
        return DataProto.from_dict(tensors, non_tensors, meta_info=dict(prompts.meta_info))

    async def _run_all(self, rows: list[dict], params: SamplingParams) -> tuple[list[Session], list[tuple]]:
        config = self.config
        max_len = config.max_prompt_tokens + params.max_new_tokens
        table = SessionTable(config, self.run_key)
        self.gate = ArrivalGate(len(rows), config.first_turn_window_s)
        runner = TurnRunner(
            self.engine,
            self.renderer,
            self.parse,
            response_length=params.max_new_tokens,
            max_prompt_tokens=config.max_prompt_tokens,
            gate=self.gate,
        )
        app = build_app(
            config,
            table,
            runner,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_model_len=max_len,
            vocab_size=len(self.tokenizer),
        )
        server = AgentServer(config, app)
        max_requests = len(rows)  # at once: a session holds one engine request at a time (turns.py)
        sessions = [table.open(i, row, external=config.external_sessions) for i, row in enumerate(rows)]
        io_passes = getattr(self.engine, "io_passes", None)
        if io_passes is not None:
            self.engine.io_passes = IO_PASSES  # the server reads and answers requests between the engine's steps
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(rows)), thread_name_prefix="agent") as threads:
                async with self.engine.serving(params, max_len=max_len, max_requests=max_requests):
                    async with server.running():
                        with endpoint_file(config.endpoint_dir, server.base_url, self.run_key):
                            async with self._environment(server, sessions, params):
                                runs = (self._run_one(server, table, s, row, threads) for s, row in zip(sessions, rows))
                                outcomes = list(await asyncio.gather(*runs))
        finally:
            if io_passes is not None:
                self.engine.io_passes = io_passes
        return sessions, outcomes

    async def _run_one(
        self, server: AgentServer, table: SessionTable, session: Session, row: dict, threads: ThreadPoolExecutor
    ) -> tuple[float, dict, str]:
        """(reward, metrics, failure: "" if none) of one sample's agent."""
        base_url = f"{server.base_url}/sessions/{session.id}/v1"
        started = time.perf_counter()
        try:
            if self.function is None:  # an external agent claims the session and posts the reward
                call = asyncio.shield(session.result)
            elif inspect.iscoroutinefunction(self.function):
                call = self.function(base_url=base_url, api_key=session.key, row=row)
            else:
                loop = asyncio.get_running_loop()
                call = loop.run_in_executor(
                    threads, lambda: self.function(base_url=base_url, api_key=session.key, row=row)
                )
            result = await asyncio.wait_for(call, self.config.timeout_s)
            if isinstance(result, Exception):
                raise result
            reward, metrics = agent_result(result)
            if session.last is None:
                raise AgentFailure("the agent made no request to the endpoint")
            return reward, {**metrics, "seconds": time.perf_counter() - started}, ""
        except Exception as error:  # noqa: BLE001  (one agent's failure must not end the step)
            if isinstance(error, asyncio.TimeoutError):
                error = AgentFailure(f"the agent ran over rollout.agent.timeout_s={self.config.timeout_s}")
            self._log(error)
            return math.nan, {}, f"{type(error).__name__}: {error}"
        finally:
            if session.counts.requests == 0 and session.engine_requests_used == 0:
                self.gate.leave()
            table.close(session)
            for k in range(session.engine_requests_used):
                self.engine.release(session.first_engine_request + k)

    def _environment(self, server: AgentServer, sessions: list[Session], params: SamplingParams):
        if self.environment is None:
            return contextlib.nullcontext()
        return self.environment.serving(server.base_url, sessions, temperature=params.temperature, top_p=params.top_p)

    def _trajectory(self, index: int, session: Session, outcome: tuple[float, dict, str]) -> Trajectory:
        trajectory = branch_trajectory(index, session.last, self.pad_token_id, failure=outcome[2])
        trajectory.tool_calls = session.counts.tool_calls
        return trajectory

    def _log(self, error: Exception) -> None:
        kind = type(error).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("%s failed; the sample leaves the update (agent_failure): %r", agents_of(self.config), error)


@contextmanager
def endpoint_file(directory: str, base_url: str, run_key: str) -> Iterator[None]:
    """While the endpoint serves, ``directory/rank<r>.json`` holds its address and the run's key (mode 0600), for
    external agents; removed when it stops."""
    if not directory:
        yield
        return
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    path = Path(directory) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump({"base_url": base_url, "run_key": run_key}, file)
    os.replace(temporary, path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """A row value as plain Python (numpy arrays of a parquet column to lists), for the user's agent."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def _session_counts(sessions: list[Session]) -> dict[str, torch.Tensor]:
    def column(values: list[float], dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    return {
        AGENT_REQUESTS: column([s.counts.requests for s in sessions]),
        AGENT_BRANCHES: column([len(s.branches) for s in sessions]),
        AGENT_GENERATED_TOKENS: column([sum(sum(b.mask) for b in s.branches) for s in sessions]),
        AGENT_PARSE_FAILURES: column([s.counts.parse_failures for s in sessions]),
        AGENT_SERVER_SECONDS: column([s.counts.server_seconds for s in sessions], torch.float32),
    }
