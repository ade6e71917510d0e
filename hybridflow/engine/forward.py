"""Forward passes over a batch's response tokens: log-probs, entropy, values.

Every pass reads ``input_ids``, ``attention_mask``, ``position_ids`` (B, P+R) and ``responses``
(B, R), and returns values for the R response positions only: the token at position P+t is
predicted by the logits at P+t-1. All passes share this masking, so log-probs from the rollout,
the actor, the reference and the values line up token for token.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.algorithms import entropy_from_logits, log_probs_from_logits
from hybridflow.protocol import DataProto


def _model_inputs(batch: DataProto) -> dict[str, torch.Tensor]:
    return {
        "input_ids": batch.batch["input_ids"],
        "attention_mask": batch.batch["attention_mask"],
        "position_ids": batch.batch["position_ids"],
    }


def response_logits(model: nn.Module, batch: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """Logits predicting each response token: (B, R, V), divided by the sampling temperature."""
    response_length = batch.batch["responses"].shape[1]
    logits = model(**_model_inputs(batch), use_cache=False).logits  # (B, P+R, V)
    logits = logits[:, -response_length - 1 : -1, :]
    return logits / temperature if temperature != 1.0 else logits


def response_log_probs(
    model: nn.Module, batch: DataProto, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi(response token), entropy or None), each (B, R) in fp32."""
    logits = response_logits(model, batch, temperature)
    log_probs = log_probs_from_logits(logits, batch.batch["responses"])
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def response_values(model: nn.Module, batch: DataProto) -> torch.Tensor:
    """Critic values V(s_t) of the state before each response token: (B, R) in fp32."""
    response_length = batch.batch["responses"].shape[1]
    values = model(**_model_inputs(batch), use_cache=False).logits  # (B, P+R, 1)
    return values[:, -response_length - 1 : -1, 0].float()


@torch.no_grad()
def batched_log_probs(
    model: nn.Module, data: DataProto, micro_batch_size: int, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a whole batch, computed micro-batch by micro-batch without grad."""
    parts = [response_log_probs(model, micro, temperature, with_entropy) for micro in data.split(micro_batch_size)]
    log_probs = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return log_probs, entropy


@torch.no_grad()
def batched_values(model: nn.Module, data: DataProto, micro_batch_size: int) -> torch.Tensor:
    return torch.cat([response_values(model, micro) for micro in data.split(micro_batch_size)])
