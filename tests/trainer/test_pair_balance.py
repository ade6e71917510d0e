"""A pair is never split: the driver gives each data-parallel rank whole pairs, chosen before rejected, with about
as many tokens as the others; held-out batches padded for the ranks are padded with whole pairs."""

import random

import pytest
import torch

from hybridflow.batch_keys import ATTENTION_MASK
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop.supervised_trainer import unit_order


def pair_balanced(batch: DataProto, dp: int) -> DataProto:
    return batch.reorder(unit_order(batch, dp, unit=2))


def batch_of_pairs(pairs: int, seed: int) -> DataProto:
    rng = random.Random(seed)
    lengths = [rng.randint(3, 60) for _ in range(2 * pairs)]
    mask = torch.zeros((2 * pairs, 64), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    # the row number, to follow each row through the reordering
    return DataProto.from_dict({ATTENTION_MASK: mask, "row": torch.arange(2 * pairs)})


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_every_rank_gets_whole_pairs_in_order(dp, seed):
    batch = pair_balanced(batch_of_pairs(12, seed), dp)
    rows = batch.batch["row"].tolist()
    assert sorted(rows) == list(range(24))
    for share in batch.chunk(dp):
        got = share.batch["row"].tolist()
        assert len(got) % 2 == 0
        assert all(got[i] % 2 == 0 and got[i + 1] == got[i] + 1 for i in range(0, len(got), 2)), got
    if dp > 1:  # balanced: no rank holds more than the even split plus the longest pair
        tokens = [int(share.batch[ATTENTION_MASK].sum()) for share in batch.chunk(dp)]
        assert max(tokens) - min(tokens) <= 2 * 60


def test_a_held_out_batch_is_padded_with_whole_pairs_then_balanced():
    padded, pad = batch_of_pairs(5, 0).pad_to_divisor(2 * 4)  # 5 pairs over 4 ranks: 3 copies of pairs added
    assert pad == 6 and padded.batch["row"].tolist()[10:] == [0, 1, 2, 3, 4, 5]
    shares = pair_balanced(padded, 4).chunk(4)
    for share in shares:
        got = share.batch["row"].tolist()
        assert len(got) == 4 and got[0] % 2 == 0 and got[1] == got[0] + 1 and got[2] % 2 == 0 and got[3] == got[2] + 1
    with pytest.raises(ValueError, match="5 pairs do not divide over 4 ranks"):
        pair_balanced(batch_of_pairs(5, 0), 4)
