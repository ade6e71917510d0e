"""Typed configs of the worker roles that compose engine and rollout configs."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.engine.config import ActorConfig, FSDPConfig, ModelConfig, RefConfig
from hybridflow.rollout.config import RolloutConfig


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class RewardModelConfig:
    enable: bool = False  # score responses with a reward-model worker group (added to rule-based scores)
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(path="")
    )  # a sequence-classification model directory
    micro_batch_size_per_gpu: int = 16  # samples per forward
    max_length: int = 512  # longest prompt + response the reward model reads (longer ones are cut from the left)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
