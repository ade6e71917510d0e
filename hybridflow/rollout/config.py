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
    name: str = "hf"  # generation backend: hf (transformers generate)
    n: int = 4  # samples per prompt in training (the group size of GRPO / RLOO)
    temperature: float = 1.0  # sampling temperature in training (log-probs are computed at this temperature)
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k sampling (-1: off)
    do_sample: bool = True  # False: greedy in training too
    response_length: int = 64  # max new tokens per response
    dtype: str = "bf16"  # dtype of the generation copy of the weights (bf16 | fp32)
    seed: int = 0  # base seed; each step and rank derive their own, so runs are reproducible
    val_kwargs: SamplingConfig = field(default_factory=lambda: SamplingConfig(do_sample=False, temperature=1.0, n=1))  # validation sampling
