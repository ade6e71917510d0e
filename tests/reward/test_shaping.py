"""DAPO's soft overlong penalty, by hand."""

import pytest
import torch

from hybridflow.reward.shaping import OverlongBufferConfig, apply_overlong_penalty, overlong_penalty
from hybridflow.validation import InvalidSetting


def test_overlong_penalty_by_hand():
    # budget 20 tokens, buffer the last 4, factor 2: free up to 16 tokens, then -0.5 per token
    lengths = torch.tensor([0, 10, 16, 17, 18, 20])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.5, -1.0, -2.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 2.0), expected)


def test_a_buffer_as_long_as_the_budget_charges_every_token():
    torch.testing.assert_close(overlong_penalty(torch.tensor([1, 3, 6]), 6, 6, 0.6), torch.tensor([-0.1, -0.3, -0.6]))


@pytest.mark.parametrize("changes, field", [({"len": 0}, "len"), ({"penalty_factor": -1.0}, "penalty_factor")])
def test_bad_settings_name_the_field(changes, field):
    with pytest.raises(InvalidSetting) as caught:
        OverlongBufferConfig(**({"enable": True, "len": 4, "penalty_factor": 1.0} | changes))
    assert caught.value.field == field


def test_the_penalty_goes_on_each_response_last_token():
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    config = OverlongBufferConfig(enable=True, len=2, penalty_factor=1.0)
    shaped, metrics = apply_overlong_penalty(scores, mask, config)
    # budget 4, buffer 2: length 3 -> -0.5 on token 2; length 4 -> -1 on token 3; empty -> 0
    expected = torch.tensor([[0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(shaped, expected)
    assert scores[0, 2] == 1.0  # the input is left as it was
    assert metrics["reward/overlong_penalty/mean"] == -0.5
    assert metrics["reward/overlong_penalty/fraction"] == pytest.approx(2 / 3)
