"""Joining the rollouts of several generation rounds into one step's batch (dynamic sampling).

Prompts are left-padded to each batch's longest prompt, so two rounds' batches can differ in their
prompt width P. `concat_rollouts` left-pads the narrower ones (pad token, attention 0, position 0)
and concatenates; the responses (B, R) already share the budget R.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, PROMPTS, ROUTED_EXPERTS
from hybridflow.protocol import DataProto

# columns that begin with the prompt, and the value their left padding takes (None: the pad token)
_PROMPT_LEADING = {INPUT_IDS: None, PROMPTS: None, ATTENTION_MASK: 0, POSITION_IDS: 0, ROUTED_EXPERTS: -1}


def prompt_width(batch: DataProto) -> int:
    """The prompt columns of rollouts (their ``prompts``), or of prompt rows (all their columns)."""
    return batch.batch[PROMPTS if PROMPTS in batch.batch.keys() else INPUT_IDS].shape[1]


def left_pad_prompts(batch: DataProto, width: int, pad_token_id: int) -> DataProto:
    """``batch`` with its prompt part left-padded to ``width`` columns (a new DataProto; the input is kept)."""
    extra = width - prompt_width(batch)
    if extra < 0:
        raise ValueError(f"cannot pad prompts of width {prompt_width(batch)} down to {width}")
    if extra == 0:
        return batch
    padded = batch.select(batch_keys=list(batch.batch.keys()))  # a new TensorDict: the input keeps its columns
    for key, value in _PROMPT_LEADING.items():
        if key not in batch.batch.keys():  # prompt rows have no ``prompts`` column: their input ids are the prompt
            continue
        column = batch.batch[key]
        fill = pad_token_id if value is None else value
        shape = (column.shape[0], extra, *column.shape[2:])  # routed experts: (B, P+R, layers, k)
        padding = torch.full(shape, fill, dtype=column.dtype, device=column.device)
        padded.batch[key] = torch.cat([padding, column], dim=1)
    return padded


def concat_rollouts(batches: Sequence[DataProto], pad_token_id: int) -> DataProto:
    """The rows of all rollout batches (or prompt rows of different loader batches), in order, with their prompts
    padded to the widest."""
    width = max(prompt_width(batch) for batch in batches)
    return DataProto.concat([left_pad_prompts(batch, width, pad_token_id) for batch in batches])
