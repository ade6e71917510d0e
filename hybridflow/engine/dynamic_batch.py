"""Micro-batches: a fixed number of rows, or at most a token budget (row lengths from ``hybridflow/lengths.py``).

Every FSDP forward and backward is a collective (parameter all-gather, gradient reduce-scatter),
so all ranks must run the same number of micro-batches: the token-budget grouping is given the
largest count over the ranks as its minimum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridflow.lengths import PromptSharing
from hybridflow.protocol import DataProto


def group_by_tokens(
    lengths: Sequence[int],
    max_tokens: int,
    min_groups: int = 1,
    sharing: PromptSharing | None = None,
    units: Sequence[int] | None = None,
) -> list[list[int]]:
    """Row indices in groups of at most ``max_tokens`` tokens each; a longer row is a group alone.

    First-fit decreasing: rows longest first, each into the first group with room. Then, while
    there are fewer than ``min_groups`` groups, the group with the most rows is halved (halves
    stay within the budget). Indices in a group are in decreasing length.

    ``sharing``: rows with one prompt go together, as one item of the tokens a packed pass computes for
    them (the prompt once); an item over the budget is split into its rows, each with its full length.
    Halving then alternates items, not rows, while the group has more than one. Any part of an item
    computes at most what the whole item does, so halves still stay within the budget.

    ``units``: a key per row; rows with one key are one item that is never split (a preference pair's chosen
    and rejected answers), over the budget or not. ValueError when ``min_groups`` would need a unit split.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if min_groups > len(lengths):
        raise ValueError(f"cannot make {min_groups} non-empty groups of {len(lengths)} rows")
    items: list[tuple[int, list[int]]] = []  # (tokens, rows)
    for rows in _items(len(lengths), sharing, units):
        tokens = sum(lengths[i] for i in rows) if sharing is None else sum(sharing.computed[i] for i in rows)
        if len(rows) > 1 and tokens > max_tokens and units is None:
            items.extend((lengths[i], [i]) for i in rows)
        else:
            items.append((tokens, rows))
    groups: list[list[list[int]]] = []  # each group: its items' rows
    loads: list[int] = []
    for tokens, rows in sorted(items, key=lambda item: -item[0]):  # stable: equal items keep their order
        slot = next((g for g, load in enumerate(loads) if load + tokens <= max_tokens), None)
        if slot is None:
            groups.append([rows])
            loads.append(tokens)
        else:
            groups[slot].append(rows)
            loads[slot] += tokens
    while len(groups) < min_groups:
        largest = max(range(len(groups)), key=lambda g: sum(map(len, groups[g])))
        group = groups.pop(largest)
        if len(group) == 1 and units is not None:
            raise ValueError(f"cannot make {min_groups} micro-batches without splitting a unit of rows")
        if len(group) == 1:  # one item: halve its rows
            group = [[i] for i in group[0]]
        groups[largest:largest] = [group[0::2], group[1::2]]  # alternate: both halves keep long and short items
    if units is not None:  # units in batch order, each unit's rows as they were (a pair: chosen, then rejected)
        return [sorted(i for rows in group for i in rows) for group in groups]
    # each group's rows by decreasing length: the order without ``sharing``, whatever the items
    return [sorted((i for rows in group for i in rows), key=lambda i: -lengths[i]) for group in groups]


def _items(count: int, sharing: PromptSharing | None, units: Sequence[int] | None) -> list[list[int]]:
    """The rows in items that micro-batches keep together: each unit of ``units`` (in order of first row), or else
    as ``_rows_by_prompt`` gives them."""
    if units is None:
        return _rows_by_prompt(count, sharing)
    if len(units) != count:
        raise ValueError(f"{len(units)} unit keys for {count} rows")
    items: dict[int, list[int]] = {}
    for index, unit in enumerate(units):
        items.setdefault(unit, []).append(index)
    return list(items.values())


def _rows_by_prompt(count: int, sharing: PromptSharing | None) -> list[list[int]]:
    """The rows in items: each alone, or with ``sharing`` the rows of each prompt (in order of first row)."""
    if sharing is None:
        return [[i] for i in range(count)]
    items: dict[int, list[int]] = {}
    for index, leader in enumerate(sharing.leaders):
        items.setdefault(leader, []).append(index)
    return list(items.values())


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all data-parallel ranks (the value itself without a process group)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def micro_batch_groups(
    lengths: Sequence[int],
    micro_batch_size: int,
    max_tokens: int | None,
    sharing: PromptSharing | None = None,
    units: Sequence[int] | None = None,
) -> list[list[int]]:
    """Rows of each micro-batch: consecutive runs of ``micro_batch_size`` rows, or, when ``max_tokens``
    is set, token-budget groups, as many on this rank as on the busiest one (collective).

    ``sharing`` (packed passes): rows with one prompt stay together, so each micro-batch computes a
    prompt once for all its rows there. Fixed-size micro-batches then take the rows in order of their
    prompt's first row (the same micro-batches when such rows are already consecutive, as rollouts give
    them; a shuffled mini-batch's n samples of a prompt were spread over its micro-batches, each
    computing the prompt again). Any partition gives the same update (``engine/update.py``), up to float
    rounding: the gradients are summed in another order.

    ``units`` (a key per row): rows with one key are never split over micro-batches. Fixed-size micro-batches
    then take whole units, as many as fit in ``micro_batch_size`` rows (at least one).
    """
    if max_tokens is None:
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if units is not None:
            return _whole_units(_items(len(lengths), sharing, units), micro_batch_size)
        order = [i for rows in _rows_by_prompt(len(lengths), sharing) for i in rows]
        # each micro-batch's rows in batch order: where the partition is as without ``sharing``, so is every bit
        return [sorted(order[s : s + micro_batch_size]) for s in range(0, len(order), micro_batch_size)]
    count = len(group_by_tokens(lengths, max_tokens, sharing=sharing, units=units))
    return group_by_tokens(lengths, max_tokens, min_groups=max_over_ranks(count), sharing=sharing, units=units)


def _whole_units(items: list[list[int]], micro_batch_size: int) -> list[list[int]]:
    """Consecutive items in micro-batches of at most ``micro_batch_size`` rows (an item larger alone)."""
    groups: list[list[int]] = []
    for rows in items:
        if groups and len(groups[-1]) + len(rows) <= micro_batch_size:
            groups[-1].extend(rows)
        else:
            groups.append(list(rows))
    return [sorted(group) for group in groups]


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
