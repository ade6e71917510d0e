"""Forward (and backward) passes over datums: token sequences with a target token at every position.

A datum is the Tinker API's unit (``algorithms/datum_losses.py``): ``tokens`` (N,) and per-position inputs, among
them ``target_tokens`` (N,), the token each position is scored on (usually the next one, but any token). The pass
reads the log-probability of each target under the model, the loss per token, and with a backward pass adds the
summed loss's gradient to the parameters' gradients: calls accumulate until the optimizer step, as the API says.

Datums are run in micro-batches of consecutive datums whose padded size (rows x longest) stays within a token
budget, right-padded; padding changes nothing on the real tokens, so the micro-batching changes no result beyond
float rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hybridflow.algorithms import log_probs_from_logits
from hybridflow.algorithms.datum_losses import DATUM_LOSSES, TARGET_TOKENS


@dataclass(frozen=True)
class Datum:
    """One sequence: ``tokens`` (N,) int, ``inputs`` the loss's per-position arrays (N,), ``target_tokens`` too."""

    tokens: np.ndarray
    inputs: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class DatumOutput:
    logprobs: np.ndarray  # (N,) float32: log p(target_tokens[i] | tokens[: i + 1])
    elementwise_loss: np.ndarray  # (N,) float32: the loss of each position (summed into the loss)


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive datums grouped so that rows x longest row stays within ``max_tokens`` (a datum longer than that
    runs alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def target_log_probs(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | tokens[b, : t + 1]) for right-padded rows (B, T), in fp32."""
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    return log_probs_from_logits(logits.float(), targets)


def _padded(datums: Sequence[Datum], names: Sequence[str], device: torch.device) -> tuple[torch.Tensor, ...]:
    rows, longest = len(datums), max(len(d.tokens) for d in datums)
    tokens = torch.zeros(rows, longest, dtype=torch.long)
    mask = torch.zeros(rows, longest, dtype=torch.long)
    targets = torch.zeros(rows, longest, dtype=torch.long)
    inputs = {name: torch.zeros(rows, longest, dtype=torch.float32) for name in names}
    for row, datum in enumerate(datums):
        n = len(datum.tokens)
        tokens[row, :n] = torch.tensor(datum.tokens, dtype=torch.long)
        mask[row, :n] = 1
        targets[row, :n] = torch.tensor(datum.inputs[TARGET_TOKENS], dtype=torch.long)
        for name in names:
            inputs[name][row, :n] = torch.tensor(datum.inputs[name], dtype=torch.float32)
    move = lambda t: t.to(device)  # noqa: E731
    return move(tokens), move(mask), move(targets), {k: move(v) for k, v in inputs.items()}


def run_datums(
    model: nn.Module,
    datums: Sequence[Datum],
    loss_name: str,
    settings: Mapping[str, float],
    *,
    backward: bool,
    max_tokens: int,
    device: torch.device,
    loss_scale: float = 1.0,
) -> tuple[list[DatumOutput], float]:
    """Each datum's log-probs and per-token loss, and the summed loss; with ``backward`` the gradient of
    ``loss_scale`` x the summed loss is added to the parameters' gradients (``loss_scale``: the data-parallel size,
    whose average FSDP takes)."""
    loss = DATUM_LOSSES[loss_name]
    outputs: list[DatumOutput | None] = [None] * len(datums)
    total = 0.0
    for group in micro_batches([len(d.tokens) for d in datums], max_tokens):
        part = [datums[i] for i in group]
        tokens, mask, targets, inputs = _padded(part, loss.inputs, device)
        with torch.set_grad_enabled(backward):
            logprobs = target_log_probs(model, tokens, mask, targets)
            per_token = loss.fn(logprobs, inputs, mask.float(), settings)
            summed = per_token.sum()
            if backward:
                (summed * loss_scale).backward()
        total += float(summed.detach())
        logprobs, per_token = logprobs.detach().float().cpu(), per_token.detach().float().cpu()
        for row, index in enumerate(group):
            n = len(datums[index].tokens)
            outputs[index] = DatumOutput(logprobs[row, :n].numpy().copy(), per_token[row, :n].numpy().copy())
    return [o for o in outputs if o is not None], total
