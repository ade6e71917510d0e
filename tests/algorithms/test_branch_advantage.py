"""Advantages of agent sessions trained on several branches: a group estimator counts each session once (its last
branch), and each other branch takes its session's advantage; an estimator without groups takes every branch."""

import numpy as np
import pytest
import torch
from algo_configs import advantage_config

from hybridflow.algorithms import get_adv_estimator
from hybridflow.algorithms.branch_advantage import branch_advantages

EPS = 1e-6


def rows(scores, lengths, length=4):
    rewards, mask = torch.zeros(len(scores), length), torch.zeros(len(scores), length)
    for i, (score, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1.0
        rewards[i, n - 1] = score
    return rewards, mask


def test_grpo_counts_each_session_once_and_gives_its_branches_its_advantage():
    # one prompt, three sessions with rewards 1, 0, 0; session a has two earlier branches, c one; a padding row
    sessions = np.array(["a", "b", "c", "a", "a", "c", ""], dtype=object)
    last = torch.tensor([True, True, True, False, False, False, False])
    rewards, mask = rows([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], [3, 2, 4, 2, 1, 3, 0])
    index = np.array(["p"] * 7, dtype=object)
    adv, ret = branch_advantages(
        get_adv_estimator("grpo"), rewards, mask, index, advantage_config(), sessions=sessions, last_branch=last
    )
    # by hand: scores 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3)
    mean, std = 1 / 3, (1 / 3) ** 0.5
    session_adv = {"a": (1 - mean) / (std + EPS), "b": (0 - mean) / (std + EPS), "c": (0 - mean) / (std + EPS), "": 0.0}
    expected = torch.tensor([session_adv[s] for s in sessions])[:, None] * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)  # GRPO's returns are its advantages
    # the last branches' are what the estimator gives three samples without any branch
    alone, _ = get_adv_estimator("grpo")(rewards[:3], mask[:3], index[:3], advantage_config())
    torch.testing.assert_close(adv[:3], alone)


def test_an_estimator_without_groups_takes_every_branch_as_a_trajectory():
    sessions = np.array(["a", "a", "b"], dtype=object)
    last = torch.tensor([True, False, True])
    rewards, mask = rows([1.0, 1.0, 0.5], [3, 2, 4])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 0.4, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2]])
    index = np.array(["p", "p", "p"], dtype=object)
    gae = get_adv_estimator("gae")
    adv, ret = branch_advantages(
        gae, rewards, mask, index, advantage_config(), sessions=sessions, last_branch=last, values=values
    )
    expected_adv, expected_ret = gae(rewards, mask, index, advantage_config(), values)
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


@pytest.mark.parametrize("name", ["rloo", "grpo"])
def test_without_other_branches_it_is_the_estimator_itself(name):
    rewards, mask = rows([1.0, 0.0, 0.5, 0.2], [1, 2, 3, 4])
    index = np.array(["p", "p", "q", "q"], dtype=object)
    sessions = np.array(["s0", "s1", "s2", "s3"], dtype=object)
    estimator = get_adv_estimator(name)
    adv, ret = branch_advantages(
        estimator, rewards, mask, index, advantage_config(), sessions=sessions, last_branch=torch.ones(4, dtype=bool)
    )
    expected_adv, expected_ret = estimator(rewards, mask, index, advantage_config())
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)
    # a batch of no agent sessions (no session columns) is the estimator's too
    adv, ret = branch_advantages(estimator, rewards, mask, index, advantage_config(), sessions=None, last_branch=None)
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)
