"""What a generation call samples with: the config section (``SamplingConfig``) and the call's settings
(``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.validation import require, require_positive


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


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What one generation call samples with (the rollout config's settings for the call's purpose)."""

    do_sample: bool  # false: greedy
    temperature: float
    top_p: float
    top_k: int  # -1: off
    max_new_tokens: int
    seed: int  # the call's seed; each request derives its own stream from it
    # a mixture of experts: return each token's chosen experts (``routed_experts``) for routing replay
    record_routes: bool = False

    @classmethod
    def from_config(cls, sampling: SamplingConfig, *, max_new_tokens: int, seed: int) -> SamplingParams:
        return cls(
            do_sample=sampling.do_sample,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=max_new_tokens,
            seed=seed,
        )

    @classmethod
    def greedy(cls, *, max_new_tokens: int, seed: int) -> SamplingParams:
        return cls(do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=seed)
