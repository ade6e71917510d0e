"""Sequence scores: a sequence classifier's (a reward model's) scalar at each row's last real token, through the same
packing, Ulysses slicing and pipeline stages as the token passes of forward.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES
from hybridflow.engine.dynamic_batch import micro_batch_groups, restore_order, split_by_groups
from hybridflow.engine.forward import (
    check_pipelined,
    local_slice,
    packed_prompt_sharing,
    sp_of_packed,
)
from hybridflow.engine.packing import PackedBatch, pack, packed_forward
from hybridflow.engine.pipeline import PipelinedModel
from hybridflow.engine.sequence_parallel import ResponseShard, sp_size
from hybridflow.lengths import row_lengths
from hybridflow.models.loading import HEAD_NAME
from hybridflow.protocol import DataProto


def score_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """(B,) each row's scored column: its rightmost real token that is not the pad token (0 if none)."""
    scored = attention_mask.bool() & (input_ids != pad_token_id)
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (columns * scored).argmax(dim=1)


def head_module(model: nn.Module) -> nn.Module:
    """The score head (under LoRA: peft's wrapper of it, whose output is the trained copy's)."""
    names = [name for name, _ in model.named_modules() if name.split(".")[-1] == HEAD_NAME]
    if not names:
        raise ValueError(f"{type(model).__name__} has no {HEAD_NAME!r} head: not a sequence classifier")
    return model.get_submodule(min(names, key=len))


class ScoreOutputs(NamedTuple):
    """A training pass's sequence scores (B,), and under Ulysses which slice of the micro-batch this rank ran (None:
    all of it), for the routers' balancing loss over the slices (engine/moe.py)."""

    scores: torch.Tensor
    shard: ResponseShard | None


def sequence_scores(
    model: nn.Module,
    batch: DataProto,
    pad_token_id: int,
    remove_padding: bool,
    sp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """(B,) fp32: a sequence classifier's score of each row, at its last token that is not the pad token.

    This is transformers' ``*ForSequenceClassification`` rule, which the RL reward worker relies on. The padded pass
    takes the score from the model's own output; the packed pass runs the real tokens only (rows sharing their first
    tokens compute them once) and reads the head's output at the same tokens; with ``sp_group`` (Ulysses) each rank
    runs its slice and gives the scores of the rows whose scored token it holds."""
    if isinstance(model, PipelinedModel):
        return model.share_from_last(
            pipelined_scores(model, [batch], remove_padding, sp_group, pad_token_id=pad_token_id)
        )[0]
    return score_outputs(model, batch, pad_token_id, remove_padding, sp_group).scores


def score_outputs(
    model: nn.Module,
    batch: DataProto,
    pad_token_id: int,
    remove_padding: bool,
    sp_group: dist.ProcessGroup | None = None,
) -> ScoreOutputs:
    """``sequence_scores`` of a model without stages, with the slice this rank ran under Ulysses."""
    tensors = batch.batch
    ids, mask = tensors[INPUT_IDS], tensors[ATTENTION_MASK]
    sp = sp_of_packed(sp_group, remove_padding)
    if not remove_padding:
        scores = model(input_ids=ids, attention_mask=mask, position_ids=tensors[POSITION_IDS], use_cache=False).logits
        return ScoreOutputs(scores[:, 0].float(), None)
    packed, positions = scored_tokens(batch, pad_token_id)
    shards, start = None, 0
    if sp > 1:
        packed, shards, start = local_slice(packed, sp_group)
    outputs: list[torch.Tensor] = []
    hook = head_module(model).register_forward_hook(lambda _module, _inputs, output: outputs.append(output))
    try:  # the model's pooled output reads one token of the pack: the head's output is what is used
        packed_forward(model, packed, shards=shards)
    finally:
        hook.remove()
    token_scores = outputs[-1][0, :, 0]  # the head's output at every packed token (of this rank's slice)
    if shards is None:
        return ScoreOutputs(token_scores[positions].float(), None)
    width = packed.input_ids.shape[1]
    held = (positions >= start) & (positions < start + width)
    shard = ResponseShard(held, sp_group, shards.real_in(start, width))
    return ScoreOutputs(shard.whole(token_scores[positions[held] - start].float()), shard)


def scored_tokens(batch: DataProto, pad_token_id: int) -> tuple[PackedBatch, torch.Tensor]:
    """``batch``'s rows packed, and the (B,) packed position of each row's scored token (``score_columns``)."""
    tensors = batch.batch
    ids, mask = tensors[INPUT_IDS], tensors[ATTENTION_MASK]
    packed = pack(ids, mask, tensors[POSITION_IDS], tensors[RESPONSES].shape[1])
    columns = score_columns(ids, mask, pad_token_id)
    slots = (mask.long().cumsum(dim=1) - 1).gather(1, columns.unsqueeze(1))  # the scored token among its row's
    return packed, packed.segments.index.gather(1, slots).squeeze(1)  # (B,) its packed position


def pipelined_scores(
    model: PipelinedModel,
    micro_batches: list[DataProto],
    remove_padding: bool,
    sp_group: dist.ProcessGroup | None = None,
    loss: Callable[[int, ScoreOutputs], torch.Tensor] | None = None,
    *,
    pad_token_id: int,
    balance: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """``sequence_scores`` of every micro-batch through a pipelined model's stages, the last stage reading the score
    head at each row's scored token; training and forward-only (and ``balance``) as ``pipelined_outputs``."""
    check_pipelined(remove_padding)
    if sp_size(sp_group) > 1:
        raise ValueError("sequence scores in pipeline stages run without Ulysses: set ulysses_sequence_parallel_size=1")
    scored = [scored_tokens(micro, pad_token_id) for micro in micro_batches]

    def scores(outputs: torch.Tensor) -> torch.Tensor:
        return outputs[:, 0].float()

    staged_loss = None if loss is None else (lambda index, outputs: loss(index, ScoreOutputs(scores(outputs), None)))
    results = model.run(
        [packed for packed, _ in scored], [positions for _, positions in scored], staged_loss, balance=balance
    )
    return None if results is None else [scores(outputs) for outputs in results]


@torch.no_grad()
def batched_scores(
    model: nn.Module,
    data: DataProto,
    micro_batch_size: int,
    pad_token_id: int,
    *,
    remove_padding: bool = False,
    max_token_len: int | None = None,
    sp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sequence scores of a whole batch, (B,); micro-batches and ``sp_group`` as in ``batched_log_probs``."""
    sharing = packed_prompt_sharing(data, remove_padding)
    groups = micro_batch_groups(row_lengths(data), micro_batch_size, max_token_len, sharing)
    micro_batches = split_by_groups(data, groups)
    if isinstance(model, PipelinedModel):  # every micro-batch in one schedule
        scores = pipelined_scores(model, micro_batches, remove_padding, sp_group, pad_token_id=pad_token_id)
        return restore_order(model.share_from_last(scores), groups)
    scores = [sequence_scores(model, micro, pad_token_id, remove_padding, sp_group) for micro in micro_batches]
    return restore_order(scores, groups)
