"""PromptDataLoader: batches per epoch, determinism, and exact resume from state_dict."""

import itertools

import numpy as np
import pytest
import torch
from data_configs import dataset_config

from hybridflow.data import PromptDataLoader, RLHFDataset
from hybridflow.data.tasks import write_task
from hybridflow.protocol import DataProto


class RowIds:
    """A dataset of `n` rows whose batches are just the row ids (fast, and easy to compare)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def collate(self, rows):
        return DataProto.from_dict({"row": torch.tensor(rows)})


def ids(batch):
    return batch.batch["row"].tolist()


def stream(loader):
    """Batches across epochs, as a trainer's epoch loop sees them."""
    while True:
        yield from loader


def take(loader, count):
    return [ids(b) for b in itertools.islice(stream(loader), count)]


def test_len_and_epoch_coverage():
    loader = PromptDataLoader(RowIds(10), batch_size=3, seed=1)
    assert len(loader) == 3  # drop_last: 10 // 3
    epoch0 = [ids(b) for b in loader]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    assert len(set(sum(epoch0, []))) == 9  # no row twice within an epoch
    assert loader.epoch == 1 and loader.state_dict()["position"] == 0
    epoch1 = [ids(b) for b in loader]
    assert epoch1 != epoch0  # a fresh permutation


def test_no_drop_last_keeps_the_remainder():
    loader = PromptDataLoader(RowIds(10), batch_size=3, shuffle=False, drop_last=False)
    assert len(loader) == 4
    assert [ids(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_order_is_a_function_of_seed_and_epoch():
    first = take(PromptDataLoader(RowIds(12), batch_size=4, seed=7), 9)
    again = take(PromptDataLoader(RowIds(12), batch_size=4, seed=7), 9)
    other = take(PromptDataLoader(RowIds(12), batch_size=4, seed=8), 9)
    assert first == again and first != other
    loader = PromptDataLoader(RowIds(12), batch_size=4, seed=7)
    expected = np.random.default_rng([7, 2]).permutation(12)  # epoch 2, computed without the loader
    assert sum(first[6:9], []) == expected.tolist()
    assert loader.order(2).tolist() == expected.tolist()


@pytest.mark.parametrize("consumed", [1, 2, 3, 4, 5, 7])  # mid-epoch, at and across epoch boundaries
def test_resume_continues_with_the_same_batch(consumed):
    reference = take(PromptDataLoader(RowIds(10), batch_size=3, seed=3), consumed + 3)
    loader = PromptDataLoader(RowIds(10), batch_size=3, seed=3)
    batches = stream(loader)
    for _ in range(consumed):
        next(batches)
    state = loader.state_dict()
    resumed = PromptDataLoader(RowIds(10), batch_size=3, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert take(resumed, 3) == reference[consumed:]


def test_state_after_three_batches_at_an_epoch_end():
    loader = PromptDataLoader(RowIds(9), batch_size=3, seed=0)
    batches = stream(loader)
    original = [ids(next(batches)) for _ in range(4)]
    fresh = PromptDataLoader(RowIds(9), batch_size=3, seed=0)
    iterator = iter(fresh)
    for _ in range(3):
        next(iterator)
    state = fresh.state_dict()
    assert (state["epoch"], state["position"], state["seed"]) == (1, 0, 0)
    restored = PromptDataLoader(RowIds(9), batch_size=3)
    restored.load_state_dict(state)
    assert ids(next(iter(restored))) == original[3]


def test_resume_refuses_a_different_batch_size_or_dataset():
    state = PromptDataLoader(RowIds(10), batch_size=3).state_dict()
    with pytest.raises(ValueError, match="batch_size=3"):
        PromptDataLoader(RowIds(10), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len=10"):
        PromptDataLoader(RowIds(11), batch_size=3).load_state_dict(state)


def test_too_few_rows_for_one_batch():
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        PromptDataLoader(RowIds(5), batch_size=8)


def test_with_a_real_dataset(tmp_path, tiny_tokenizer):
    paths = write_task("arithmetic", tmp_path, train=20, test=4, seed=0)
    dataset = RLHFDataset(paths["train"], tiny_tokenizer, dataset_config())
    loader = PromptDataLoader(dataset, batch_size=8, seed=0)
    batches = list(loader)
    assert len(batches) == len(loader) == 2
    batch = batches[0]
    assert batch.batch["input_ids"].shape[0] == 8
    keys = {"data_source", "reward_model", "extra_info", "raw_prompt", "index", "agent_name"}
    assert set(batch.non_tensor_batch) == keys
    assert batch.non_tensor_batch["agent_name"].tolist() == [""] * 8  # no agent_name column: the default loop
    order = np.random.default_rng([0, 0]).permutation(20)[:8]
    assert batch.non_tensor_batch["index"].tolist() == order.tolist()
