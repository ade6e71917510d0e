"""Typed config of generation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingConfig:
    do_sample: bool = True  # False: greedy decoding
    temperature: float = 1.0  # softmax temperature of sampling
    top_p: float = 1.0  # nucleus sampling mass (1.0: off)
    top_k: int = -1  # sample among the k most likely tokens (-1: off)
    n: int = 1  # samples per prompt


@dataclass
class RolloutConfig:
    name: str = "native"  # generation backend: native (continuous batching) | hf (transformers generate)
    n: int = 4  # samples per prompt in training (the group size of GRPO / RLOO)
    temperature: float = 1.0  # sampling temperature in training (log-probs are computed at this temperature)
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k sampling (-1: off)
    do_sample: bool = True  # False: greedy in training too
    response_length: int = 64  # max new tokens per response
    dtype: str = "bf16"  # dtype of the generation copy of the weights (bf16 | fp32)
    seed: int = 0  # base seed; each step and rank derive their own, so runs are reproducible
    old_log_prob_source: str = "recompute"  # recompute (a trainer pass) | rollout (the generator's log-probs) | auto
    log_prob_tolerance: float = (
        0.02  # auto: use the rollout's log-probs while the last measured mean |diff| is below this
    )
    log_prob_check_every: int = 10  # auto: recompute (and re-measure the diff) every N steps
    val_kwargs: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(do_sample=False, temperature=1.0, n=1)
    )  # validation sampling
