"""`AgentRollout`: one agent loop per sample, all at once, over a backend's request engine.

The same `Rollout` interface and batch layout as one-shot generation, so the trainer does not branch
on it. Each row's response is its trajectory: generated and inserted tokens in order (R columns,
padded): ``attention_mask`` is 1 on all of them, ``response_mask`` only on the generated ones, which
the losses and entropy then aggregate over; ``rollout_log_probs`` are the generated tokens' (0 on
inserted ones). A row whose loop failed keeps its tokens with ``response_mask`` 0 (it leaves the
updates), and its reason in ``agent_failure``; each kind of failure is logged once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from hybridflow.batch_keys import (
    AGENT_FAILURE,
    AGENT_NAME,
    ATTENTION_MASK,
    EXTRA_INFO,
    INPUT_IDS,
    NUM_TURNS,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    STOP_REASON,
    TOOL_CALLS,
    TOOL_ERRORS,
    TOOL_REWARDS,
    TRUNCATED,
    TURN_ENDS,
    TURN_SCORES,
)
from hybridflow.models.routing import ROUTE_DTYPE
from hybridflow.protocol import DataProto
from hybridflow.rollout.agent.chat import ChatFormat
from hybridflow.rollout.agent.config import MultiTurnConfig
from hybridflow.rollout.agent.loops import AgentContext, agent_loop_class
from hybridflow.rollout.agent.parsers import TOOL_CALL_FORMATS
from hybridflow.rollout.agent.state import STOP_NO_TOOL_CALL, RequestState, Trajectory
from hybridflow.rollout.agent.tool_calls import TrajectoryTools
from hybridflow.rollout.base import BackendWrapper, Rollout, SamplingParams
from hybridflow.tools import ToolSet, load_tools

logger = logging.getLogger(__name__)


class AgentRollout(BackendWrapper):
    """Multi-turn generation with tools. backend: a rollout with a request engine (native, vllm); its
    weights and cache are the ones used. tools: the run's tools (default: those of
    ``config.tool_config_path``). default_agent: the loop of rows that name none (default:
    ``config.default_agent``)."""

    def __init__(
        self,
        backend: Rollout,
        tokenizer: Any,
        config: MultiTurnConfig,
        tools: ToolSet | None = None,
        *,
        default_agent: str | None = None,
    ):
        super().__init__(backend)
        self.tokenizer = tokenizer
        self.config = config
        if tools is None:
            tools = load_tools(config.tool_config_path) if config.tool_config_path else ToolSet()
        self.tools = tools
        self.default_agent = default_agent or config.default_agent
        self.parse = TOOL_CALL_FORMATS[config.format]
        self.chat = ChatFormat(tokenizer, backend.eos_token_ids, config.tool_role)
        self._logged_failures: set[str] = set()

    def generate_sequences(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """prompts: the tensors of `Rollout.generate_sequences`, plus optional per-row ``agent_name`` and
        ``extra_info`` (its ``tools_kwargs``). params.max_new_tokens: each row's response budget."""
        ids, mask = prompts.batch[INPUT_IDS], prompts.batch[ATTENTION_MASK]
        prompt_lists = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        n = len(prompt_lists)
        names = prompts.non_tensor_batch.get(AGENT_NAME, np.full(n, "", dtype=object))
        extra = prompts.non_tensor_batch.get(EXTRA_INFO, np.full(n, None, dtype=object))
        jobs = [
            (str(name) or self.default_agent, (info or {}).get("tools_kwargs", {})) for name, info in zip(names, extra)
        ]
        route_shape = self.engine.route_shape() if params.record_routes else None
        trajectories = asyncio.run(self._run_all(prompt_lists, jobs, params))
        tensors, non_tensors = assemble_trajectories(
            ids, mask, trajectories, params.max_new_tokens, self.pad_token_id, route_shape
        )
        return DataProto.from_dict(tensors, non_tensors, meta_info=dict(prompts.meta_info))

    async def _run_all(
        self, prompts: list[list[int]], jobs: list[tuple[str, dict]], params: SamplingParams
    ) -> list[Trajectory]:
        max_len = max(len(p) for p in prompts) + params.max_new_tokens
        async with self.engine.serving(params, max_len=max_len, max_requests=len(prompts)):
            runs = (
                self._run_one(i, prompt, name, kwargs, params.max_new_tokens)
                for i, (prompt, (name, kwargs)) in enumerate(zip(prompts, jobs))
            )
            return list(await asyncio.gather(*runs))

    async def _run_one(
        self, request: int, prompt: list[int], name: str, tools_kwargs: dict, response_length: int
    ) -> Trajectory:
        trajectory = Trajectory(request=request, prompt=prompt)
        tools = TrajectoryTools(self.tools, str(request), tools_kwargs, self.config.tool_timeout_s)
        context = AgentContext(
            engine=self.engine,
            tokenizer=self.tokenizer,
            chat=self.chat,
            parse=self.parse,
            tools=tools,
            config=self.config,
            response_length=response_length,
        )
        try:
            await agent_loop_class(name)().run(trajectory, context)
            if trajectory.state is not RequestState.FINISHED:
                raise RuntimeError(f"agent loop {name!r} returned with the request {trajectory.state.value}")
            if len(trajectory.tokens) > response_length:
                raise RuntimeError(f"agent loop {name!r} made {len(trajectory.tokens)} tokens of {response_length}")
        except Exception as error:  # noqa: BLE001  (one sample's failure must not end the step)
            trajectory.fail(f"{type(error).__name__}: {error}")
            self._log_failure(name, error)
        finally:
            self.engine.release(request)
            trajectory.tool_rewards = await tools.finish()
        return trajectory

    def _log_failure(self, name: str, error: Exception) -> None:
        kind = f"{name}/{type(error).__name__}"
        if kind not in self._logged_failures:
            self._logged_failures.add(kind)
            logger.warning("agent loop %r failed; the sample leaves the update (agent_failure): %r", name, error)


def assemble_trajectories(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    trajectories: list[Trajectory],
    response_length: int,
    pad_token_id: int,
    route_shape: tuple[int, int] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The batch of prompts + trajectories (the layout of rollout/base.py's `assemble_batch`, with inserted
    tokens kept in ``responses`` and 0 in ``response_mask``), and the per-row facts of the conversations.
    ``route_shape`` (layers, k): the trajectories' recorded routes go in ``routed_experts`` (`trajectory_routes`)."""
    b, r = len(trajectories), response_length
    responses = torch.full((b, r), pad_token_id, dtype=torch.long)
    present = torch.zeros(b, r, dtype=torch.long)  # every real response token, generated or inserted
    generated = torch.zeros(b, r, dtype=torch.long)
    log_probs = torch.zeros(b, r, dtype=torch.float32)
    for i, trajectory in enumerate(trajectories):
        n = min(len(trajectory.tokens), r)
        responses[i, :n] = torch.tensor(trajectory.tokens[:n], dtype=torch.long)
        present[i, :n] = 1
        log_probs[i, :n] = torch.tensor(trajectory.log_probs[:n], dtype=torch.float32)
        if trajectory.state is RequestState.FINISHED:
            generated[i, :n] = torch.tensor(trajectory.mask[:n], dtype=torch.long)
    device = prompt_ids.device
    attention_mask = torch.cat([prompt_mask, present.to(device)], dim=1)

    def counts(values: Iterable[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    def column(values: Iterable[Any]) -> np.ndarray:
        array = np.empty(b, dtype=object)
        for i, value in enumerate(values):  # one by one: numpy would make a list of lists 2-d
            array[i] = value
        return array

    tensors = {
        PROMPTS: prompt_ids,
        RESPONSES: responses.to(device),
        INPUT_IDS: torch.cat([prompt_ids, responses.to(device)], dim=1),
        ATTENTION_MASK: attention_mask,
        POSITION_IDS: (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        RESPONSE_MASK: generated.to(device),
        ROLLOUT_LOG_PROBS: (log_probs * generated).to(device),
        TRUNCATED: torch.tensor([t.stop_reason != STOP_NO_TOOL_CALL for t in trajectories], device=device),
        NUM_TURNS: counts(t.assistant_turns for t in trajectories),
        TOOL_CALLS: counts(t.tool_calls for t in trajectories),
        TOOL_ERRORS: counts(t.tool_errors for t in trajectories),
    }
    non_tensors = {
        STOP_REASON: column(t.stop_reason or "failed" for t in trajectories),
        TURN_SCORES: column(list(t.turn_scores) for t in trajectories),
        TURN_ENDS: column(list(t.turn_ends) for t in trajectories),
        TOOL_REWARDS: column(dict(t.tool_rewards) for t in trajectories),
        AGENT_FAILURE: column(t.failure or "" for t in trajectories),
    }
    if route_shape is not None:
        tensors[ROUTED_EXPERTS] = trajectory_routes(prompt_mask, trajectories, response_length, route_shape).to(device)
    return tensors, non_tensors


def trajectory_routes(
    prompt_mask: torch.Tensor, trajectories: list[Trajectory], response_length: int, route_shape: tuple[int, int]
) -> torch.Tensor:
    """The trajectories' routes in the batch's layout (B, P+R, layers, k): each row's prompt left-padded to P
    columns, its response tokens after it; -1 where none was recorded (padding, the tokens no turn computed: the
    last generated token and what the loop inserted after the last turn, a trajectory whose first turn failed)."""
    rows, width = prompt_mask.shape
    routes = torch.full((rows, width + response_length, *route_shape), -1, dtype=ROUTE_DTYPE)
    for row, trajectory in enumerate(trajectories):
        if trajectory.routes is None:
            continue
        prompt = int(prompt_mask[row].sum())
        known = min(len(trajectory.routes), prompt + min(len(trajectory.tokens), response_length))
        routes[row, width - prompt : width - prompt + known] = trajectory.routes[:known]
    return routes
