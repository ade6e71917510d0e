"""Micro-batches: a fixed number of rows, or at most a token budget (row lengths from ``hybridflow/lengths.py``).

Every FSDP forward and backward is a collective (parameter all-gather, gradient reduce-scatter),
so all ranks must run the same number of micro-batches: the token-budget grouping is given the
largest count over the ranks as its minimum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto


def group_by_tokens(lengths: Sequence[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """Row indices in groups of at most ``max_tokens`` tokens each; a longer row is a group alone.

    First-fit decreasing: rows longest first, each into the first group with room. Then, while
    there are fewer than ``min_groups`` groups, the group with the most rows is halved (halves
    stay within the budget). Indices in a group are in decreasing length.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if min_groups > len(lengths):
        raise ValueError(f"cannot make {min_groups} non-empty groups of {len(lengths)} rows")
    groups: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((g for g, load in enumerate(loads) if load + lengths[index] <= max_tokens), None)
        if slot is None:
            groups.append([index])
            loads.append(lengths[index])
        else:
            groups[slot].append(index)
            loads[slot] += lengths[index]
    while len(groups) < min_groups:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        group = groups.pop(largest)
        groups[largest:largest] = [group[0::2], group[1::2]]  # alternate: both halves keep long and short rows
    return groups


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all data-parallel ranks (the value itself without a process group)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def micro_batch_groups(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """Rows of each micro-batch: consecutive runs of ``micro_batch_size`` rows, or, when ``max_tokens``
    is set, token-budget groups, as many on this rank as on the busiest one (collective)."""
    if max_tokens is None:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        return [
            list(range(s, min(s + micro_batch_size, len(lengths)))) for s in range(0, len(lengths), micro_batch_size)
        ]
    count = len(group_by_tokens(lengths, max_tokens))
    return group_by_tokens(lengths, max_tokens, min_groups=max_over_ranks(count))


def split_by_groups(data: DataProto, groups: list[list[int]]) -> list[DataProto]:
    """The micro-batches; a group of consecutive rows is a slice (a view, no copy)."""

    def take(group: list[int]) -> DataProto:
        consecutive = group == list(range(group[0], group[0] + len(group)))
        return data[group[0] : group[0] + len(group)] if consecutive else data[group]

    return [take(group) for group in groups]


def restore_order(parts: Sequence[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Per-group results (len(group), ...) back in the batch's row order: (B, ...)."""
    order = torch.tensor([i for group in groups for i in group], dtype=torch.long)
    stacked = torch.cat(list(parts))
    return stacked[torch.argsort(order.to(stacked.device))]
