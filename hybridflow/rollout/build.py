"""Building the run's generator: the backend ``rollout.name`` names, wrapped in agent loops for multi-turn rollout."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from hybridflow.rollout.agent import AgentRollout
from hybridflow.rollout.agent_server.rollout import AgentFunctionRollout
from hybridflow.rollout.backend import rollout_backend
from hybridflow.rollout.base import Rollout
from hybridflow.rollout.config import RolloutConfig
from hybridflow.tools import ToolSet


def build_rollout(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    config: RolloutConfig,
    tp_group: dist.ProcessGroup | None = None,
    *,
    pp_group: dist.ProcessGroup | None = None,
    tools: ToolSet | None = None,
    default_agent: str | None = None,
) -> Rollout:
    """The backend ``config.name`` over ``model``, tensor-parallel over ``tp_group`` and in pipeline stages over
    ``pp_group`` when given (a backend with ``pipeline_stages``); with
    ``multi_turn.enable``, agent loops over that backend's request engine (rollout/agent) with ``tools``
    (default: those of ``multi_turn.tool_config_path``) and ``default_agent`` (default:
    ``multi_turn.default_agent``), which the trainer gives with the run's resolved paths."""
    backend = rollout_backend(config.name)
    if pp_group is None:
        generator = backend.build(model, tokenizer, config.backend_settings(), tp_group)
    elif backend.pipeline_stages:
        generator = backend.build(model, tokenizer, config.backend_settings(), tp_group, pp_group=pp_group)
    else:
        raise ValueError(f"rollout backend '{config.name}' does not generate in pipeline stages: use native")
    if config.agent.enabled:
        multi_turn = config.multi_turn
        return AgentFunctionRollout(
            generator, tokenizer, config.agent, tool_role=multi_turn.tool_role, format=multi_turn.format
        )
    if not config.multi_turn.enable:
        return generator
    return AgentRollout(generator, tokenizer, config.multi_turn, tools, default_agent=default_agent)
