"""The rollout's config: training sampling extends SamplingConfig, seeds per (step, rank), keyword-only params."""

import dataclasses

import pytest

from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.config import SamplingConfig
from hybridflow.trainer.setup.config import default_config


def test_every_step_and_rank_samples_with_its_own_seed():
    rollout = dataclasses.replace(
        default_config().actor_rollout_ref.rollout, seed=7, seed_per_step=1000, seed_per_rank=10
    )
    assert rollout.sampling_seed(step=3, rank=2) == 7 + 3 * 1000 + 2 * 10
    seeds = {rollout.sampling_seed(step=s, rank=r) for s in range(50) for r in range(8)}
    assert len(seeds) == 50 * 8


def test_training_and_validation_sampling_come_from_their_own_sections():
    rollout = default_config().actor_rollout_ref.rollout
    assert isinstance(rollout, SamplingConfig) and isinstance(rollout.val_kwargs, SamplingConfig)
    train = SamplingParams.from_config(rollout, max_new_tokens=5, seed=1)
    validate = SamplingParams.from_config(rollout.val_kwargs, max_new_tokens=5, seed=1)
    assert (train.do_sample, validate.do_sample) == (rollout.do_sample, rollout.val_kwargs.do_sample) == (True, False)
    assert SamplingParams.greedy(max_new_tokens=5, seed=1) == dataclasses.replace(
        train, do_sample=False, temperature=1.0, top_p=1.0, top_k=-1
    )


def test_sampling_params_are_built_by_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(True, 1.0, 1.0, -1, 8, 0)
