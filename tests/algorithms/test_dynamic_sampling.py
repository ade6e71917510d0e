import numpy as np
import pytest
import torch

from hybridflow.algorithms.dynamic_sampling import (
    FilterGroupsConfig,
    informative_groups,
    rows_of_groups,
    select_groups,
)
from hybridflow.validation import InvalidSetting

UIDS = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)


def test_informative_groups_are_those_whose_rewards_differ():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    assert informative_groups(UIDS, rewards) == {"a": True, "b": False, "c": False, "d": False}  # d: one sample


def test_select_groups_fills_with_dropped_groups_only_when_short():
    assert select_groups(["a", "c", "e"], ["b", "d"], 2) == (["a", "c"], 0)
    assert select_groups(["a"], ["b", "d"], 3) == (["a", "b", "d"], 2)


def test_rows_of_groups_in_group_order():
    assert rows_of_groups(UIDS, ["c", "a"]) == [4, 5, 0, 1]


def test_round_cap():
    capped = FilterGroupsConfig(enable=True, max_num_gen_batches=2)
    assert capped.may_generate(1) and not capped.may_generate(2)
    assert FilterGroupsConfig(enable=True, max_num_gen_batches=0).may_generate(1000)
    with pytest.raises(InvalidSetting, match="max_num_gen_batches"):
        FilterGroupsConfig(enable=True, max_num_gen_batches=-1)
