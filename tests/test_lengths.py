"""Tokens per row and balancing them over data-parallel ranks (hybridflow/lengths.py)."""

import random

import torch

from hybridflow.lengths import balanced_order, prompt_sharing
from hybridflow.protocol import DataProto


def _chunk_tokens(lengths: list[int], world_size: int) -> list[int]:
    chunk = len(lengths) // world_size
    return [sum(lengths[r * chunk : (r + 1) * chunk]) for r in range(world_size)]


def test_balanced_order_evens_out_the_ranks():
    lengths = list(range(100, 4, -6))  # 16 rows, longest first: the worst case for contiguous chunks
    order = balanced_order(lengths, 4)
    assert sorted(order) == list(range(16))
    before = _chunk_tokens(lengths, 4)
    after = _chunk_tokens([lengths[i] for i in order], 4)
    assert max(before) - min(before) == 4 * 4 * 6 * 3  # each chunk is 4 rows, 24 tokens shorter per row
    assert max(after) - min(after) <= 12
    assert sum(after) == sum(before)


def test_balanced_order_on_random_batches():
    rng = random.Random(0)
    for world_size in (2, 3, 8):
        lengths = [rng.randint(10, 500) for _ in range(world_size * 16)]
        order = balanced_order(lengths, world_size)
        assert sorted(order) == list(range(len(lengths)))
        tokens = _chunk_tokens([lengths[i] for i in order], world_size)
        assert max(tokens) - min(tokens) <= max(lengths)
        assert max(tokens) - min(tokens) < max(_chunk_tokens(lengths, world_size)) - min(
            _chunk_tokens(lengths, world_size)
        )
        chunk = len(lengths) // world_size
        assert all(
            order[r * chunk : (r + 1) * chunk] == sorted(order[r * chunk : (r + 1) * chunk]) for r in range(world_size)
        )


def test_balanced_order_keeps_each_group_on_one_rank():
    rng = random.Random(1)
    groups = [g for g in range(8) for _ in range(4)]  # 8 prompts x 4 samples, interleaved as the trainer repeats them
    lengths = [rng.randint(10, 200) for _ in groups]
    order = balanced_order(lengths, 2, groups=groups)
    assert sorted(order) == list(range(32))
    for rank in (0, 1):
        held = {groups[i] for i in order[rank * 16 : (rank + 1) * 16]}
        assert len(held) == 4  # four whole groups per rank
    tokens = _chunk_tokens([lengths[i] for i in order], 2)
    group_tokens = [sum(length for length, g in zip(lengths, groups) if g == k) for k in range(8)]
    assert max(tokens) - min(tokens) <= max(group_tokens)


def test_a_group_larger_than_a_rank_is_split_row_by_row():
    order = balanced_order([5, 4, 3, 2], 2, groups=["a", "a", "a", "b"])
    assert sorted(order) == [0, 1, 2, 3]
    assert _chunk_tokens([[5, 4, 3, 2][i] for i in order], 2) in ([7, 7], [8, 6], [6, 8])


def test_prompt_sharing_names_each_row_s_leader_and_what_it_computes_beside_it():
    prompt_a, prompt_b = [0, 5, 6, 7], [0, 0, 8, 9]  # left-padded: 3 and 2 tokens
    rows = [(prompt_a, [1, 2, 0]), (prompt_b, [3, 0, 0]), (prompt_a, [4, 4, 4]), (prompt_a, [5, 0, 0])]
    ids = torch.tensor([p + r for p, r in rows])
    mask = (ids != 0).long()
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, 4:]})
    sharing = prompt_sharing(data)
    assert sharing.leaders == [0, 1, 0, 0]
    # a leader computes its prompt and response, a follower its response only
    assert sharing.computed == [3 + 2, 2 + 1, 3, 1]
