"""Property tests of the estimators (hypothesis, derandomized)."""

import numpy as np
import torch
from algo_configs import advantage_config
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import get_adv_estimator

PROPERTY = settings(derandomize=True, max_examples=25, deadline=None)


def random_batch(seed, batch, length):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    return gen, rewards, mask


@PROPERTY
@given(
    group_sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grpo_advantages_have_zero_mean_per_group(group_sizes, norm, seed):
    batch = sum(group_sizes)
    _, rewards, mask = random_batch(seed, batch, 4)
    index = np.array([g for g, n in enumerate(group_sizes) for _ in range(n)])
    adv, _ = get_adv_estimator("grpo")(rewards, mask, index, advantage_config(norm_adv_by_std_in_grpo=norm))
    seq_adv = adv[:, 0]  # the same on every response token of a sequence
    for g in range(len(group_sizes)):
        assert abs(seq_adv[torch.from_numpy(index == g)].mean().item()) < 1e-9
        if group_sizes[g] > 1 and norm:  # normalised: unit (unbiased) std in the group
            assert abs(seq_adv[torch.from_numpy(index == g)].std().item() - 1.0) < 1e-3


@PROPERTY
@given(batch=st.integers(1, 4), length=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_gae_with_unit_gamma_and_lambda_is_return_minus_value(batch, length, seed):
    gen, rewards, mask = random_batch(seed, batch, length)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    config = advantage_config(gamma=1.0, lam=1.0, gae_whiten=False)
    adv, ret = get_adv_estimator("gae")(rewards, mask, np.arange(batch), config, values=values)
    # Monte-Carlo return: the sum of the rewards from t to the end of the response
    reward_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, reward_to_go)
    torch.testing.assert_close(adv, (reward_to_go - values) * mask)


@PROPERTY
@given(group_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_rloo_equals_explicit_leave_one_out(group_sizes, seed):
    batch = sum(group_sizes)
    _, rewards, mask = random_batch(seed, batch, 3)
    index = np.array([g for g, n in enumerate(group_sizes) for _ in range(n)])
    adv, _ = get_adv_estimator("rloo")(rewards, mask, index, advantage_config())
    scores = (rewards * mask).sum(-1)
    for i in range(batch):
        others = [j for j in range(batch) if index[j] == index[i] and j != i]
        expected = scores[i] - scores[others].mean() if others else torch.tensor(0.0, dtype=torch.float64)
        assert abs(adv[i, 0].item() - expected.item()) < 1e-9
