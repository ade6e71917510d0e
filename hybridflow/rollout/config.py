"""Typed config of generation (`actor_rollout_ref.rollout.*`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.dtypes import DTYPE_CHOICES
from hybridflow.rollout.agent.config import MultiTurnConfig
from hybridflow.rollout.native.config import NativeEngineConfig
from hybridflow.rollout.registry import ROLLOUT_BACKENDS, TENSOR_PARALLEL_BACKENDS
from hybridflow.rollout.vllm.config import VllmEngineConfig
from hybridflow.validation import require, require_choice, require_positive

# Where the old log-probs (PPO's π_old) come from: a trainer pass, the generator's own log-probs,
# or the generator's while they stay close to the trainer's (re-measured every few steps).
OLD_LOG_PROB_SOURCES = ("recompute", "rollout", "auto")


@dataclass(kw_only=True)
class SamplingConfig:
    do_sample: bool  # false: greedy decoding
    temperature: float  # softmax temperature of sampling (log-probs are computed at it too)
    top_p: float  # nucleus sampling mass in (0, 1] (1.0: off)
    top_k: int  # sample among the k most likely tokens (-1: off)
    n: int  # samples per prompt (in training: the group size of GRPO / RLOO)

    def __post_init__(self) -> None:
        require(
            self.temperature > 0,
            "temperature",
            f"must be positive, got {self.temperature}",
            "for greedy decoding set do_sample=false and leave temperature at 1.0",
        )
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}", "1.0 turns nucleus sampling off")
        require(self.top_k == -1 or self.top_k > 0, "top_k", f"must be -1 (off) or positive, got {self.top_k}")
        require_positive(self.n, "n")


@dataclass(kw_only=True)
class RolloutConfig(SamplingConfig):
    """The training sampling settings are SamplingConfig's fields, inherited; validation has its own."""

    name: str  # generation backend (rollout.registry): native (continuous batching) | vllm | hf (transformers generate)
    response_length: int  # max new tokens per response
    dtype: str  # dtype of the generation copy of the weights (auto | bf16 | fp32)
    tensor_model_parallel_size: int  # tg: ranks generating together (1/tg of weights and KV cache each); divides t
    seed: int  # base seed of sampling; see sampling_seed
    seed_per_step: int  # added to the seed once per training step (sampling_seed)
    seed_per_rank: int  # added to the seed once per data-parallel rank (sampling_seed)
    old_log_prob_source: str  # OLD_LOG_PROB_SOURCES: recompute (a trainer pass) | rollout | auto
    log_prob_tolerance: float  # auto: use the rollout's log-probs while the last measured mean |diff| is below this
    log_prob_check_every: int  # auto: recompute (and re-measure the diff) every N steps
    val_kwargs: SamplingConfig  # validation sampling
    native: NativeEngineConfig  # the native engine's settings (name=native)
    vllm: VllmEngineConfig  # vLLM's settings (name=vllm)
    multi_turn: MultiTurnConfig  # agent loops with tools (rollout/agent)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice(self.name, ROLLOUT_BACKENDS, "name")
        require_positive(self.response_length, "response_length")
        require_choice(self.dtype, DTYPE_CHOICES, "dtype")
        require_positive(self.tensor_model_parallel_size, "tensor_model_parallel_size")
        require(
            self.tensor_model_parallel_size == 1 or self.name in TENSOR_PARALLEL_BACKENDS,
            "tensor_model_parallel_size",
            f"{self.tensor_model_parallel_size} needs a tensor-parallel backend; "
            f"rollout.name={self.name} generates on one rank",
            f"use rollout.name one of {list(TENSOR_PARALLEL_BACKENDS)}, or tensor_model_parallel_size=1",
        )
        require_choice(self.old_log_prob_source, OLD_LOG_PROB_SOURCES, "old_log_prob_source")
        require_positive(self.log_prob_tolerance, "log_prob_tolerance")
        require_positive(self.log_prob_check_every, "log_prob_check_every")

    def sampling_seed(self, step: int, rank: int) -> int:
        """The seed of one rank's generation at one step: every (step, rank) draws its own samples
        and a rerun draws the same ones."""
        return self.seed + self.seed_per_step * step + self.seed_per_rank * rank
