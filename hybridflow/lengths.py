"""Tokens per row of a step's batch, and balancing them over data-parallel ranks.

Shared by the driver (which orders a batch so every rank gets about as many tokens to compute)
and the engine (which forms micro-batches by token count and counts a pass's FLOPs); neither
side imports the other for it.

Row lengths are real tokens of the (B, P+R) batch: ``attention_mask.sum(-1)``. A packed pass
(``engine/packing.py``) computes a prompt shared by several rows (the n samples of a GRPO
group) once, in the first of them; ``computed_lengths`` counts that.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from hybridflow.batch_keys import ATTENTION_MASK, INPUT_IDS, RESPONSES
from hybridflow.protocol import DataProto


def row_lengths(data: DataProto) -> list[int]:
    """Real tokens of each row of a batch with an (B, P+R) ``attention_mask``."""
    return data.batch[ATTENTION_MASK].sum(dim=-1).tolist()


def prompt_leaders(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """(b,) for each row, the first row with the same prompt (itself if none before it has it)."""
    prompts = torch.cat(
        [input_ids[:, :prompt_length] * attention_mask[:, :prompt_length], attention_mask[:, :prompt_length]], dim=1
    )
    _, group = torch.unique(prompts, dim=0, return_inverse=True)
    rows = torch.arange(len(group), device=group.device)
    first = torch.full((int(group.max()) + 1 if len(group) else 0,), len(group), dtype=torch.long, device=group.device)
    first = first.scatter_reduce(0, group, rows, reduce="amin")
    return first[group]


def computed_lengths(attention_mask: torch.Tensor, input_ids: torch.Tensor, response_length: int) -> list[int]:
    """Tokens per row that a packed pass computes: a shared prompt counts in its first row only."""
    return _sharing(attention_mask, input_ids, response_length).computed


def packed_lengths(data: DataProto) -> list[int]:
    """Tokens per row that a packed pass computes (a prompt shared by several rows once)."""
    tensors = data.batch
    return computed_lengths(tensors[ATTENTION_MASK], tensors[INPUT_IDS], tensors[RESPONSES].shape[1])


@dataclass(frozen=True)
class PromptSharing:
    """Which rows of a batch share a prompt, which a packed pass computes once per micro-batch.

    Micro-batches that keep such rows together compute fewer tokens (``engine/dynamic_batch.py``).
    """

    leaders: list[int]  # for each row, the first row with the same prompt (itself if none before it has it)
    computed: list[int]  # tokens each row adds to a micro-batch that holds its leader (a follower: its response)


def prompt_sharing(data: DataProto) -> PromptSharing:
    """The rows of ``data`` (B, P+R) that share prompts, and what each computes beside its leader."""
    tensors = data.batch
    return _sharing(tensors[ATTENTION_MASK], tensors[INPUT_IDS], tensors[RESPONSES].shape[1])


def _sharing(attention_mask: torch.Tensor, input_ids: torch.Tensor, response_length: int) -> PromptSharing:
    mask = attention_mask.bool()
    prompt_length = mask.shape[1] - response_length
    rows = torch.arange(mask.shape[0], device=mask.device)
    leaders = prompt_leaders(input_ids, attention_mask, prompt_length) if len(rows) else rows
    computed = mask.sum(dim=1) - (leaders != rows) * mask[:, :prompt_length].sum(dim=1)
    return PromptSharing(leaders=leaders.tolist(), computed=computed.tolist())


def balanced_order(lengths: Sequence[int], world_size: int, groups: Sequence[Hashable] | None = None) -> list[int]:
    """A permutation of the batch after which equal contiguous chunks (one per data-parallel rank,
    as DP_COMPUTE_PROTO splits) hold nearly equal numbers of tokens.

    Rows go longest first to the least-loaded rank that still has room; rank r holds as many rows
    as its chunk (the chunks of ``DataProto.chunk``; a batch that does not divide gives the last
    rank fewer). Within a rank the rows keep their original relative order. Use it as
    ``batch.reorder(balanced_order(lengths, world_size))``.

    ``groups``: a key per row (e.g. the prompt's uid); rows of one group go to one rank together
    when a rank has room for all of them, so that packing can share their prompt.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    total = len(lengths)
    chunk = -(-total // world_size)
    capacity = [max(0, min(chunk, total - r * chunk)) for r in range(world_size)]
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    units: dict[Hashable, list[int]] = {}
    for index in range(total):
        units.setdefault(groups[index] if groups is not None else index, []).append(index)

    def place(rows: list[int]) -> bool:
        open_ranks = [r for r in range(world_size) if len(ranks[r]) + len(rows) <= capacity[r]]
        if not open_ranks:
            return False
        rank = min(open_ranks, key=lambda r: (loads[r], len(ranks[r])))
        ranks[rank].extend(rows)
        loads[rank] += sum(lengths[i] for i in rows)
        return True

    for rows in sorted(units.values(), key=lambda rows: -sum(lengths[i] for i in rows)):
        if not place(rows):  # no rank has room for the whole group: its rows go one by one
            for index in sorted(rows, key=lambda i: -lengths[i]):
                place([index])
    return [index for rank in ranks for index in sorted(rank)]
