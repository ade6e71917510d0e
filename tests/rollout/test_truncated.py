import torch

from hybridflow.batch_keys import TRUNCATED
from hybridflow.rollout.base import assemble_batch, response_mask_from, truncated_rows


def test_truncated_rows_are_those_without_a_stop_token():
    stop = [2]
    responses = torch.tensor(
        [
            [5, 6, 2, 0],  # stopped early
            [5, 6, 7, 2],  # stopped on the last slot: not truncated
            [5, 6, 7, 8],  # cut at the budget
        ]
    )
    mask = response_mask_from(responses, stop)
    assert truncated_rows(responses, mask, stop).tolist() == [False, False, True]
    assert truncated_rows(responses, torch.ones_like(responses), []).tolist() == [True, True, True]


def test_assemble_batch_carries_the_truncation_flag():
    prompts = torch.tensor([[1, 3], [1, 4]])
    responses = torch.tensor([[5, 2, 9], [5, 6, 7]])
    mask = response_mask_from(responses, [2])
    batch = assemble_batch(prompts, torch.ones_like(prompts), responses, mask, torch.zeros(2, 3), 0, [2])
    assert batch[TRUNCATED].tolist() == [False, True]
