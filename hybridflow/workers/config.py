"""Typed configs of the worker roles that compose engine and rollout configs."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.engine.config import (
    ActorConfig,
    FSDPConfig,
    ModelConfig,
    ModelPathConfig,
    RefConfig,
    TrainedModelConfig,
)
from hybridflow.rollout.config import RolloutConfig
from hybridflow.validation import require, require_positive


@dataclass(kw_only=True)
class ActorRolloutRefConfig:
    """The policy: its model, training (actor), generation (rollout) and the frozen reference (ref)."""

    model: TrainedModelConfig  # the policy; the reference starts from the same weights
    actor: ActorConfig
    rollout: RolloutConfig
    ref: RefConfig

    def __post_init__(self) -> None:
        require(bool(self.model.path), "model.path", "no model given", "a local Hugging Face directory or tiny-llama")


@dataclass(kw_only=True)
class TeacherConfig(RefConfig):
    """On-policy distillation's teacher: a frozen model scoring the student's sampled tokens (its log-probs), on a
    worker group of its own; the advantage it makes is algorithm.distillation's."""

    model: ModelPathConfig  # path "": no teacher; a built-in name, a model directory, or `hybridflow export`'s output

    @property
    def enabled(self) -> bool:
        return bool(self.model.path)


@dataclass(kw_only=True)
class RewardModelConfig:
    """A learned reward model, whose scores are added to the rule-based ones or replace them (enable to use)."""

    enable: bool  # score responses with a reward-model worker group (added to rule-based scores)
    # true: training rewards are the reward model's alone, and validation scores the rule-based reward alone (the task's
    # own measure of the policy); false: both add up, in training and validation
    replace_rule_reward: bool
    model: ModelConfig  # a sequence-classification model directory (`hybridflow rm`, then `hybridflow export`)
    micro_batch_size_per_gpu: int  # samples per forward
    max_length: int  # longest prompt + response the reward model reads (longer ones are cut from the left)
    # Ulysses: ranks that hold the same conversations and split each micro-batch's tokens (attention by all-to-all
    # over heads); the data-parallel ranks are the rest
    ulysses_sequence_parallel_size: int
    # pipeline parallelism: ranks that split the decoder layers into stages (each batch's micro-batches in one 1F1B
    # schedule); they hold the same conversations; the data-parallel ranks are the rest; not with Ulysses
    pipeline_model_parallel_size: int
    fsdp: FSDPConfig

    def __post_init__(self) -> None:
        require(
            not self.enable or bool(self.model.path), "model.path", "reward_model.enable is true but no model is given"
        )
        require(  # a model given and not used would train on the rule's reward without a word
            self.enable or not self.model.path,
            "enable",
            f"is false, so the reward model at reward_model.model.path={self.model.path} would not be used",
            "set reward_model.enable=true to score with it, or drop reward_model.model.path",
        )
        require(
            self.enable or not self.replace_rule_reward,
            "replace_rule_reward",
            "is true but reward_model.enable is false: there is no reward model to replace the rule-based reward",
            "set reward_model.enable=true and reward_model.model.path, or replace_rule_reward=false",
        )
        require_positive(self.micro_batch_size_per_gpu, "micro_batch_size_per_gpu")
        require_positive(self.max_length, "max_length")
        require_positive(self.pipeline_model_parallel_size, "pipeline_model_parallel_size")
