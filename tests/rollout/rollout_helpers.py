"""Helpers of the rollout tests: chat-templated left-padded prompts, sampling parameters."""

from __future__ import annotations

import copy
import dataclasses

import torch

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.native import NativeEngineConfig
from hybridflow.trainer.setup.config import default_config

QUESTIONS = [
    "Hi",
    "What is the sum of 12 and 30 and 4? Explain each step of the addition carefully.",
    "Add 17 and 25",
    "Count: 1 2 3",
]


def prompts_of(tokenizer, questions: list[str]) -> DataProto:
    """Chat-templated questions, left-padded, with positions counted from the first real token."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    positions = (encoded["attention_mask"].cumsum(1) - 1).clamp(min=0)
    batch = {INPUT_IDS: encoded["input_ids"], ATTENTION_MASK: encoded["attention_mask"], POSITION_IDS: positions}
    return DataProto.from_dict(batch)


def greedy(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, seed=0)


def sampled(
    seed: int, max_new_tokens: int = 8, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1
) -> SamplingParams:
    return SamplingParams(
        do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed
    )


def engine_config(**changes) -> NativeEngineConfig:
    """The native engine's default settings (actor_rollout_ref.rollout.native in the YAML), with ``changes``."""
    return dataclasses.replace(default_config().actor_rollout_ref.rollout.native, **changes)


def perturbed(model):
    """A copy of ``model`` with seeded noise of about each tensor's own scale added to every parameter."""
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in changed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().clamp(min=0.02))
    return changed


@torch.no_grad()
def response_logits(model, batch, prompt_width: int) -> torch.Tensor:
    """(B, R, V) fp32: one independent forward's logits that predict each response token of a generated ``batch``
    (its TensorDict) whose prompts are ``prompt_width`` columns wide."""
    logits = model(
        input_ids=batch[INPUT_IDS], attention_mask=batch[ATTENTION_MASK], position_ids=batch[POSITION_IDS]
    ).logits
    return logits[:, prompt_width - 1 : -1].float()


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at ``tokens``: (B, R)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
