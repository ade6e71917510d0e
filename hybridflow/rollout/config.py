"""Typed config of generation (``actor_rollout_ref.rollout.*``).

The settings every backend shares are ``RolloutConfig``'s fields; each registered backend with settings
adds its own section, ``rollout.<name>.*`` (``rollout.native``, ``rollout.vllm``), composed here from
the backend registry (rollout/backend.py), so that this file names no backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridflow.models.dtypes import DTYPE_CHOICES
from hybridflow.rollout.agent.config import MultiTurnConfig
from hybridflow.rollout.agent_server.config import AgentServerConfig
from hybridflow.rollout.backend import backend_sections, rollout_backend, rollout_backends
from hybridflow.rollout.sampling import SamplingConfig
from hybridflow.validation import require, require_choice, require_positive

# Where the old log-probs (PPO's π_old) come from: a trainer pass, the generator's own log-probs,
# or the generator's while they stay close to the trainer's (re-measured every few steps).
OLD_LOG_PROB_SOURCES = ("recompute", "rollout", "auto")


@dataclass(kw_only=True)
class _RolloutSettings(SamplingConfig):
    """The training sampling settings are SamplingConfig's fields, inherited; validation has its own."""

    # generation backend, one registered in rollout/backend.py: native (continuous batching) | vllm (pip install
    # 'hybridflow[vllm]') | hf (transformers generate)
    name: str
    response_length: int  # max new tokens per response
    dtype: str  # dtype of the generation copy of the weights (auto | bf16 | fp32)
    # tg: ranks that generate together, each holding 1/tg of the weights and KV cache; divides
    # actor.tensor_model_parallel_size
    tensor_model_parallel_size: int
    # pg: pipeline stages that generate together, each holding 1/pg of the decoder layers and their KV cache
    # (native only); divides actor.pipeline_model_parallel_size
    pipeline_model_parallel_size: int
    seed: int  # base seed of sampling: step s on rank r samples with seed + s * seed_per_step + r * seed_per_rank
    seed_per_step: int  # added to the seed once per training step
    seed_per_rank: int  # added to the seed once per data-parallel rank
    # where PPO's old log-probs come from: recompute (a trainer pass) | rollout (the generator's log-probs) | auto
    old_log_prob_source: str
    log_prob_tolerance: float  # auto: use the rollout's log-probs while the last measured mean |diff| is below this
    log_prob_check_every: int  # auto: recompute (and re-measure the diff) every N steps
    val_kwargs: SamplingConfig  # validation sampling
    multi_turn: MultiTurnConfig  # request-level multi-turn rollout with tools (hybridflow/rollout/agent)
    agent: AgentServerConfig  # the user's agents through an OpenAI-compatible endpoint (docs/agent_server.md)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice(self.name, rollout_backends(), "name")
        require_positive(self.response_length, "response_length")
        require_choice(self.dtype, DTYPE_CHOICES, "dtype")
        require_positive(self.tensor_model_parallel_size, "tensor_model_parallel_size")
        require_positive(self.pipeline_model_parallel_size, "pipeline_model_parallel_size")
        backend = rollout_backend(self.name)
        require(
            not self.multi_turn.enable or backend.request_api,
            "name",
            f"multi-turn rollout drives an engine request by request; {self.name} has no such API",
            f"use one of {[name for name, b in rollout_backends().items() if b.request_api]}",
        )
        require(
            not self.agent.enabled or backend.request_api,
            "agent.function",
            f"agents are served by an engine request by request; {self.name} has no such API",
            f"use one of {[name for name, b in rollout_backends().items() if b.request_api]}",
        )
        require(
            not (self.agent.enabled and self.multi_turn.enable),
            "agent.function",
            "a run's samples come from the user's agents (agent.function) or from agent loops (multi_turn.enable)",
            "set one of them",
        )
        require(
            not self.agent.enabled or self.tensor_model_parallel_size * self.pipeline_model_parallel_size == 1,
            "agent.function",
            "agents through the endpoint need tensor_model_parallel_size=1 and pipeline_model_parallel_size=1 "
            "(each agent talks to one engine)",
        )
        require_choice(self.old_log_prob_source, OLD_LOG_PROB_SOURCES, "old_log_prob_source")
        require_positive(self.log_prob_tolerance, "log_prob_tolerance")
        require_positive(self.log_prob_check_every, "log_prob_check_every")

    def sampling_seed(self, step: int, rank: int) -> int:
        """The seed of one rank's generation at one step: every (step, rank) draws its own samples
        and a rerun draws the same ones."""
        return self.seed + self.seed_per_step * step + self.seed_per_rank * rank

    def backend_settings(self) -> Any:
        """The chosen backend's own section (``rollout.<name>``), or None for a backend without settings."""
        return getattr(self, self.name, None)


# one field per backend with settings, named after it: rollout.native.*, rollout.vllm.*, ...
RolloutConfig = dataclasses.make_dataclass(
    "RolloutConfig",
    [(name, settings) for name, settings in backend_sections().items()],
    bases=(_RolloutSettings,),
    kw_only=True,
    namespace={"__doc__": _RolloutSettings.__doc__, "__module__": __name__},
)
