"""The bookkeeping of partial rollout against hand-computed values: token versions of continued rows, a
group's oldest version, and an open group that completes once every sample is done."""

import torch

from hybridflow.batch_keys import INTERRUPTED, RESPONSE_MASK, TOKEN_VERSIONS
from hybridflow.protocol import DataProto
from hybridflow.trainer.asynchronous.partial_rollout import OpenGroup, continued_versions, oldest_version


def rows(versions, masks, interrupted):
    return DataProto.from_dict(
        {
            TOKEN_VERSIONS: torch.tensor(versions),
            RESPONSE_MASK: torch.tensor(masks),
            INTERRUPTED: torch.tensor(interrupted),
        }
    )


def test_continued_rows_keep_their_prefix_versions():
    cut = rows([[3, 3, 3, 3, 3], [2, 3, 3, 3, 3]], [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], [True, True])
    assert continued_versions(cut, 5).tolist() == [[3, 3, 5, 5, 5], [2, 3, 3, 5, 5]]


def test_a_groups_version_is_its_oldest_generated_token():
    done = rows([[4, 4, 6, 6], [7, 7, 7, 7]], [[1, 1, 1, 0], [1, 1, 1, 1]], [False, False])
    assert oldest_version(done) == 4
    # a version under the mask's zeros (after the response ended) does not count
    assert oldest_version(rows([[5, 5, 1]], [[1, 1, 0]], [False])) == 5


def test_an_open_group_completes_when_its_last_sample_is_done():
    group = OpenGroup(prompt=DataProto.from_dict({TOKEN_VERSIONS: torch.zeros(1, 1)}), chunk=7)
    group.take(0, rows([[1, 1]], [[1, 1]], [False]))
    group.take(1, rows([[1, 1]], [[1, 0]], [True]))
    assert not group.complete and sorted(group.cut) == [1]
    group.take(1, rows([[1, 2]], [[1, 1]], [True]))  # cut again by a second push
    assert not group.complete
    group.take(1, rows([[1, 3]], [[1, 1]], [False]))
    assert group.complete
    assert group.rows().batch[TOKEN_VERSIONS].tolist() == [[1, 1], [1, 3]]  # in sample order
